"""CPU tests for the Mamba2 SSD scan: chunked vs. sequential reference, decode steps, state carry."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.ssd import ssd_scan, ssd_scan_chunked, ssd_scan_reference, ssd_step

ATOL = 1e-4


def make_inputs(
    batch: int = 2,
    seqlen: int = 33,
    nheads: int = 4,
    headdim: int = 8,
    ngroups: int = 2,
    dstate: int = 16,
    with_d: bool = False,
    with_init: bool = False,
    seed: int = 0,
    dt_max: float = 0.5,
) -> dict[str, torch.Tensor | None]:
    """Random float32 inputs in the ranges a trained Mamba2 layer sees (dt > 0, A < 0)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, seqlen, nheads, headdim, generator=g),
        "dt": torch.rand(batch, seqlen, nheads, generator=g) * (dt_max - 1e-3) + 1e-3,
        "A": -torch.exp(torch.randn(nheads, generator=g) * 0.5),
        "B": torch.randn(batch, seqlen, ngroups, dstate, generator=g),
        "C": torch.randn(batch, seqlen, ngroups, dstate, generator=g),
        "D": torch.randn(nheads, generator=g) if with_d else None,
        "initial_state": torch.randn(batch, nheads, headdim, dstate, generator=g) if with_init else None,
    }


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


@functools.cache
def grid_case(seqlen: int, ngroups: int, with_d: bool, with_init: bool):
    """Inputs and reference outputs, shared by the chunk sizes of one grid point (the loop is the slow part)."""
    inp = make_inputs(seqlen=seqlen, ngroups=ngroups, with_d=with_d, with_init=with_init, seed=seqlen)
    return inp, ssd_scan_reference(**inp)


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("with_d", [False, True])
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("chunk_size", [8, 16, 64])
@pytest.mark.parametrize("seqlen", [1, 7, 64, 100])
def test_chunked_matches_reference(seqlen: int, chunk_size: int, ngroups: int, with_d: bool, with_init: bool):
    inp, (y_ref, s_ref) = grid_case(seqlen, ngroups, with_d, with_init)
    y, s = ssd_scan_chunked(**inp, chunk_size=chunk_size)
    assert y.shape == y_ref.shape == (2, seqlen, 4, 8)
    assert s.shape == s_ref.shape == (2, 4, 8, 16)
    assert max_diff(y, y_ref) <= ATOL
    assert max_diff(s, s_ref) <= ATOL


def test_dispatcher_on_cpu_uses_chunked():
    inp = make_inputs(seqlen=50, with_d=True, with_init=True)
    y, s = ssd_scan(**inp, chunk_size=16)
    y_c, s_c = ssd_scan_chunked(**inp, chunk_size=16)
    assert torch.equal(y, y_c) and torch.equal(s, s_c)


@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("with_d", [False, True])
def test_step_matches_reference(ngroups: int, with_d: bool):
    inp = make_inputs(seqlen=20, ngroups=ngroups, with_d=with_d, with_init=True, seed=3)
    y_ref, s_ref = ssd_scan_reference(**inp)
    state = inp["initial_state"]
    ys = []
    for t in range(20):
        y_t, state = ssd_step(
            state, inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t], inp["C"][:, t], D=inp["D"]
        )
        ys.append(y_t)
    assert max_diff(torch.stack(ys, dim=1), y_ref) <= ATOL
    assert max_diff(state, s_ref) <= ATOL


def test_step_does_not_modify_state():
    inp = make_inputs(seqlen=1, with_init=True)
    state = inp["initial_state"]
    before = state.clone()
    _, new_state = ssd_step(state, inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0], inp["C"][:, 0])
    assert torch.equal(state, before)
    assert new_state.data_ptr() != state.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_into_out_equals_the_step_that_returns_a_new_state(dtype):
    """``out=state``: the new state written over the old one (a batch's buffers updated in place; directly for a
    float32 state, through a copy for another dtype) is exactly the state the plain step returns."""
    inp = make_inputs(seqlen=1, ngroups=2, with_d=True, with_init=True, seed=5)
    args = (inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0], inp["C"][:, 0], inp["D"])
    state = inp["initial_state"].to(dtype)
    y_new, s_new = ssd_step(state, *args)
    buffer = state.clone()
    y_in, s_in = ssd_step(buffer, *args, out=buffer)
    assert s_in is buffer and torch.equal(s_in, s_new) and torch.equal(y_in, y_new)


