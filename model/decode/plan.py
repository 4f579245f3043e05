"""A decode plan: the single-token cached step of a model, built from its layers, in fewer operators.

:class:`DecodePlan` walks a :class:`~model.hybrid.HybridLM` once and keeps one step per layer
(:mod:`model.decode.layers`); calling it runs the model's forward for one token per row on a cache,
``input_ids`` (batch, 1) -> :class:`~model.hybrid.CausalLMOutput` with logits (batch, 1, vocab), the residual
stream kept as (batch, hidden). It computes the function :meth:`HybridLM.forward` computes (up to float
rounding), in the model's dtype and on its device; the model and its layers do not know about it.

A plan is built for one set of weights: the structure is captured, and a few small tensors are derived
from the weights once (the Mamba steps' ``A = -exp(A_log)``, float32 ``D`` / ``dt_bias``, time-major conv
taps). Most weights are read at every step, and a derived tensor whose source is replaced (``.to()``,
``.data =``, a new parameter) is derived again; but after changing weights in place (an optimiser step,
``load_state_dict``, ``copy_``) build a new plan (:meth:`DecodePlan.stale` tells whether one is needed).
Build a new plan after replacing a module of its model, too.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import HybridCache
from model.decode import dot_bf16, step_functions
from model.decode.compiled import CompiledStep
from model.decode.kernels import default_copy_bytes, prepare_decode_linears
from model.decode.layers import STEPS, ReferenceStep
from model.decode.ops import cast, linear, rms_norm
from model.hybrid import CausalLMOutput, HybridLM
from model.masks import ModelMask


class DecodePlan:
    """The fast single-token step of ``model`` (see the module docstring).

    Use :meth:`accepts` to check that a call is one it covers: one token per row, a cache, no mask, no
    logits-free forward, autograd off. Everything else is the model's own forward.
    """

    def __init__(self, model: HybridLM, max_copy_bytes: int | None = None, compiled: bool = False) -> None:
        """``max_copy_bytes``: the memory its projections' kernel copies may take
        (:func:`~model.decode.kernels.prepare_decode_linears`; None: the default bound). ``compiled``: each step
        as one compiled call (:mod:`model.decode.compiled`; CPU only, compiled by :meth:`warm`)."""
        backbone = model.model
        self.model = model
        self.embeddings = backbone.embeddings
        self.norm_f = backbone.norm_f
        self.lm_head = model.lm_head
        self.float_residual = model.config.residual_in_fp32
        self.steps = [STEPS.get(block.kind, ReferenceStep)(block) for block in backbone.layers]
        self.kernels = prepare_decode_linears(model, max_copy_bytes=max_copy_bytes)  # measured fastest kernels
        self.compile_requested = compiled
        self.compiled: CompiledStep | None = None
        if compiled and model.lm_head.weight.device.type == "cpu":
            left = (default_copy_bytes() if max_copy_bytes is None else max_copy_bytes) - self.kernels.copied_bytes
            self.compiled = CompiledStep(self.steps, self.norm_f, self.lm_head, max(left, 0))
        self.compile_seconds: float | None = None
        self.compile_error: str | None = None
        self.compile_unfit: str | None = None  # why warm found nothing the compiled step can run
        self.step_ms: dict[str, float] | None = None  # one-row step, eager and compiled (ms), measured by warm
        self.rows_ms: dict[str, float] | None = None  # the same at rows_ms_rows rows
        self.rows_ms_rows = 0

    def warm(self, prompt_tokens: int = 16, steps: int = 3, rounds: int = 5, calls: int = 4, rows: int = 8) -> float:
        """Compile the compiled steps now, and keep them only where they measure faster than the eager ones.

        For one row and for ``rows`` rows (0: one row only; 8: the middle of a serving batch's sizes), on a
        scratch cache (a prefill of ``prompt_tokens``), ``steps`` steps compile the graph (a first step may grow
        the attention caches; later ones meet the states' own memory layouts), so that no request pays for it;
        several rows compile the graph every batch of two rows or more runs (the row count is dynamic in it).
        Then ``rounds`` rounds of ``calls`` steps each, eager and compiled in turns, give each its median time
        per step (:attr:`step_ms` for one row, :attr:`rows_ms` for several); the compiled step is switched off
        where it is not faster, and dropped with its weight copies where it is faster for neither. Should
        compiling fail (no C++ compiler, an unsupported operator), the plan keeps its eager steps and
        :attr:`compile_error` says why. Returns (and keeps) the seconds taken."""
        if self.compiled is None:
            return 0.0
        start = time.perf_counter()
        compiled = self.compiled
        try:
            self.step_ms = self._measure(compiled, 1, prompt_tokens, steps, rounds, calls)
            if self.step_ms is None:  # nothing it can run: the eager plan, said so
                self.compiled, self.compile_seconds = None, time.perf_counter() - start
                self.compile_unfit = "a quantized or hooked projection, or quantized experts"
                return self.compile_seconds
            compiled.one_row = self.step_ms["compiled"] < self.step_ms["eager"]
            if rows > 1:
                self.rows_ms_rows = rows
                self.rows_ms = self._measure(compiled, rows, prompt_tokens, steps, rounds, calls)
                ms = self.rows_ms
                compiled.several_rows = ms is not None and ms["compiled"] < ms["eager"]
            self.compiled = compiled if compiled.one_row or (rows > 1 and compiled.several_rows) else None
        except Exception as err:  # noqa: BLE001 - any compiler failure leaves the eager plan, reported
            self.compile_error = f"{type(err).__name__}: {err}".splitlines()[0][:500]
            self.compiled = None
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def _measure(
        self, compiled: CompiledStep, rows: int, prompt_tokens: int, steps: int, rounds: int, calls: int
    ) -> dict[str, float] | None:
        """Compile ``compiled`` for ``rows`` rows, then its median step time and the eager steps' (ms); None when
        its steps cannot run compiled at all (:meth:`CompiledStep.arguments
        <model.decode.compiled.CompiledStep.arguments>`: a quantized or hooked projection, quantized experts)."""
        device = self.lm_head.weight.device
        with torch.inference_mode():
            ids = torch.zeros(rows, prompt_tokens, dtype=torch.long, device=device)
            cache = self.model(ids, use_cache=True, logits_to_keep=1).cache
            tok = torch.zeros(rows, 1, dtype=torch.long, device=device)
            self.compiled = compiled
            for _ in range(steps):
                self(tok, cache)
            if not compiled.runs(self.embeddings(tok.view(-1)), cache):
                return None
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(rounds):
                for name, fast in (("eager", None), ("compiled", compiled)):
                    self.compiled = fast
                    t = time.perf_counter()
                    for _ in range(calls):
                        self(tok, cache)
                    times[name].append((time.perf_counter() - t) / calls * 1e3)
        self.compiled = compiled
        return {k: statistics.median(v) for k, v in times.items()}

    def copied_bytes(self) -> int:
        """Bytes of weight copies this plan made: its kernels' and its compiled steps'."""
        return self.kernels.copied_bytes + (self.compiled.copied_bytes if self.compiled is not None else 0)

    def compile_summary(self) -> str:
        """One line on the compiled steps: kept or not, the measured step times, the time compiling took."""
        if self.compile_error is not None:
            return f"compiled steps failed, eager kept ({self.compile_error})"
        if self.compile_unfit is not None:
            return f"compiled steps cannot run here, eager kept ({self.compile_unfit})"
        if self.step_ms is None:
            return "compiled steps " + ("not warmed" if self.compiled is not None else "off")
        kept = self.compiled
        parts = [("one-row step", self.step_ms, kept is not None and kept.one_row)]
        if self.rows_ms is not None:
            parts.append((f"{self.rows_ms_rows}-row step", self.rows_ms, kept is not None and kept.several_rows))
        copies = kept.copied_bytes / 2**20 if kept is not None else 0.0
        verdicts = "; ".join(
            f"{name} compiled {ms['compiled']:.2f} ms vs eager {ms['eager']:.2f} ms: "
            + ("kept" if on else "slower, eager kept")
            for name, ms, on in parts
        )
        dtype = getattr(getattr(self.lm_head, "weight", None), "dtype", None)
        gemv = ""
        if dtype == torch.bfloat16:
            gemv = (
                ", bfloat16 dot-product GEMV "
                + ("on" if step_functions.DOT_BF16 else f"off: {dot_bf16.unavailable_reason() or 'not built'}")
                + ", AMX GEMM of several rows "
                + ("on" if step_functions.AMX_BF16 else f"off: {dot_bf16.rows_unavailable_reason() or 'not built'}")
            )
        elif dtype == torch.float32:
            gemv = ", float32 GEMM of several rows " + (
                "on" if step_functions.F32_ROWS else f"off: {dot_bf16.f32_rows_unavailable_reason() or 'not built'}"
            )
        return f"{verdicts} (compiled in {self.compile_seconds:.1f}s, {copies:.1f} MiB of copies{gemv})"

    def stale(self) -> bool:
        """Whether a weight changed in place since the plan was built, so that tensors it derived from the
        weights are out of date (build a new plan). It derives them again to compare: a check for tests
        and after weight updates, not for every step."""
        return any(step.stale() for step in self.steps)

    @staticmethod
    def accepts(
        input_ids: Tensor, cache: HybridCache | None, mask: ModelMask | None = None, skip_logits: bool = False
    ) -> bool:
        """Whether a forward with these arguments is a step this plan computes."""
        return (
            cache is not None
            and mask is None
            and input_ids.shape[1] == 1
            and not skip_logits
            and not torch.is_grad_enabled()
        )

    def __call__(self, input_ids: Tensor, cache: HybridCache, return_hidden: bool = False) -> CausalLMOutput:
        """input_ids: (batch, 1) -> logits (batch, 1, vocab); ``cache`` is updated (and returned)."""
        emb = self.embeddings
        if type(emb) is nn.Embedding and emb.padding_idx is None and emb.max_norm is None:
            x = F.embedding(input_ids.view(-1), emb._parameters["weight"])  # (batch, hidden)
        else:
            x = emb(input_ids.view(-1))
        if self.float_residual:
            x = cast(x, torch.float32)
        done = self.compiled(x, cache) if self.compiled is not None else None
        if done is not None:
            h, logits = done
            logits = logits[:, None]
        else:
            for i, step in enumerate(self.steps):
                x = step(x, cache, i)
            weight = self.norm_f._parameters["weight"]
            h = rms_norm(cast(x, weight.dtype), weight, self.norm_f.eps)
            logits = linear(self.lm_head, h)[:, None]
        cache.seen_tokens += 1
        return CausalLMOutput(logits=logits, cache=cache, hidden=h[:, None] if return_hidden else None)


def decode_plan(model: nn.Module) -> DecodePlan | None:
    """The plan a model's cached single-token steps can take, or None when there is none.

    A :class:`~model.decode.budget_view.BudgetModel` keeps its own (None when it applies a budget mask);
    any other :class:`~model.hybrid.HybridLM` gets a new plan; other modules get None.
    """
    own = getattr(model, "decode_plan", None)
    if callable(own):
        return own()
    return DecodePlan(model) if isinstance(model, HybridLM) else None


__all__ = ["DecodePlan", "decode_plan"]
