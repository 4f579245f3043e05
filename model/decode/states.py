"""The Mamba states the decode package allocated itself, which its steps may update in place.

A decode step that writes an SSM state in place saves a state-sized allocation and copy per Mamba layer
and token, but a state passed in by other code may be shared (a snapshot, a branch of a beam, a prompt
cache kept for reuse). So a step writes in place only a state it created itself in an earlier step:
:func:`own` records such a tensor, :func:`owned` asks. The record is kept here, beside the steps, not in
the cache or the layers: caches built by :mod:`model.cache` (``clone_cache``, ``select``,
``concat_caches``) and by :mod:`model.generate` hold copies, which are never recorded and so never written.

A state is recorded by identity (``id``) with a weak reference that proves the recorded object is the one
asked about: an ``id`` may be reused after its tensor is freed, and the weak reference's callback drops
the record when that happens.

As with the KV buffers the steps write in place, a cache is consumed by the step it is passed to: keep or
branch it with :func:`model.cache.clone_cache`, never by sharing its ``MambaCache`` objects.
"""

from __future__ import annotations

import weakref

from torch import Tensor

_OWNED: dict[int, weakref.ref[Tensor]] = {}


def own(state: Tensor) -> Tensor:
    """Record ``state`` (a tensor a step just allocated) as the decode package's; returns it."""
    key = id(state)
    _OWNED[key] = weakref.ref(state, lambda _ref, key=key: _OWNED.pop(key, None))
    return state


def owned(state: Tensor) -> bool:
    """Whether ``state`` is a tensor :func:`own` recorded (and so may be written in place)."""
    ref = _OWNED.get(id(state))
    return ref is not None and ref() is state


__all__ = ["own", "owned"]
