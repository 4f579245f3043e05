"""The mamba-ssm kernels the model dispatches to on CUDA, against the references they replace.

* ``ssd_scan``: :func:`model.ssd.ssd_scan` (``mamba_chunk_scan_combined`` on CUDA) against
  :func:`model.ssd.ssd_scan_reference` (the sequential loop), with ``D`` and an initial state, on the shapes of
  ``tests/gpu/test_ssd_kernels.py`` plus one of model size, in float32 and bfloat16 (``x``, ``B``, ``C`` and the
  state in bfloat16; ``dt``, ``A``, ``D`` float32, as a model keeps them; the reference sees the same rounded
  values, upcast). Tolerances are the test's: 2e-3 in float32 (Triton's ``tl.dot`` may use TF32), 3e-2 in
  bfloat16, on :func:`~benchmarks.gpu.common.rel_err` of both ``y`` and the final state. Times: the kernel's first
  call (Triton compiles and autotunes), its fastest of 5 calls, the PyTorch chunked scan (what runs without the
  kernels) and the reference loop.
* ``causal_conv1d``: :meth:`model.mamba.Mamba2Mixer._conv` takes the ``causal_conv1d_fn`` kernel for a sequence
  without history; given an all-zero history it computes the same function in PyTorch. The kernel's output
  against that path on a float32 copy of the same (rounded) values.
* ``Mamba2Mixer forward``: a whole mixer on CUDA (both kernels) against the same mixer on the CPU in float32.

Without CUDA every row is skipped with the reason ``no CUDA``; on CUDA without the kernels a row fails and
names the missing package (``pip install -c constraints.txt -e '.[gpu]'``).
"""

from __future__ import annotations

import copy
from typing import Any

from benchmarks.gpu.common import Context, Options, rel_err, timed

SHAPES: list[tuple[int, ...]] = [
    # batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size: tests/gpu/test_ssd_kernels.py's, then model-sized
    (1, 64, 4, 32, 1, 16, 64),
    (2, 100, 8, 64, 2, 64, 32),
    (2, 257, 8, 64, 1, 128, 128),
    (2, 512, 32, 64, 8, 128, 128),
]
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}
DTYPES = ("float32", "bfloat16")
MIXER = dict(
    vocab_size=64, hidden_size=512, pattern="M", mamba_num_heads=16, mamba_head_dim=64, n_groups=4,
    ssm_state_size=128, chunk_size=128,
)  # fmt: skip
CONV_SHAPE = (2, 300)  # batch, seqlen
INSTALL = "pip install -c constraints.txt -e '.[gpu]'"


def _shapes(options: Options) -> list[tuple[int, ...]]:
    return SHAPES[:3] if options.quick else SHAPES


def _scan_name(dtype: str, shape: tuple[int, ...]) -> str:
    b, seq, h, p, g, n, c = shape
    return f"ssd_scan {dtype} b{b} l{seq} h{h} p{p} g{g} n{n} c{c}"


def plan(options: Options) -> list[str]:
    """The checks, in order: every (dtype, shape) scan, the conv in both dtypes, the whole mixer."""
    rows = [_scan_name(d, s) for d in DTYPES for s in _shapes(options)]
    return rows + [f"causal_conv1d {d}" for d in DTYPES] + ["Mamba2Mixer forward float32 cuda vs cpu"]


def run(ctx: Context) -> None:
    names = plan(ctx.options)
    if ctx.device != "cuda":
        for name in names:
            ctx.row(name, "skip", "no CUDA")
        return
    import model.mamba as mamba
    import model.ssd as ssd

    for dtype in DTYPES:
        for shape in _shapes(ctx.options):
            name = _scan_name(dtype, shape)
            ctx.check_time(name)
            if not ssd.HAS_MAMBA_KERNELS:
                ctx.row(name, "fail", f"mamba_ssm is not installed ({INSTALL}): ssd_scan runs the PyTorch scan")
                continue
            ctx.row(name, **_scan_case(dtype, shape, ctx.device))
            ctx.log(f"{name} done ({ctx.left():.0f} s left)")
    for dtype in DTYPES:
        name = f"causal_conv1d {dtype}"
        ctx.check_time(name)
        if mamba._causal_conv1d_kernel is None:
            ctx.row(name, "fail", f"causal_conv1d is not installed ({INSTALL}): the conv runs in PyTorch")
            continue
        ctx.row(name, **_conv_case(dtype, ctx.device))
    ctx.check_time("the mixer forward")
    ctx.row("Mamba2Mixer forward float32 cuda vs cpu", **_mixer_case(ctx.device))


def _verdict(err: float, tol: float) -> tuple[str, str]:
    return ("pass", "") if err <= tol else ("fail", f"max rel error {err:.3g} > tolerance {tol:g}")


