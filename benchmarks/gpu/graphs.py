"""One greedy decode step over static buffers, captured as a CUDA graph, and how to compare it with eager decoding.

:class:`StaticStep` owns a (batch, 1) token buffer and a cache whose tensors stay where they are: the KV buffers
(preallocated by the prefill; a step writes its key / value into them in place) and one conv and one SSM state
per Mamba layer. Its step runs the model's own single-token forward (a budget model's
:class:`~model.decode.plan.DecodePlan`) on those buffers, copies the new Mamba states back into them, and writes
the greedy next token into the token buffer, so that calling it again continues decoding. On CUDA the step is
captured once as a CUDA graph (``torch.cuda.graph``, after warm-up steps on a side stream whose effects are
undone) and every call replays it; elsewhere every call runs it eagerly (the same buffers and copies, so the
harness itself is exercised on a CPU).

A graph replays the kernels recorded at capture with the shapes and host values of that moment: whatever the
step decides on the host (a KV length, a routing read with ``tolist``) is frozen, or makes the capture fail.
:func:`compare_states` therefore compares the whole decoding state (every KV slot written, every Mamba state)
with an eager run from the same start, not only the greedy tokens, which a small error may leave unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from benchmarks.gpu.common import rel_err
from model.cache import HybridCache, KVCache, MambaCache


def _snapshot(cache: HybridCache) -> list[tuple[Tensor, ...]]:
    """Copies of every state tensor of ``cache`` (for undoing warm-up steps)."""
    out: list[tuple[Tensor, ...]] = []
    for c in cache.layers:
        if isinstance(c, KVCache):
            out.append((c.k.clone(), c.v.clone()))
        elif isinstance(c, MambaCache):
            out.append((c.conv.clone(), c.ssm.clone()))
        else:
            out.append(())
    return out


def _restore(cache: HybridCache, saved: list[tuple[Tensor, ...]]) -> None:
    """Copy ``saved`` back into the same tensors (their addresses are what a graph reads)."""
    for c, tensors in zip(cache.layers, saved, strict=True):
        if isinstance(c, KVCache):
            c.k.copy_(tensors[0])
            c.v.copy_(tensors[1])
        elif isinstance(c, MambaCache):
            c.conv.copy_(tensors[0])
            c.ssm.copy_(tensors[1])


class StaticStep:
    """The greedy decode step of ``model`` on ``cache`` (used as the static buffers; pass a copy) after ``tok``
    (batch, 1). ``capture``: record it as a CUDA graph (CUDA only). Calling it advances the decoding by one
    token and returns the token buffer (batch, 1), overwritten by the next call. See the module docstring."""

    def __init__(self, model: nn.Module, cache: HybridCache, tok: Tensor, capture: bool, warmup: int = 2) -> None:
        self.model, self.cache = model, cache
        self.ids = tok.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            self._capture(warmup)

    def _work(self) -> HybridCache:
        """A cache object over the static tensors for one step: KV caches share the buffers, Mamba entries are
        the static states (the step replaces its cache's Mamba entries with new tensors)."""
        layers: list[KVCache | MambaCache | None] = []
        for c in self.cache.layers:
            if isinstance(c, KVCache):
                layers.append(KVCache(c.k, c.v, c.length, c.pad))
            elif isinstance(c, MambaCache):
                layers.append(MambaCache(c.conv, c.ssm))
            else:
                layers.append(None)
        work = HybridCache(layers)
        work.seen_tokens = self.cache.seen_tokens
        return work

    def _step(self, advance_host: bool) -> None:
        """One step on the static buffers; ``advance_host``: also advance the host-side lengths (eager calls)."""
        work = self._work()
        out = self.model(self.ids, cache=work)
        for static, new in zip(self.cache.layers, work.layers, strict=True):
            if isinstance(static, MambaCache):
                static.conv.copy_(new.conv)
                static.ssm.copy_(new.ssm)
            elif isinstance(static, KVCache) and advance_host:  # a grown buffer is adopted, too
                static.k, static.v, static.length, static.pad = new.k, new.v, new.length, new.pad
        if advance_host:
            self.cache.seen_tokens = work.seen_tokens
        self.ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))

    def _capture(self, warmup: int) -> None:
        saved, ids = _snapshot(self.cache), self.ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces, derived tensors) before capture
            for _ in range(warmup):
                self._step(advance_host=False)
        torch.cuda.current_stream().wait_stream(side)
        _restore(self.cache, saved)  # the warm-up steps never happened
        self.ids.copy_(ids)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(advance_host=False)
        self.graph = graph

    def __call__(self) -> Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step(advance_host=True)
        return self.ids


@dataclass
class StateDiff:
    """The largest :func:`~benchmarks.gpu.common.rel_err` between two decoding states, and where."""

    max_rel_err: float
    layer: int | None
    kind: str | None


def compare_states(reference: HybridCache, other: HybridCache) -> StateDiff:
    """Every KV slot ``reference`` has filled (``length``) and every Mamba state, layer by layer."""
    worst = StateDiff(0.0, None, None)
    for i, (a, b) in enumerate(zip(reference.layers, other.layers, strict=True)):
        if isinstance(a, KVCache):
            n = a.length
            pairs, kind = [(a.k[:, :, :n], b.k[:, :, :n]), (a.v[:, :, :n], b.v[:, :, :n])], "attention KV"
        elif isinstance(a, MambaCache):
            pairs, kind = [(a.conv, b.conv), (a.ssm, b.ssm)], "Mamba state"
        else:
            continue
        for ref, got in pairs:
            err = rel_err(got, ref)
            if err > worst.max_rel_err:
                worst = StateDiff(err, i, kind)
    return worst


def first_difference(a: Tensor, b: Tensor) -> int | None:
    """The first step (column) where two (batch, steps) token tensors differ in any row, or None."""
    differ = (a != b).any(0).nonzero()
    return None if differ.numel() == 0 else int(differ[0, 0])
