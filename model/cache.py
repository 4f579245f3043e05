"""Decoding caches: a KV cache for attention layers, conv + SSM state for Mamba layers.

The KV cache is preallocated and grows by doubling, so a decode step writes one
slot instead of concatenating the whole history. A decode step also updates in place
the SSM states of the :class:`MambaCache` objects the model created itself
(``owned=True``; no state-sized allocation per step). So a cache is consumed by the
step it is passed to: :func:`clone_cache` first to keep or branch it. A
:class:`MambaCache` built by other code (``owned=False``, the default) is never
written; the step returns a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class KVCache:
    """Keys and values of one attention layer: (batch, kv_heads, capacity, head_dim); ``length`` used."""

    k: Tensor
    v: Tensor
    length: int = 0

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, capacity: int, like: Tensor) -> KVCache:
        shape = (batch, kv_heads, max(capacity, 1), head_dim)
        return cls(like.new_zeros(shape), like.new_zeros(shape), 0)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add (batch, kv_heads, t, head_dim) keys/values; return views of the whole history."""
        t = k.shape[2]
        need = self.length + t
        if need > self.k.shape[2]:
            cap = max(need, 2 * self.k.shape[2])
            grow = (self.k.shape[0], self.k.shape[1], cap, self.k.shape[3])
            k_new, v_new = self.k.new_zeros(grow), self.v.new_zeros(grow)
            k_new[:, :, : self.length] = self.k[:, :, : self.length]
            v_new[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = k_new, v_new
        self.k[:, :, self.length : need] = k
        self.v[:, :, self.length : need] = v
        self.length = need
        return self.k[:, :, :need], self.v[:, :, :need]


@dataclass
class MambaCache:
    """Mamba state: ``conv`` (batch, conv_dim, kernel-1) last inputs, ``ssm`` (batch, heads, head_dim, state).

    The model keeps ``conv`` time-major in memory (a transposed view of (batch, kernel-1, conv_dim));
    any layout of that shape is accepted. ``owned``: the tensors belong to this cache alone, so a decode
    step may overwrite ``ssm`` (see the module docstring).
    """

    conv: Tensor
    ssm: Tensor
    owned: bool = field(default=False, compare=False)


class HybridCache:
    """Per-layer caches of a hybrid model (``None`` for MLP / MoE layers, which keep no state)."""

    def __init__(self, layers: list[KVCache | MambaCache | None]) -> None:
        self.layers = layers
        self.seen_tokens = 0

    def __getitem__(self, index: int) -> KVCache | MambaCache | None:
        return self.layers[index]

    def __setitem__(self, index: int, value: KVCache | MambaCache | None) -> None:
        self.layers[index] = value

    def select(self, rows: Tensor) -> HybridCache:
        """A cache holding only batch rows ``rows`` (e.g. to drop finished sequences)."""
        out: list[KVCache | MambaCache | None] = []
        for c in self.layers:
            if isinstance(c, KVCache):
                out.append(KVCache(c.k[rows], c.v[rows], c.length))
            elif isinstance(c, MambaCache):
                out.append(MambaCache(c.conv[rows], c.ssm[rows], owned=True))  # indexing copies
            else:
                out.append(None)
        new = HybridCache(out)
        new.seen_tokens = self.seen_tokens
        return new

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
    """A deep copy: decode steps write KV buffers and owned SSM states in place."""
    out: list[KVCache | MambaCache | None] = []
    for c in cache.layers:
        if isinstance(c, KVCache):
            out.append(KVCache(c.k.clone(), c.v.clone(), c.length))
        elif isinstance(c, MambaCache):
            out.append(MambaCache(c.conv.clone(), c.ssm.clone(), owned=True))
        else:
            out.append(None)
    new = HybridCache(out)
    new.seen_tokens = cache.seen_tokens
    return new


__all__ = ["KVCache", "MambaCache", "HybridCache", "empty_cache", "clone_cache"]
