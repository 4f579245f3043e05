"""CUDA tests: the fused ``mamba_ssm`` SSD kernel path of ``ssd_scan`` against the sequential reference."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("mamba_ssm.ops.triton.ssd_combined")

from model.ssd import HAS_MAMBA_KERNELS, ssd_scan, ssd_scan_reference

pytestmark = pytest.mark.gpu

SHAPES = [
    # batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size
    (1, 64, 4, 32, 1, 16, 64),
    (2, 100, 8, 64, 2, 64, 32),
    (2, 257, 8, 64, 1, 128, 128),
    (1, 1, 4, 32, 4, 16, 64),
]


def make_inputs(batch, seqlen, nheads, headdim, ngroups, dstate, with_d, with_init, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"device": "cuda", "generator": g}
    return {
        "x": torch.randn(batch, seqlen, nheads, headdim, **kw),
        "dt": torch.rand(batch, seqlen, nheads, **kw) * 0.2 + 1e-3,
        "A": -torch.exp(torch.randn(nheads, **kw) * 0.5),
        "B": torch.randn(batch, seqlen, ngroups, dstate, **kw),
        "C": torch.randn(batch, seqlen, ngroups, dstate, **kw),
        "D": torch.randn(nheads, **kw) if with_d else None,
        "initial_state": torch.randn(batch, nheads, headdim, dstate, **kw) if with_init else None,
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's magnitude (at least 1)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1.0)).item()


def test_kernels_detected():
    assert HAS_MAMBA_KERNELS


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("with_d", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference_fp32(shape, with_d, with_init):
    *dims, chunk_size = shape
    inp = make_inputs(*dims, with_d=with_d, with_init=with_init)
    y_ref, s_ref = ssd_scan_reference(**inp)
    y, s = ssd_scan(**inp, chunk_size=chunk_size)
    assert y.dtype == s.dtype == torch.float32
    # Triton's tl.dot may use TF32 for float32 operands, hence 1e-3-level rather than 1e-5 agreement.
    assert rel_err(y, y_ref) <= 2e-3
    assert rel_err(s, s_ref) <= 2e-3


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference_bf16(shape, with_init):
    *dims, chunk_size = shape
    inp = make_inputs(*dims, with_d=True, with_init=with_init)
    low = ("x", "B", "C", "initial_state")  # dt, A and D stay float32, as a model keeps them
    bf = {k: (v.bfloat16() if v is not None and k in low else v) for k, v in inp.items()}
    # Reference sees the same bf16-rounded values, upcast, so only kernel rounding is measured.
    y_ref, s_ref = ssd_scan_reference(**bf)
    y, s = ssd_scan(**bf, chunk_size=chunk_size)
    assert y.dtype == s.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= 3e-2
    assert rel_err(s, s_ref) <= 3e-2
