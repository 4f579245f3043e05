"""Batched autoregressive decoding with caches: greedy or sampled (temperature, top-p, seed).

Design choices:

* Rows are bucketed so that no padding ever enters a Mamba state: a bucket holds rows that
  start from the same number of already-consumed tokens and feed the same number of new ones
  (for plain prompts: prompts of one length). Each bucket is prefilled once, then decoded one
  token per step for all its unfinished rows; finished rows drop out of the batch.
* A row may start from a saved per-row cache (:class:`RowState`) and feed only its missing
  tokens. That is how a second phase continues a first one (thinking -> answer) without
  re-reading the prompt, and how state is carried from one budget's model to another's.
* Sampling draws every row from its own generator, seeded from ``(seed, row)``: a row's tokens do
  not depend on which other rows share its batch or on bucketing, so regrouping rows between
  phases keeps results reproducible. Greedy decoding takes the argmax and needs no generator.
* Stops: a stop id ends a row when sampled (the id is kept as the row's last token); a stop
  sequence of ids ends it when the row's tokens end with it (a suffix match, so a marker that
  the tokenizer splits into several tokens still stops the row; the whole sequence is kept as the
  row's tail; a one-id sequence is the stop-id case); a stop
  string ends it when it appears in the decoded tail of the row (needs ``decode``). The tail
  window is as many tokens as the longest stop string has characters, which covers any
  occurrence as long as every token decodes to at least one character.
* The sampled token that ends a row is never fed to the model, so a row's final state has
  consumed ``start + len(tokens) - 1`` tokens; callers that continue a row feed it themselves.
* Snapshots: with ``snapshot_ids`` the Mamba states of a row are copied right after it consumed
  one of those ids (e.g. line breaks); only the latest snapshot is kept (one per row, whatever
  the length, because a Mamba state is large at scale). Attention KV caches need no snapshot -- a prefix of the
  buffer is the state at any earlier length -- but Mamba states cannot be rewound, so a phase
  that cuts generated text at an earlier line break restarts from such a snapshot.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from model.cache import HybridCache, KVCache, MambaCache, concat_caches
from model.decode import dot_bf16
from model.decode.plan import decode_plan
from model.masks import ModelMask

Decode = Callable[[Sequence[int]], str]
"""Token ids -> text; needed for stop strings."""

StopReason = Literal["stop_id", "stop_sequence", "stop_string", "length"]


@dataclass
class SamplingParams:
    """``temperature`` 0 means greedy; ``top_p`` < 1 keeps the smallest nucleus with that mass.

    ``stop_ids`` end a row when sampled; ``stop_sequences`` (tuples of ids) end it when the row's
    tokens end with one of them; ``stop`` strings end it when they appear in its decoded text
    (``generate(..., decode=...)`` is then required).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.stop_ids = tuple(int(i) for i in self.stop_ids)
        self.stop = tuple(self.stop)
        self.stop_sequences = tuple(tuple(int(i) for i in seq) for seq in self.stop_sequences)
        if any(not seq for seq in self.stop_sequences):
            raise ValueError("stop_sequences: every stop sequence needs at least one id")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")


def row_seed(seed: int, row: int) -> int:
    """A per-row seed derived from the call's ``seed`` (stable across processes and batchings)."""
    return (seed * 1_000_003 + row * 7_919 + 17) % (2**63 - 1)