@pytest.mark.parametrize("split", [1, 13, 32, 59])
@pytest.mark.parametrize("with_init", [False, True])
def test_split_sequence_equals_whole(split: int, with_init: bool):
    inp = make_inputs(seqlen=60, with_d=True, with_init=with_init, seed=7)
    y_all, s_all = ssd_scan_chunked(**inp, chunk_size=16)

    def part(sl: slice, init: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return ssd_scan_chunked(
            inp["x"][:, sl],
            inp["dt"][:, sl],
            inp["A"],
            inp["B"][:, sl],
            inp["C"][:, sl],
            chunk_size=16,
            D=inp["D"],
            initial_state=init,
        )

    y1, s1 = part(slice(0, split), inp["initial_state"])
    y2, s2 = part(slice(split, None), s1)
    assert max_diff(torch.cat([y1, y2], dim=1), y_all) <= ATOL
    assert max_diff(s2, s_all) <= ATOL


def test_strong_decay_is_finite_and_exact():
    # Large dt * |A| drives exp(cumsum) towards 0 inside a chunk; the segsum form must not produce NaN/inf.
    inp = make_inputs(seqlen=96, dt_max=8.0, with_init=True, seed=11)
    inp["A"] = inp["A"] * 20.0
    y_ref, s_ref = ssd_scan_reference(**inp)
    y, s = ssd_scan_chunked(**inp, chunk_size=64)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    assert max_diff(y, y_ref) <= ATOL
    assert max_diff(s, s_ref) <= ATOL


def test_zero_dt_keeps_state():
    inp = make_inputs(seqlen=10, with_init=True)
    inp["dt"] = torch.zeros_like(inp["dt"])
    _, s = ssd_scan_chunked(**inp, chunk_size=4)
    assert max_diff(s, inp["initial_state"]) == 0.0


def test_empty_sequence():
    inp = make_inputs(seqlen=0, with_init=True)
    y, s = ssd_scan_chunked(**inp, chunk_size=8)
    assert y.shape == (2, 0, 4, 8)
    assert torch.equal(s, inp["initial_state"])


def test_low_precision_inputs_keep_dtype():
    inp = make_inputs(seqlen=40, with_d=True)
    bf = {k: (v.bfloat16() if v is not None else None) for k, v in inp.items()}
    y_ref, s_ref = ssd_scan_reference(**bf)
    y, s = ssd_scan_chunked(**bf, chunk_size=16)
    assert y.dtype == s.dtype == torch.bfloat16
    # Both compute in float32 from the same bf16 values; only the final rounding to bf16 differs.
    scale = y_ref.float().abs().max().item()
    assert max_diff(y, y_ref) <= 1e-2 * scale


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    seqlen=st.integers(1, 40),
    ngroups=st.integers(1, 2),
    heads_per_group=st.integers(1, 3),
    headdim=st.integers(1, 5),
    dstate=st.integers(1, 6),
    chunk_size=st.integers(1, 20),
    with_d=st.booleans(),
    with_init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_reference_property(
    batch: int,
    seqlen: int,
    ngroups: int,
    heads_per_group: int,
    headdim: int,
    dstate: int,
    chunk_size: int,
    with_d: bool,
    with_init: bool,
    seed: int,
):
    inp = make_inputs(
        batch=batch,
        seqlen=seqlen,
        nheads=ngroups * heads_per_group,
        headdim=headdim,
        ngroups=ngroups,
        dstate=dstate,
        with_d=with_d,
        with_init=with_init,
        seed=seed,
    )
    y_ref, s_ref = ssd_scan_reference(**inp)
    y, s = ssd_scan_chunked(**inp, chunk_size=chunk_size)
    assert max_diff(y, y_ref) <= ATOL
    assert max_diff(s, s_ref) <= ATOL


@pytest.mark.parametrize(
    ("field", "bad_shape", "name"),
    [
        ("x", (2, 9, 4), "x"),
        ("dt", (2, 9, 3), "dt"),
        ("A", (3,), "A"),
        ("B", (2, 8, 2, 16), "B"),
        ("C", (2, 9, 2, 15), "C"),
        ("D", (4, 8), "D"),
        ("initial_state", (2, 4, 8, 15), "initial_state"),
    ],
)
def test_bad_shapes_raise(field: str, bad_shape: tuple[int, ...], name: str):
    inp = make_inputs(seqlen=9, with_d=True, with_init=True)
    inp[field] = torch.zeros(bad_shape)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        ssd_scan_chunked(**inp)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        ssd_scan_reference(**inp)


def test_heads_not_divisible_by_groups_raises():
    inp = make_inputs(seqlen=5, nheads=4, ngroups=3)
    with pytest.raises(ValueError, match="ngroups"):
        ssd_scan_chunked(**inp)
    with pytest.raises(ValueError, match="ngroups"):
        ssd_step(torch.zeros(2, 4, 8, 16), inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0], inp["C"][:, 0])


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True])
def test_bad_chunk_size_raises(chunk_size):
    inp = make_inputs(seqlen=5)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan_chunked(**inp, chunk_size=chunk_size)


def test_step_bad_shapes_raise():
    inp = make_inputs(seqlen=1)
    args = [torch.zeros(2, 4, 8, 16), inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0], inp["C"][:, 0]]
    for idx, name, shape in [(0, "state", (2, 4, 8, 15)), (2, "dt", (2, 3)), (5, "C", (2, 2, 15))]:
        bad = list(args)
        bad[idx] = torch.zeros(shape)
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            ssd_step(*bad)


@pytest.mark.parametrize("ngroups", [1, 2])
def test_step_accepts_a_state_in_any_layout(ngroups: int):
    """A state stored with its last two dimensions transposed (as a foreign cache may be) steps like a
    contiguous one."""
    inp = make_inputs(seqlen=3, ngroups=ngroups, with_d=True, with_init=True, seed=5)
    ref_state = inp["initial_state"]
    state = ref_state.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not state.is_contiguous()
    for t in range(3):
        args = (inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t], inp["C"][:, t])
        y_ref, ref_state = ssd_step(ref_state, *args, D=inp["D"])
        y, state = ssd_step(state, *args, D=inp["D"])
        assert max_diff(y, y_ref) <= 1e-6
        assert max_diff(state, ref_state) <= 1e-6


def test_step_on_a_bf16_state_computes_in_float32():
    """A bfloat16 state and inputs: the step runs in float32 and rounds once."""
    inp = make_inputs(seqlen=1, ngroups=2, with_d=True, with_init=True, seed=7)
    args = (inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0], inp["C"][:, 0])
    y_ref, s_ref = ssd_step(inp["initial_state"], *args, D=inp["D"])
    half = [a.bfloat16() for a in args]
    y, s = ssd_step(inp["initial_state"].bfloat16(), *half, D=inp["D"])
    assert y.dtype == s.dtype == torch.bfloat16
    assert max_diff(y.float(), y_ref) <= 0.05 * y_ref.abs().max().item()
    assert max_diff(s.float(), s_ref) <= 0.05 * s_ref.abs().max().item()
