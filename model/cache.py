"""Decoding caches: a KV cache for attention layers, conv + SSM state for Mamba layers.

The KV cache is preallocated and grows by doubling, so a decode step writes one
slot instead of concatenating the whole history. Rows of one batch may hold histories of
different lengths: a row's keys are right-aligned in the buffer and its leading ``pad`` slots
are never attended (:func:`concat_caches` builds such a batch from caches of different
lengths; attention has no positional encoding, so where a key sits in the buffer does not
change what it contributes). Mamba states are per row and need no padding. A decode step writes the new
key / value into the KV buffer in place, and the decode plan's steps write a Mamba layer's new states into its
buffers too (the model's own forward returns new ones), so a cache is consumed by the step it is passed to:
:func:`clone_cache` first to keep or branch it.

Rows join and leave a batch by slot: a cache's buffers may hold more rows than the batch uses (``base``: the
whole buffers, of which the layer's tensors are the first rows). Rows that leave free their slots
(:meth:`HybridCache.fill_from_tail`), rows that join are written into free slots (:meth:`HybridCache.join`);
neither copies the rows that stay. :func:`concat_caches` makes such buffers when asked for spare rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def canonical_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a fresh row-major buffer of ``shape`` (size-1 dimensions included: a compiled graph's guards
    compare every stride, where ``is_contiguous`` ignores those of size-1 dimensions)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def prefix_of(t: Tensor, base: Tensor | None) -> bool:
    """Whether ``t`` is the first ``t.shape[0]`` rows of ``base`` (the same memory, the same strides): the rows
    of ``base`` past them are free slots of a batch."""
    return (
        base is not None
        and t.data_ptr() == base.data_ptr()
        and t.shape[1:] == base.shape[1:]
        and t.stride() == base.stride()
        and t.shape[0] <= base.shape[0]
    )


def in_buffers(tensors: tuple[Tensor, Tensor], base: tuple[Tensor, Tensor] | None) -> bool:
    """Whether a layer's two tensors are the first rows of its buffers ``base`` (both of them)."""
    return base is not None and prefix_of(tensors[0], base[0]) and prefix_of(tensors[1], base[1])


def spare_rows(tensors: tuple[Tensor, Tensor], base: tuple[Tensor, Tensor] | None) -> int:
    """Free rows after a layer's two tensors in their buffers ``base``: 0 unless both are prefixes of them."""
    return base[0].shape[0] - tensors[0].shape[0] if in_buffers(tensors, base) else 0