def _scan_inputs(shape: tuple[int, ...], dtype: str, device: str) -> dict[str, Any]:
    """The inputs of ``tests/gpu/test_ssd_kernels.py`` (``D`` and an initial state), ``x``/``B``/``C``/state in
    ``dtype``."""
    import torch

    batch, seqlen, nheads, headdim, ngroups, dstate, _ = shape
    g = torch.Generator(device=device).manual_seed(0)
    kw: dict[str, Any] = {"device": device, "generator": g}
    low = getattr(torch, dtype)
    return {
        "x": torch.randn(batch, seqlen, nheads, headdim, **kw).to(low),
        "dt": torch.rand(batch, seqlen, nheads, **kw) * 0.2 + 1e-3,
        "A": -torch.exp(torch.randn(nheads, **kw) * 0.5),
        "B": torch.randn(batch, seqlen, ngroups, dstate, **kw).to(low),
        "C": torch.randn(batch, seqlen, ngroups, dstate, **kw).to(low),
        "D": torch.randn(nheads, **kw),
        "initial_state": torch.randn(batch, nheads, headdim, dstate, **kw).to(low),
    }


def _scan_case(dtype: str, shape: tuple[int, ...], device: str) -> dict[str, Any]:
    from model.ssd import ssd_scan, ssd_scan_chunked, ssd_scan_reference

    chunk = shape[-1]
    inp = _scan_inputs(shape, dtype, device)
    first_s, (y, s) = timed(lambda: ssd_scan(**inp, chunk_size=chunk), device)
    kernel_s, _ = timed(lambda: ssd_scan(**inp, chunk_size=chunk), device, repeats=5)
    y_ref, s_ref = ssd_scan_reference(**inp)
    reference_s, _ = timed(lambda: ssd_scan_reference(**inp), device)
    chunked_s, _ = timed(lambda: ssd_scan_chunked(**inp, chunk_size=chunk), device, repeats=3)
    err = max(rel_err(y, y_ref), rel_err(s, s_ref))
    status, note = _verdict(err, TOLERANCE[dtype])
    return {
        "status": status, "note": note, "max_rel_err": err, "tolerance": TOLERANCE[dtype],
        "first_call_s": first_s, "kernel_ms": 1e3 * kernel_s, "chunked_ms": 1e3 * chunked_s,
        "reference_ms": 1e3 * reference_s, "reference_over_kernel": reference_s / kernel_s,
    }  # fmt: skip


def _mixer(dtype: str, device: str) -> Any:
    import torch

    from model.config import HybridConfig
    from model.hybrid import HybridLM

    torch.manual_seed(0)
    lm = HybridLM(HybridConfig(**MIXER)).init_weights(0)
    return lm.model.layers[0].mixer.to(device=device, dtype=getattr(torch, dtype)).eval()


def _conv_case(dtype: str, device: str) -> dict[str, Any]:
    """The kernel path of ``_conv`` (no history) against its PyTorch path (an all-zero history) in float32."""
    import torch

    mixer = _mixer(dtype, device)
    reference = copy.deepcopy(mixer).float()
    b, seq = CONV_SHAPE
    g = torch.Generator(device=device).manual_seed(1)
    xbc = torch.randn(b, seq, mixer.conv_dim, device=device, generator=g).to(getattr(torch, dtype))
    zeros = torch.zeros(b, mixer.conv_dim, mixer.kernel - 1, device=device)
    with torch.no_grad():
        first_s, (out, _) = timed(lambda: mixer._conv(xbc, None), device)
        kernel_s, _ = timed(lambda: mixer._conv(xbc, None), device, repeats=5)
        ref, _ = reference._conv(xbc.float(), zeros)
        torch_s, _ = timed(lambda: mixer._conv(xbc, zeros.to(xbc.dtype)), device, repeats=5)
    err = rel_err(out, ref)
    status, note = _verdict(err, TOLERANCE[dtype])
    return {
        "status": status, "note": note, "max_rel_err": err, "tolerance": TOLERANCE[dtype], "first_call_s": first_s,
        "kernel_ms": 1e3 * kernel_s, "torch_ms": 1e3 * torch_s, "torch_over_kernel": torch_s / kernel_s,
    }  # fmt: skip


def _mixer_case(device: str) -> dict[str, Any]:
    """A whole Mamba2 mixer forward on the device (conv and scan kernels) against the CPU float32 forward."""
    import torch

    cpu = _mixer("float32", "cpu")
    gpu = copy.deepcopy(cpu).to(device)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 300, cpu.hidden_size, generator=g)
    with torch.no_grad():
        ref, _ = cpu(hidden)
        forward_s, (out, _) = timed(lambda: gpu(hidden.to(device)), device, repeats=3)
    err = rel_err(out.cpu(), ref)
    status, note = _verdict(err, TOLERANCE["float32"])
    return {"status": status, "note": note, "max_rel_err": err, "tolerance": TOLERANCE["float32"],
            "forward_ms": 1e3 * forward_s}  # fmt: skip
