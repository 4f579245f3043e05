"""The host heap of a CPU distillation worker: glibc ``malloc`` settings and trims.

A ZeRO-3 worker gathers and frees every layer of the teacher and the student in every micro-step. On a
CPU the gathered copies are ordinary host allocations, and glibc keeps freed blocks below its mmap
threshold (which it raises by itself up to 32 MB as large blocks are freed) in the heap; the freed
gather buffers of one phase of the step then stay resident while the next phase allocates elsewhere,
and the resident peak counts memory the process no longer uses. This module sets glibc's knobs from
inside the process (``mallopt``) and hands free heap pages back (``malloc_trim``).

Design choices (measured by ``benchmarks/bench_zero_memory.py``; figures in RESULTS.md):

* Applied by the worker process itself, at its start, for CPU workers only: on a GPU the tensors that
  matter live in the CUDA caching allocator, which reuses its blocks and is not glibc's heap, so these
  settings would only slow the host side of a GPU run.
* Every setting is a plain ``mallopt`` / ``malloc_trim`` call: no ``LD_PRELOAD`` of another allocator
  and no environment variable that must be set before the interpreter starts (glibc reads its
  tunables then), so the policy travels with the config.
* Where glibc is not the C library (musl, macOS) every call is a no-op that reports False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )
    ]  # fmt: skip


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


class HostHeapConfig(BaseModel):
    """glibc heap settings of a CPU worker (ignored by GPU workers)."""

    model_config = ConfigDict(extra="forbid")

    mmap_threshold: int | None = Field(
        None,
        ge=0,
        description="Bytes from which a block gets its own mapping, returned to the system when freed "
        "(mallopt M_MMAP_THRESHOLD; also stops glibc from raising the threshold by itself). None: glibc's "
        "dynamic threshold (128 KB, raised up to 32 MB as large blocks are freed).",
    )
    arena_max: int | None = Field(
        None, ge=1, description="Most malloc arenas (mallopt M_ARENA_MAX); None: glibc's 8 per core."
    )
    trim: Literal["never", "micro_step", "phase"] = Field(
        "never",
        description="When free heap pages go back to the system (malloc_trim): never, after every micro-step, or "
        "after each phase of a micro-step (teacher forward, student forward and loss, backward, step).",
    )


def mallopt(param: int, value: int) -> bool:
    """glibc ``mallopt(param, value)``; False where unavailable or refused."""
    libc = _libc()
    fn = getattr(libc, "mallopt", None) if libc is not None else None
    return bool(fn is not None and fn(param, value))


def trim() -> bool:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim(0)``); False where unavailable or
    when nothing was released."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    return bool(fn is not None and fn(0))


def mallinfo() -> dict[str, int]:
    """glibc's heap statistics over all arenas (``mallinfo2``): ``arena`` (heap bytes), ``hblkhd`` (bytes in
    own mappings), ``uordblks`` (allocated heap bytes), ``fordblks`` (free heap bytes); {} where unavailable."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    info = fn()
    return {name: int(getattr(info, name)) for name, _ in _MallInfo2._fields_}


def apply(config: HostHeapConfig) -> dict[str, bool]:
    """Set the process's glibc options from ``config``; returns which calls took effect."""
    done: dict[str, bool] = {}
    if config.mmap_threshold is not None:
        done["mmap_threshold"] = mallopt(M_MMAP_THRESHOLD, config.mmap_threshold)
    if config.arena_max is not None:
        done["arena_max"] = mallopt(M_ARENA_MAX, config.arena_max)
    return done
