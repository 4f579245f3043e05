"""bfloat16 projections on the CPU's bfloat16 instructions, for the compiled decode step: one row on the
dot-product instruction, several rows on AMX tiles.

Inductor generates a one-row projection (:func:`~model.decode.step_functions.gemv`) as a loop that widens
every bfloat16 weight to float32 and multiplies and adds it; on a CPU with AVX512_BF16 one ``vdpbf16ps``
does the widening, the two products and the sum for 32 weights at once. Measured on a 2-core Xeon (AMX /
avx512_bf16), one 49,152 x 512 GEMV: the generated loop ~22-28 GB/s whatever the weights' size (its
arithmetic is the bound), the dot-product loop ~70 GB/s from the L2 cache, ~35-44 from L3, ~21 from memory
(``benchmarks/RESULTS.md``). So the one-row step's bfloat16 projections call it (:func:`gemv`), while float32
weights, weights without a contiguous last dimension and CPUs without the instruction keep the generated loop.

Several rows (a batch of streams) are GEMMs of a few rows, where the library's bfloat16 GEMM reads the weight
at 6-12 GB/s on that machine (it re-lays the weight for its kernel at every call). :func:`gemm` and
:func:`gemm_grouped` (the routed experts, rows grouped by expert as ``F.grouped_mm`` takes them) read the
weight once as it is, 16 weight rows at a time as an AMX tile, against the rows of x packed once per call:
1.3-2.7x the library GEMM at 2-32 rows (RESULTS.md). Where the CPU or the kernel offers no AMX tiles they
fall back to the dot-product loop, which only pays up to ~4 rows, so the several-rows step uses them only
where AMX runs (:func:`rows_available`).

Float32 weights of several rows take the same dot-product tiles in float32 (:func:`gemm_f32`,
:func:`gemm_f32_grouped`: fused multiply-adds, any row stride), where the library's float32 GEMM read the
budget views' weights at 6-10 GB/s and the graph ran float32 routed experts as a dense pass over every expert:
1.3-1.6x per 4- and 16-row step (RESULTS.md); ``STAR_ELASTIC_F32_ROWS=0`` switches them off.

The kernels (``dot_bf16.cpp``, beside this file) are operators of the ``star_elastic`` library, built with
the C++ compiler inductor already needs (``torch.utils.cpp_extension``, into ``$STAR_ELASTIC_CACHE/ext``, so
a later process loads the built library) and called from the compiled step's C++ wrapper through the
dispatcher. :func:`available` builds and loads them once per process and says whether they run here; a
failed build or a CPU without the instruction leaves the generated loop, with the reason in
:func:`unavailable_reason`. ``STAR_ELASTIC_DOT_BF16=0`` switches them all off (the references: the generated
loop and the library GEMMs), ``STAR_ELASTIC_AMX_BF16=0`` only the several-rows ones.

Reference and test: ``tests/unit/test_dot_bf16.py`` compares every operator, on both of its paths, with
float64 dot products of the same bfloat16 values, and compiled steps of one row and of several with them
against the same graphs without them and against the eager steps.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from model.cache_folder import cache_folder

log = logging.getLogger(__name__)

SWITCH_ENV = "STAR_ELASTIC_DOT_BF16"
ROWS_SWITCH_ENV = "STAR_ELASTIC_AMX_BF16"
F32_ROWS_SWITCH_ENV = "STAR_ELASTIC_F32_ROWS"
SOURCE = Path(__file__).with_name("dot_bf16.cpp")

_lock = threading.Lock()
_state: dict[str, object] = {}


def build_folder() -> Path:
    """Where the operators' library is built: ``$STAR_ELASTIC_CACHE/ext/dot_bf16-<torch version>`` (a library
    is built for one torch)."""
    version = torch.__version__.replace("+", "_")
    return cache_folder() / "ext" / f"dot_bf16-{version}"


def _load() -> str | None:
    """Build (or load the built) library and register its fake kernels; the reason it cannot run, or None."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return f"switched off ({SWITCH_ENV}=0)"
    if not hasattr(torch.ops.star_elastic, "gemv_bf16"):
        from torch.utils import cpp_extension

        folder = build_folder()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(
                name="star_elastic_dot_bf16",
                sources=[str(SOURCE)],
                build_directory=str(folder),
                # at::parallel_for is OpenMP pragmas in torch's headers: without -fopenmp it runs one thread
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except Exception as e:  # no compiler, no headers, ...: the generated loop stays
            return f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        _register_fakes()
    if not torch.ops.star_elastic.dot_bf16_supported():
        return "this CPU has no bfloat16 dot-product instruction (AVX512_BF16)"
    return None


def _register_fakes() -> None:
    """Shapes for tracing (``torch.compile`` runs the graph on fake tensors first)."""

    @torch.library.register_fake("star_elastic::gemv_bf16")
    def _(x: Tensor, w: Tensor) -> Tensor:
        return w.new_empty((w.shape[0],), dtype=torch.float32)

    @torch.library.register_fake("star_elastic::gemv_bf16_gather")
    def _(x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        return w.new_empty((x.shape[0], w.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("star_elastic::gemm_bf16")
    def _(x: Tensor, w: Tensor) -> Tensor:
        return w.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("star_elastic::gemm_bf16_grouped")
    def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        return w.new_empty((x.shape[0], w.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("star_elastic::gemm_f32")
    def _(x: Tensor, w: Tensor) -> Tensor:
        return w.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("star_elastic::gemm_f32_grouped")
    def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        return w.new_empty((x.shape[0], w.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("star_elastic::argmax_rows")
    def _(logits: Tensor) -> Tensor:
        return logits.new_empty((logits.shape[0],), dtype=torch.long)


def available() -> bool:
    """Whether the bfloat16 dot-product operators run in this process (built and loaded on the first call)."""
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _load()
            if _state["reason"] is not None:
                log.info("bfloat16 dot-product GEMV not used: %s", _state["reason"])
        return _state["reason"] is None


def loaded() -> bool:
    """Whether the operators already run in this process (:func:`available` was asked and said yes); unlike
    :func:`available` it never builds them (for callers that should not pay for a build, e.g. a greedy pick)."""
    return "reason" in _state and _state["reason"] is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    reason = _state.get("reason")
    return reason if isinstance(reason, str) else None


def rows_available() -> bool:
    """Whether bfloat16 projections of several rows take the AMX operators (:func:`gemm`, :func:`gemm_grouped`):
    the operators run here (:func:`available`), the CPU has AMX tiles for bfloat16 and the kernel lets this
    process use them, and ``STAR_ELASTIC_AMX_BF16`` is not ``0``."""
    if not available() or os.environ.get(ROWS_SWITCH_ENV, "1") == "0":
        return False
    return bool(torch.ops.star_elastic.dot_bf16_amx_supported())


def rows_unavailable_reason() -> str | None:
    """Why :func:`rows_available` is False, or None when it is True."""
    if not available():
        return unavailable_reason()
    if os.environ.get(ROWS_SWITCH_ENV, "1") == "0":
        return f"switched off ({ROWS_SWITCH_ENV}=0)"
    if not torch.ops.star_elastic.dot_bf16_amx_supported():
        return "this CPU or kernel offers no AMX bfloat16 tiles"
    return None


def f32_rows_available() -> bool:
    """Whether float32 projections of several rows take the float32 operators (:func:`gemm_f32`,
    :func:`gemm_f32_grouped`): the operators run here (:func:`available`) and ``STAR_ELASTIC_F32_ROWS`` is not
    ``0``."""
    return available() and os.environ.get(F32_ROWS_SWITCH_ENV, "1") != "0"


def f32_rows_unavailable_reason() -> str | None:
    """Why :func:`f32_rows_available` is False, or None when it is True."""
    if not available():
        return unavailable_reason()
    if os.environ.get(F32_ROWS_SWITCH_ENV, "1") == "0":
        return f"switched off ({F32_ROWS_SWITCH_ENV}=0)"
    return None


def set_prefetch(on: bool) -> bool:
    """Whether each task of the operators prefetches the rows two tasks ahead (on by default: weights that come
    from memory stream faster so, ones already in the cache a little slower); returns the previous setting."""
    return bool(torch.ops.star_elastic.dot_bf16_prefetch(on))


def set_amx(on: bool) -> bool:
    """Whether :func:`gemm` / :func:`gemm_grouped` use AMX tiles where they can (on by default; off, they take
    the dot-product loop: a reference for tests); returns the previous setting."""
    return bool(torch.ops.star_elastic.dot_bf16_amx(on))


def gemv(x: Tensor, w: Tensor) -> Tensor:
    """x (in,) bfloat16 values (any float dtype holding them), w (out, in) bfloat16 -> (out,) float32."""
    return torch.ops.star_elastic.gemv_bf16(x.to(torch.bfloat16), w)


def gemv_gather(x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
    """Row j of x (k, in) by expert ``idx[j]`` of w (E, out, in) bfloat16 -> (k, out) float32."""
    return torch.ops.star_elastic.gemv_bf16_gather(x.to(torch.bfloat16), w, idx)


def argmax_rows(logits: Tensor) -> Tensor:
    """logits (rows, vocab) float32 or bfloat16, vocabulary contiguous -> (rows,) int64: ``logits.argmax(-1)``
    (the first largest value; the first NaN where there is one) on 16 running maxima at once."""
    return torch.ops.star_elastic.argmax_rows(logits)


def gemm(x: Tensor, w: Tensor) -> Tensor:
    """x (rows, in) bfloat16 values, w (out, in) bfloat16 -> (rows, out) float32 (AMX tiles where
    :func:`rows_available`; the dot-product loop otherwise)."""
    return torch.ops.star_elastic.gemm_bf16(x.to(torch.bfloat16), w)


def gemm_grouped(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Rows of x (T, in) grouped by expert, as ``F.grouped_mm`` takes them: expert e of w (E, out, in) bfloat16
    for rows ``offs[e-1]:offs[e]`` (offs (E,) int32, cumulative) -> (T, out) float32, rows past ``offs[-1]``
    zero; experts with no rows are not read."""
    return torch.ops.star_elastic.gemm_bf16_grouped(x.to(torch.bfloat16), w, offs)


def gemm_f32(x: Tensor, w: Tensor) -> Tensor:
    """x (rows, in), w (out, in) float32 -> (rows, out) float32: dot products of 4 weight rows by 4 rows of x
    at a time on fused multiply-adds (each output one 16-lane float32 sum, whatever rows are beside it)."""
    return torch.ops.star_elastic.gemm_f32(x.to(torch.float32), w)


def gemm_f32_grouped(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """:func:`gemm_grouped` for float32: rows of x (T, in) grouped by expert of w (E, out, in) float32 (offs (E,)
    int32, cumulative) -> (T, out) float32, rows past ``offs[-1]`` zero; experts with no rows are not read."""
    return torch.ops.star_elastic.gemm_f32_grouped(x.to(torch.float32), w, offs)