def greedy_tokens(logits: Tensor) -> Tensor:
    """logits: (..., vocab) -> the argmax over the last dimension (...,), ties to the lowest id.

    PyTorch's CPU argmax is a scalar loop: over a 49k vocabulary ~0.1 ms per float32 row, ~0.2 ms per bfloat16
    one (a one-row bfloat16 decode step of a 60M budget: ~4 ms; 16 rows: ~1-2 ms of a ~12 ms step). Where the
    decode operators are loaded in this process (:func:`model.decode.dot_bf16.loaded`: a compiled decode step
    built them) CPU logits take their vectorised argmax (:func:`~model.decode.dot_bf16.argmax_rows`, the same
    pick); otherwise half-precision logits are taken in float32 first (exactly: every bfloat16 / float16 value
    is one), whose argmax is faster than half precision's."""
    if logits.device.type == "cpu" and logits.dim() >= 1 and logits.shape[-1] > 0:
        if logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(-1) == 1 and dot_bf16.loaded():
            rows = logits.reshape(-1, logits.shape[-1])
            return dot_bf16.argmax_rows(rows).view(logits.shape[:-1])
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
    return logits.argmax(-1)


def sample_next(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """logits: (batch, vocab) -> next token ids (batch,)."""
    if params.temperature == 0:
        return greedy_tokens(logits)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep tokens whose preceding cumulative mass is below top_p (the first is always kept)
        keep = (sorted_p.cumsum(-1) - sorted_p) < params.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------------- per-row states
@dataclass
class RowState:
    """The cache of ONE sequence after it consumed ``length`` tokens.

    ``layers[i]``: a :class:`KVCache` with k/v (1, kv_heads, >= length, head_dim) (only the first
    ``length`` slots are meaningful), a :class:`MambaCache` with conv (1, conv_dim, K-1) and ssm
    (1, heads, head_dim, state), or ``None`` for stateless layers. A Mamba snapshot has ``None``
    on attention layers too (their KV comes from a later state, truncated).
    """

    layers: list[KVCache | MambaCache | None]
    length: int


def take_row(cache: HybridCache, row: int, length: int, kv: bool = True) -> RowState:
    """Copy row ``row`` of a batched cache; the row has consumed ``length`` tokens (KV only if ``kv``).

    A row's keys are the last ``length`` filled slots of its KV buffers (the slots before them are
    padding when the batch holds longer histories, see :func:`model.cache.concat_caches`).
    """
    layers: list[KVCache | MambaCache | None] = []
    for c in cache.layers:
        if isinstance(c, KVCache) and kv:
            start = c.length - length
            if start < 0 or (c.pad is not None and start != int(c.pad[row])):
                have = c.row_lengths()[row]
                raise ValueError(f"take_row: row {row} holds {have} tokens of history, not {length}")
            k = c.k[row : row + 1, :, start : c.length].clone()
            layers.append(KVCache(k, c.v[row : row + 1, :, start : c.length].clone(), length))
        elif isinstance(c, MambaCache):
            layers.append(MambaCache(c.conv[row : row + 1].clone(), c.ssm[row : row + 1].clone()))
        else:
            layers.append(None)
    return RowState(layers, length)


def rewind(final: RowState, snapshot: RowState) -> RowState:
    """The state at ``snapshot.length``: Mamba layers from the snapshot, KV from ``final`` truncated."""
    if snapshot.length > final.length:
        raise ValueError(f"cannot rewind a state of length {final.length} forward to {snapshot.length}")
    layers: list[KVCache | MambaCache | None] = []
    for f, s in zip(final.layers, snapshot.layers, strict=True):
        if isinstance(f, KVCache):
            n = snapshot.length
            layers.append(KVCache(f.k[:, :, :n], f.v[:, :, :n], n))
        else:
            layers.append(s)
    return RowState(layers, snapshot.length)


def stack_rows(states: Sequence[RowState]) -> HybridCache:
    """One batched cache from per-row states of equal length (batch order = ``states`` order)."""
    length = states[0].length
    if any(s.length != length for s in states):
        raise ValueError("stack_rows: every row state must have consumed the same number of tokens")
    out: list[KVCache | MambaCache | None] = []
    for per_layer in zip(*(s.layers for s in states), strict=True):
        first = per_layer[0]
        if isinstance(first, KVCache):
            k = torch.cat([c.k[:, :, :length] for c in per_layer])
            v = torch.cat([c.v[:, :, :length] for c in per_layer])
            out.append(KVCache(k, v, length))
        elif isinstance(first, MambaCache):
            out.append(MambaCache(torch.cat([c.conv for c in per_layer]), torch.cat([c.ssm for c in per_layer])))
        else:
            out.append(None)
    cache = HybridCache(out)
    cache.seen_tokens = length
    return cache


# ---------------------------------------------------------------------- decoding
@dataclass
class RowStart:
    """Where a row starts: ``tokens`` still to feed (non-empty), after ``state`` (None: from scratch)."""

    tokens: list[int]
    state: RowState | None = None


@dataclass
class RowOutput:
    """New tokens of one row (a stop id, if any, is the last), why it stopped, and optional states.

    ``state``: the final cache (with ``keep_state``); ``snapshot``: Mamba states right after the
    last consumed snapshot id (with ``snapshot_ids``).
    """

    tokens: list[int]
    stop_reason: StopReason
    state: RowState | None = None
    snapshot: RowState | None = None


def _device(model) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def hit_stop_string(tokens: list[int], stop: tuple[str, ...], decode: Decode) -> bool:
    """Whether a stop string occurs in the decoded tail of ``tokens`` (window: the longest stop's length)."""
    window = max(len(s) for s in stop)
    tail = decode(tokens[-window:])
    return any(s in tail for s in stop)


def ends_with_any(tokens: Sequence[int], sequences: Sequence[Sequence[int]]) -> bool:
    """Whether ``tokens`` ends with one of ``sequences`` (each a non-empty tuple of ids)."""
    n = len(tokens)
    return any(len(s) <= n and all(tokens[n - len(s) + k] == t for k, t in enumerate(s)) for s in sequences)


def stop_reason(
    tokens: list[int],
    max_new: int,
    stop_ids: frozenset[int] | set[int] | tuple[int, ...],
    stop_sequences: tuple[tuple[int, ...], ...],
    stop: tuple[str, ...],
    decode: Decode | None,
) -> StopReason | None:
    """Why a row whose last sampled token is ``tokens[-1]`` ends now (see the module docstring), or None
    while it goes on. The one rule of every decode loop (:func:`decode_rows`, serving's batches)."""
    if tokens[-1] in stop_ids:
        return "stop_id"
    if stop_sequences and ends_with_any(tokens, stop_sequences):
        return "stop_sequence"
    if stop and hit_stop_string(tokens, stop, decode):
        return "stop_string"
    if len(tokens) >= max_new:
        return "length"
    return None


class RowGroup:
    """Rows decoded together on one model: prefilled in one batch, then one token per row per step.

    The batched half of every decode loop (:func:`decode_rows`, and serving's continuous batches, which add
    per-row sampling, grammars and log-probabilities on top). ``logits``: (rows, vocab), the next-token
    logits of every row; ``pads[j]``: KV slots before row j's history (non-zero after :meth:`absorb` merged
    groups of different lengths). Single-token steps run the model's decode plan when there is no mask.
    """

    @torch.no_grad()
    def __init__(
        self, model, starts: Sequence[RowStart], mask: ModelMask | None = None, logits_to_keep: int = 1
    ) -> None:
        """Prefill: every row feeds its tokens from its state (rows of one group share both lengths).
        ``logits_to_keep`` 0 keeps every position's logits in :attr:`prefill_logits` (echoed prompts)."""
        self.model, self.mask, self.device = model, mask, _device(model)
        ids = torch.tensor([s.tokens for s in starts], dtype=torch.long, device=self.device)
        states = [s.state for s in starts]
        cache = stack_rows(states) if states[0] is not None else None
        self.length = (states[0].length if states[0] is not None else 0) + ids.shape[1]
        self.pads = [0] * len(starts)
        self.steps = 0
        res = model(ids, cache=cache, use_cache=True, mask=mask, logits_to_keep=logits_to_keep)
        self.prefill_logits = res.logits
        self.cache, self.logits = res.cache, res.logits[:, -1]
        self.plan = decode_plan(model) if mask is None else None

    def row_length(self, j: int) -> int:
        """Tokens row ``j`` has consumed."""
        return self.length - self.pads[j]

    def take(self, j: int, kv: bool = True) -> RowState:
        """A copy of row ``j``'s state (its Mamba states only, for a snapshot, when not ``kv``)."""
        return take_row(self.cache, j, self.row_length(j), kv=kv)

    def keep_rows(self, rows: list[int]) -> list[int]:
        """Keep only ``rows`` (batch indices); returns the kept rows' old indices in their new batch order.

        Rows leave by slot (:meth:`~model.cache.HybridCache.fill_from_tail`): the last kept rows move into the
        slots the leaving rows free, one row's state each, and the batch goes on over a prefix of its buffers.
        When every kept row has padding in common (the longest histories left), they are copied out in order
        instead (:meth:`~model.cache.HybridCache.select`), that padding dropped, so attention stops reading it."""
        pads = [self.pads[j] for j in rows]
        trim = min(pads)
        if trim:
            self.cache = self.cache.select(torch.tensor(rows, device=self.device), trim=trim)
            self.logits = self.logits.index_select(0, torch.tensor(rows, device=self.logits.device))
            self.pads = [p - trim for p in pads]
            self.length -= trim
            return list(rows)
        size, kept = len(rows), set(rows)
        holes = [j for j in range(size) if j not in kept]
        movers = [j for j in rows if j >= size]  # as many as the holes
        self.cache.fill_from_tail(holes, movers, size)
        order = list(range(size))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        self.logits = self.logits.index_select(0, torch.tensor(order, device=self.logits.device))
        self.pads = [self.pads[j] for j in order]
        return order

    def capacity(self) -> int:
        """Rows this group holds and can take in place (free slots of its buffers: :meth:`absorb`)."""
        return len(self.pads) + self.cache.spare_rows()

    def absorb(self, other: RowGroup, rows: int = 0) -> None:
        """Append ``other``'s rows (same model, both about to sample): shorter histories left-padded.

        Rows join by slot (:meth:`~model.cache.HybridCache.join`): written into the free rows of this group's
        buffers when there are enough and no history of ``other`` is longer than this group's; otherwise both
        are copied into new buffers (:func:`~model.cache.concat_caches`) of at least ``rows`` rows (the batch's
        most), so that later rows join in place."""
        length = max(self.length, other.length)
        if not self.cache.join(other.cache):
            self.cache = concat_caches([self.cache, other.cache], rows=rows)
        self.pads = [p + length - self.length for p in self.pads] + [p + length - other.length for p in other.pads]
        self.logits = torch.cat([self.logits, other.logits])
        self.length = length

    @torch.no_grad()
    def feed(self, tokens: Sequence[int]) -> None:
        """One single-token step: row j consumes ``tokens[j]``; updates the cache and :attr:`logits`."""
        tok = torch.tensor(list(tokens), dtype=torch.long, device=self.device).unsqueeze(1)
        if self.plan is not None:
            res = self.plan(tok, self.cache)
        else:
            res = self.model(tok, cache=self.cache, mask=self.mask)
        self.cache, self.logits = res.cache, res.logits[:, -1]
        self.length += 1
        self.steps += 1


@torch.no_grad()
def _decode_group(
    model,
    starts: list[RowStart],
    params: SamplingParams,
    mask: ModelMask | None,
    decode: Decode | None,
    seeds: list[int | None],
    keep_state: bool,
    snapshot_ids: frozenset[int],
) -> list[RowOutput]:
    """Rows that all resume from the same length and feed the same number of tokens."""
    b = len(starts)
    out = [RowOutput([], "length") for _ in range(b)]
    if params.max_new_tokens == 0:
        return out
    group = RowGroup(model, starts, mask)
    gens = [None if s is None else torch.Generator(device=group.device).manual_seed(s) for s in seeds]
    stop_ids = frozenset(params.stop_ids)
    alive = list(range(b))  # original row of each live batch row
    while True:
        logits = group.logits
        if params.temperature == 0:
            nxt = greedy_tokens(logits).tolist()
        else:
            nxt = [int(sample_next(logits[j : j + 1], params, gens[r])) for j, r in enumerate(alive)]
        keep_rows = []
        for j, (r, tok) in enumerate(zip(alive, nxt, strict=True)):
            row = out[r]
            row.tokens.append(tok)
            why = stop_reason(row.tokens, params.max_new_tokens, stop_ids, params.stop_sequences, params.stop, decode)
            if why is None:
                keep_rows.append(j)
                continue
            row.stop_reason = why
            if keep_state:  # the row's last token is not fed: the state holds everything before it
                row.state = group.take(j)
        if not keep_rows:
            break
        if len(keep_rows) < len(alive):
            order = group.keep_rows(keep_rows)
            alive = [alive[j] for j in order]
            nxt = [nxt[j] for j in order]
        group.feed(nxt)
        if snapshot_ids:
            for j, (r, tok) in enumerate(zip(alive, nxt, strict=True)):
                if tok in snapshot_ids:
                    out[r].snapshot = group.take(j, kv=False)
    return out


def decode_rows(
    model,
    starts: Sequence[RowStart],
    params: SamplingParams,
    mask: ModelMask | None = None,
    decode: Decode | None = None,
    seeds: Sequence[int] | None = None,
    keep_state: bool = False,
    snapshot_ids: Sequence[int] = (),
) -> list[RowOutput]:
    """Decode every row (any mix of lengths and saved states); outputs in input order.

    ``seeds`` gives each row's sampling seed (default: :func:`row_seed` of ``params.seed`` and the
    row index; unseeded when ``params.seed`` is None). ``keep_state`` returns each row's final
    cache; ``snapshot_ids`` records Mamba snapshots after those ids are consumed (module docstring).
    """
    if params.stop and decode is None:
        raise ValueError("stop strings need a decode function (token ids -> text); pass decode=")
    if seeds is not None and len(seeds) != len(starts):
        raise ValueError(f"seeds: got {len(seeds)} seeds for {len(starts)} rows")
    buckets: dict[tuple[int, int, bool], list[int]] = defaultdict(list)
    for i, s in enumerate(starts):
        if len(s.tokens) == 0:
            raise ValueError(f"row {i} has no token to feed; every row needs at least one")
        start = s.state.length if s.state is not None else 0
        buckets[(start, len(s.tokens), s.state is not None)].append(i)
    outputs: list[RowOutput | None] = [None] * len(starts)
    for key in sorted(buckets):
        rows = buckets[key]
        if params.temperature == 0:
            row_seeds: list[int | None] = [None] * len(rows)
        elif seeds is not None:
            row_seeds = [int(seeds[i]) for i in rows]
        elif params.seed is not None:
            row_seeds = [row_seed(params.seed, i) for i in rows]
        else:
            row_seeds = [int(torch.randint(0, 2**62, ()).item()) for _ in rows]
        group = [starts[i] for i in rows]
        outs = _decode_group(model, group, params, mask, decode, row_seeds, keep_state, frozenset(snapshot_ids))
        for i, o in zip(rows, outs, strict=True):
            outputs[i] = o
    return outputs  # type: ignore[return-value]


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    mask: ModelMask | None = None,
    decode: Decode | None = None,
) -> tuple[list[list[int]], list[bool]]:
    """Decode every prompt (token id lists, any lengths). Returns (new tokens, stopped) per prompt.

    ``stopped`` is True when a row ended on a stop id or a stop string rather than on length.
    """
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    outs = decode_rows(model, [RowStart(list(p)) for p in prompts], params, mask, decode)
    return [o.tokens for o in outs], [o.stop_reason != "length" for o in outs]


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` cut before the earliest occurrence of any stop string (unchanged if none occurs)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]