def buffers(tensors: tuple[Tensor, Tensor], base: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """The whole buffers a layer's two tensors are the first rows of: ``base`` when they are its prefixes,
    else the tensors themselves."""
    return base if in_buffers(tensors, base) else tensors


def kv_rows(t: Tensor, rows: Tensor, trim: int = 0) -> Tensor:
    """Batch rows ``rows`` of a KV buffer t (batch, kv_heads, capacity, head_dim) without its first ``trim`` slots:
    (len(rows), kv_heads, capacity - trim, head_dim) in a buffer of its own, row-major (canonical strides, size-1
    dimensions included) at storage offset 0.

    Never a view of the wider buffer: that would be a memory layout of its own to the compiled decode steps, whose
    graphs guard on strides (a graph per trimmed width), and ``contiguous`` keeps a view whose only odd stride is
    a size-1 dimension's."""
    out = t[rows, :, trim:]  # advanced indexing: a copy
    if out.stride() != canonical_strides(tuple(out.shape)) or out.storage_offset() != 0:
        out = out.new_empty(out.shape).copy_(out)
    return out


@dataclass
class KVCache:
    """Keys and values of one attention layer: (batch, kv_heads, capacity, head_dim); ``length`` used.

    ``pad`` (batch,) int64, or None for none: how many of a row's first ``length`` slots are padding
    (the row's own history is the last ``length - pad`` slots); attention masks them out. ``base``: buffers
    (rows >= batch, kv_heads, capacity, head_dim) whose first rows k and v are, the others free slots for rows
    that join (None: no free slots).
    """

    k: Tensor
    v: Tensor
    length: int = 0
    pad: Tensor | None = None
    base: tuple[Tensor, Tensor] | None = None

    def spare_rows(self) -> int:
        """Rows that can join in place (free rows of :attr:`base`)."""
        return spare_rows((self.k, self.v), self.base)

    def attention_mask(self, n: int) -> Tensor | None:
        """(batch, 1, 1, n) bool, True where a query may attend the first ``n`` slots; None without padding."""
        if self.pad is None:
            return None
        slots = torch.arange(n, device=self.pad.device)
        return (slots >= self.pad[:, None]).view(-1, 1, 1, n)

    def row_lengths(self) -> list[int]:
        """Tokens of history per row (``length`` minus the row's padding)."""
        if self.pad is None:
            return [self.length] * self.k.shape[0]
        return [self.length - p for p in self.pad.tolist()]

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, capacity: int, like: Tensor) -> KVCache:
        shape = (batch, kv_heads, max(capacity, 1), head_dim)
        return cls(like.new_zeros(shape), like.new_zeros(shape), 0)

    def reserve(self, need: int) -> None:
        """Make room for ``need`` slots in all: a full buffer is replaced by one of at least twice its capacity
        holding the same history (and as many free rows as it had)."""
        if need > self.k.shape[2]:
            cap = max(need, 2 * self.k.shape[2])
            rows = self.k.shape[0]
            grow = (rows + self.spare_rows(), self.k.shape[1], cap, self.k.shape[3])
            k_new, v_new = self.k.new_zeros(grow), self.v.new_zeros(grow)
            k_new[:rows, :, : self.length] = self.k[:, :, : self.length]
            v_new[:rows, :, : self.length] = self.v[:, :, : self.length]
            self.base = (k_new, v_new) if grow[0] > rows else None
            self.k, self.v = k_new[:rows], v_new[:rows]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add (batch, kv_heads, t, head_dim) keys/values; return views of the whole history."""
        need = self.length + k.shape[2]
        self.reserve(need)
        self.k[:, :, self.length : need] = k
        self.v[:, :, self.length : need] = v
        self.length = need
        return self.k[:, :, :need], self.v[:, :, :need]


@dataclass
class MambaCache:
    """Mamba state: ``conv`` (batch, conv_dim, kernel-1) last inputs, ``ssm`` (batch, heads, head_dim, state).

    The model keeps ``conv`` time-major in memory (a transposed view of (batch, kernel-1, conv_dim));
    any layout of that shape is accepted. ``base``: buffers of the same layouts with rows >= batch, whose first
    rows conv and ssm are, the others free slots for rows that join (None: no free slots).
    """

    conv: Tensor
    ssm: Tensor
    base: tuple[Tensor, Tensor] | None = None

    def spare_rows(self) -> int:
        """Rows that can join in place (free rows of :attr:`base`)."""
        return spare_rows((self.conv, self.ssm), self.base)

    def owned(self) -> bool:
        """Whether conv and ssm are the first rows of :attr:`base` (a step that writes them in place keeps the
        free slots)."""
        return in_buffers((self.conv, self.ssm), self.base)


class HybridCache:
    """Per-layer caches of a hybrid model (``None`` for MLP / MoE layers, which keep no state)."""

    def __init__(self, layers: list[KVCache | MambaCache | None]) -> None:
        self.layers = layers
        self.seen_tokens = 0

    def __getitem__(self, index: int) -> KVCache | MambaCache | None:
        return self.layers[index]

    def __setitem__(self, index: int, value: KVCache | MambaCache | None) -> None:
        self.layers[index] = value

    def select(self, rows: Tensor, trim: int = 0) -> HybridCache:
        """A cache holding only batch rows ``rows`` (e.g. to drop finished sequences).

        ``trim``: leading KV slots to drop from every row (padding all kept rows share, so at most the
        smallest kept ``pad``); the rows' histories are unchanged, and a KV buffer's capacity shrinks by ``trim``.
        Every KV buffer is one of the new cache's own (:func:`kv_rows`).
        """
        out: list[KVCache | MambaCache | None] = []
        for c in self.layers:
            if isinstance(c, KVCache):
                pad = None
                if c.pad is not None:
                    pad = c.pad[rows] - trim
                    if int(pad.min()) < 0:
                        raise ValueError(f"select: trim {trim} cuts into a row's history (pads {c.pad[rows].tolist()})")
                    pad = pad if bool(pad.any()) else None
                elif trim:
                    raise ValueError(f"select: trim {trim} on a cache without padding")
                out.append(KVCache(kv_rows(c.k, rows, trim), kv_rows(c.v, rows, trim), c.length - trim, pad))
            elif isinstance(c, MambaCache):
                out.append(MambaCache(c.conv[rows], c.ssm[rows]))
            else:
                out.append(None)
        new = HybridCache(out)
        new.seen_tokens = self.seen_tokens
        return new

    def fill_from_tail(self, dst: Sequence[int], src: Sequence[int], size: int) -> None:
        """Keep the first ``size`` batch rows, in place: rows ``src`` (each at least ``size``) are copied into the
        slots ``dst`` (each below ``size``) of the same buffers, then every buffer is cut to its first ``size``
        rows (a view: no other row moves, nothing is allocated).

        How a continuous batch lets rows leave: the rows that leave free their slots, the last rows move into
        those below the new size, and the step goes on over a prefix of the same buffers. A batch of n rows
        copies one row's state per leaving row where :meth:`select` copies all the kept rows. The row order
        changes (row ``src[i]`` is now row ``dst[i]``); the KV padding moves with its row and is not trimmed."""
        if len(dst) != len(src) or any(d >= size for d in dst) or any(r < size for r in src):
            raise ValueError(
                f"fill_from_tail: rows {list(src)} must move from at or past {size} into {list(dst)} below it"
            )
        out: list[KVCache | MambaCache | None] = []
        to = from_ = None
        for c in self.layers:
            if c is None:
                out.append(None)
                continue
            device = c.k.device if isinstance(c, KVCache) else c.ssm.device
            if to is None or to.device != device:
                to = torch.tensor(list(dst), dtype=torch.long, device=device)
                from_ = torch.tensor(list(src), dtype=torch.long, device=device)
            if isinstance(c, KVCache):
                if len(dst):
                    c.k[to] = c.k[from_]
                    c.v[to] = c.v[from_]
                pad = None
                if c.pad is not None:
                    pad = c.pad.clone()
                    pad[to] = pad[from_]
                    pad = pad[:size]
                    pad = pad if bool(pad.any()) else None
                out.append(KVCache(c.k[:size], c.v[:size], c.length, pad, buffers((c.k, c.v), c.base)))
            else:
                if len(dst):
                    c.conv[to] = c.conv[from_]
                    c.ssm[to] = c.ssm[from_]
                out.append(MambaCache(c.conv[:size], c.ssm[:size], buffers((c.conv, c.ssm), c.base)))
        self.layers = out

    def spare_rows(self) -> int:
        """Rows that can join in place: the fewest free rows of any layer with state (0 when one has none)."""
        spare = [c.spare_rows() for c in self.layers if c is not None]
        return min(spare) if spare else 0

    def join(self, other: HybridCache) -> bool:
        """Append ``other``'s rows (a cache of the same model) in the free rows of this cache's buffers, in place:
        the rows already here are not copied, each joining row's state is written once. Returns False, having
        changed nothing, when they do not fit: fewer free rows than ``other`` has rows, or an attention layer
        whose history in ``other`` is longer than here (its rows would have to move).

        A joining row's keys are written right-aligned, ending where this batch's histories end, the slots
        before them zeroed and counted as its padding (what :func:`concat_caches` does, without the copy of
        the rows already here)."""
        if len(self.layers) != len(other.layers):
            raise ValueError("join: the caches have different numbers of layers")
        first = next((c for c in other.layers if c is not None), None)
        if first is None:
            return False
        joining = first.k.shape[0] if isinstance(first, KVCache) else first.ssm.shape[0]
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if type(mine) is not type(theirs):
                raise ValueError(f"join: a layer holds {type(mine).__name__} here, {type(theirs).__name__} there")
            if mine is None:
                continue
            if mine.spare_rows() < joining or (isinstance(mine, KVCache) and theirs.length > mine.length):
                return False
        out: list[KVCache | MambaCache | None] = []
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if isinstance(mine, KVCache):
                rows, end, shift = mine.k.shape[0], mine.length, mine.length - theirs.length
                new = slice(rows, rows + joining)
                for base, src in zip(mine.base, (theirs.k, theirs.v), strict=True):
                    base[new, :, :shift] = 0
                    base[new, :, shift:end] = src[:, :, : theirs.length]
                device = mine.k.device
                own = mine.pad if mine.pad is not None else torch.zeros(rows, dtype=torch.long, device=device)
                add = theirs.pad if theirs.pad is not None else torch.zeros(joining, dtype=torch.long, device=device)
                pad = torch.cat([own, add.to(device) + shift])
                k, v = mine.base[0][: rows + joining], mine.base[1][: rows + joining]
                out.append(KVCache(k, v, end, pad if bool(pad.any()) else None, mine.base))
            elif isinstance(mine, MambaCache):
                rows = mine.ssm.shape[0]
                mine.base[0][rows : rows + joining] = theirs.conv
                mine.base[1][rows : rows + joining] = theirs.ssm
                conv, ssm = mine.base[0][: rows + joining], mine.base[1][: rows + joining]
                out.append(MambaCache(conv, ssm, mine.base))
            else:
                out.append(None)
        self.layers = out
        self.seen_tokens = max(self.seen_tokens, other.seen_tokens)
        return True

    def nbytes(self) -> int:
        total = 0
        for c in self.layers:
            if isinstance(c, KVCache):
                total += c.k.nbytes + c.v.nbytes
            elif isinstance(c, MambaCache):
                total += c.conv.nbytes + c.ssm.nbytes
        return total


def empty_cache(num_layers: int) -> HybridCache:
    """A cache whose layers fill themselves on the first forward (prefill)."""
    return HybridCache([None] * num_layers)


def clone_cache(cache: HybridCache) -> HybridCache:
    """A deep copy: decode steps write KV buffers in place."""
    out: list[KVCache | MambaCache | None] = []
    for c in cache.layers:
        if isinstance(c, KVCache):
            out.append(KVCache(c.k.clone(), c.v.clone(), c.length, None if c.pad is None else c.pad.clone()))
        elif isinstance(c, MambaCache):
            out.append(MambaCache(c.conv.clone(), c.ssm.clone()))
        else:
            out.append(None)
    new = HybridCache(out)
    new.seen_tokens = cache.seen_tokens
    return new


def concat_caches(caches: Sequence[HybridCache], rows: int = 0) -> HybridCache:
    """One batch holding the rows of ``caches`` (in order), whose histories may differ in length.

    Per attention layer the new fill length is the longest one; shorter histories are copied
    right-aligned and the slots before them become padding (``KVCache.pad``). Every input keeps
    its own tensors (they are copied). The caches must come from the same model (same layers).
    ``rows``: buffers of at least this many rows (the batch's first rows, the others free slots for rows that
    :meth:`HybridCache.join` later).
    """
    if not caches:
        raise ValueError("concat_caches: no cache given")
    if len({len(c.layers) for c in caches}) != 1:
        raise ValueError("concat_caches: the caches have different numbers of layers")
    out: list[KVCache | MambaCache | None] = []
    for i, per_layer in enumerate(zip(*(c.layers for c in caches), strict=True)):
        kinds = {type(c) for c in per_layer}
        if len(kinds) != 1:
            raise ValueError(f"concat_caches: layer {i} holds {sorted(k.__name__ for k in kinds)} across caches")
        first = per_layer[0]
        if isinstance(first, KVCache):
            fill = max(c.length for c in per_layer)
            spare = max(c.k.shape[2] - c.length for c in per_layer)
            used = sum(c.k.shape[0] for c in per_layer)
            shape = (max(used, rows), first.k.shape[1], max(fill + spare, 1), first.k.shape[3])
            k, v = first.k.new_zeros(shape), first.v.new_zeros(shape)
            pads, start = [], 0
            for c in per_layer:
                b, shift = c.k.shape[0], fill - c.length
                k[start : start + b, :, shift:fill] = c.k[:, :, : c.length]
                v[start : start + b, :, shift:fill] = c.v[:, :, : c.length]
                own = c.pad if c.pad is not None else torch.zeros(b, dtype=torch.long, device=k.device)
                pads.append(own + shift)
                start += b
            pad = torch.cat(pads)
            base = (k, v) if shape[0] > used else None
            out.append(KVCache(k[:used], v[:used], fill, pad if bool(pad.any()) else None, base))
        elif isinstance(first, MambaCache):
            used = sum(c.ssm.shape[0] for c in per_layer)
            batch, channels, taps = max(used, rows), first.conv.shape[1], first.conv.shape[2]
            conv = first.conv.new_empty((batch, taps, channels)).transpose(1, 2)  # time-major, as made
            ssm = first.ssm.new_empty((batch, *first.ssm.shape[1:]))
            conv[used:], ssm[used:] = 0, 0  # free slots: defined values
            start = 0
            for c in per_layer:
                conv[start : start + c.conv.shape[0]] = c.conv
                ssm[start : start + c.ssm.shape[0]] = c.ssm
                start += c.ssm.shape[0]
            base = (conv, ssm) if batch > used else None
            out.append(MambaCache(conv[:used], ssm[:used], base))
        else:
            out.append(None)
    new = HybridCache(out)
    new.seen_tokens = max(c.seen_tokens for c in caches)
    return new


__all__ = [
    "KVCache",
    "MambaCache",
    "HybridCache",
    "buffers",
    "canonical_strides",
    "concat_caches",
    "empty_cache",
    "clone_cache",
    "in_buffers",
    "kv_rows",
    "prefix_of",
    "spare_rows",
]
