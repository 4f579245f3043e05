"""The host heap of a CPU distillation worker: glibc ``malloc`` settings, applied by the worker to itself.

A ZeRO-3 worker gathers and frees every layer of the teacher and of the student in every micro-step (the
teacher once, the student for its forward and again for its backward, plus its gradients before their
reduce-scatter): a step allocates several times the model's bytes, mostly blocks of a fraction of a layer
to a whole layer. On a CPU these are glibc heap blocks. glibc serves a block from its own memory mapping
(returned to the system when freed) only from its mmap threshold up, and raises that threshold by itself,
up to 32 MB, each time such a block is freed; blocks below it come from the heap and stay resident after
they are freed. A ZeRO-3 worker therefore ends up holding the freed gather buffers of earlier layers beside
its live memory, and most of what partitioning saves does not show in the resident peak
(``benchmarks/RESULTS.md``, "Sharded distillation", has the figures).

Pinning the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising it) makes every block
of that size or more a mapping of its own, so the resident peak follows the live memory. The price is a page
fault for every page of every such block when it is first written: the kernel maps and zeroes fresh pages
instead of reusing the heap's, which dominates a CPU step's extra time at ZeRO-3 (RESULTS.md, same
section). ``host_heap: {}`` keeps glibc as it is: faster, more memory.

Design choices:

* Only ZeRO-3 CPU workers pin the threshold by default (:func:`policy_for`, threshold
  :data:`ZERO3_CPU_MMAP_THRESHOLD`: glibc's own starting value, kept instead of raised). Below ZeRO-3
  nothing is gathered: the same gradient and activation blocks come back every step and the heap reuses them
  (little free heap at ZeRO-0's peak), so returning them would multiply the page faults to save little.
* GPU workers never touch glibc: their gathered layers, gradients and activations live in the CUDA caching
  allocator, which reuses its own blocks; a pinned host threshold would only add page faults to the host
  side of a GPU run.
* The worker applies the setting to itself with ``mallopt`` when it starts, before the models are built: no
  ``LD_PRELOAD`` of another allocator and no environment variable that would have to be set before the
  interpreter starts (glibc reads its tunables only then), so the policy travels with the config.
* Where glibc is not the C library (musl, macOS), every call is a no-op that reports False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (``malloc.h``)."""

ZERO3_CPU_MMAP_THRESHOLD = 128 * 1024
"""Bytes from which a ZeRO-3 CPU worker's blocks get their own mapping: glibc's initial threshold, pinned."""


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


def _fn(name: str) -> Any:
    libc = _libc()
    return getattr(libc, name, None) if libc is not None else None


class HostHeapConfig(BaseModel):
    """glibc heap settings a CPU worker applies to itself (GPU workers ignore them)."""

    model_config = ConfigDict(extra="forbid")

    mmap_threshold: int | None = Field(
        None,
        ge=0,
        description="Bytes from which a block gets its own memory mapping, returned to the system when it is freed "
        "(mallopt M_MMAP_THRESHOLD; pinned: glibc no longer raises it). None: glibc's dynamic threshold (128 KB, "
        "raised up to 32 MB as large blocks are freed; freed blocks below it stay resident in the heap).",
    )


def policy_for(config: HostHeapConfig | None, zero_stage: int, use_gpu: bool) -> HostHeapConfig | None:
    """The settings a worker applies: None on a GPU; ``config`` when one is given; otherwise the ZeRO-3 CPU
    default (threshold :data:`ZERO3_CPU_MMAP_THRESHOLD`) at ZeRO-3 and glibc's defaults (None) below it."""
    if use_gpu:
        return None
    if config is not None:
        return config
    return HostHeapConfig(mmap_threshold=ZERO3_CPU_MMAP_THRESHOLD) if zero_stage == 3 else None


def apply(config: HostHeapConfig | None) -> dict[str, bool]:
    """Set this process's glibc options from ``config`` (None: nothing); returns which calls took effect."""
    done: dict[str, bool] = {}
    if config is not None and config.mmap_threshold is not None:
        mallopt = _fn("mallopt")
        done["mmap_threshold"] = bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, config.mmap_threshold))
    return done


def trim() -> bool:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim(0)``); False where unavailable or when
    nothing was released. Building under ``zero.Init`` and loading tensor by tensor allocates and frees a full copy
    of every tensor; one call after building returns what the heap kept of them, in milliseconds."""
    malloc_trim = _fn("malloc_trim")
    return bool(malloc_trim is not None and malloc_trim(0))


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory field in bytes (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_peak_bytes() -> int:
    """This process's resident-memory high-water mark: since :func:`restart_resident_peak` on Linux
    (``VmHWM``), else since the process started (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def restart_resident_peak() -> int:
    """Restart the high-water mark at the resident memory now and return that (bytes): the baseline a peak is
    measured above. Without the restart a transient peak while importing would hide what the run adds.
    Linux (``/proc/self/clear_refs``); elsewhere the mark is not restarted and the peak so far is returned."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return resident_peak_bytes()
    rss = _status_bytes("VmRSS")
    return rss if rss is not None else resident_peak_bytes()


def mallinfo() -> dict[str, int]:
    """glibc's heap statistics over all arenas (``mallinfo2``), in bytes: ``arena`` (heap), ``hblkhd`` (blocks in
    their own mappings), ``uordblks`` (allocated heap), ``fordblks`` (free heap); {} where unavailable."""
    fn = _fn("mallinfo2")
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    info = fn()
    return {name: int(getattr(info, name)) for name, _ in _MallInfo2._fields_}
