"""Mamba2 SSD (state-space duality) scan: reference loop, chunked algorithm, decode step, dispatcher.

Notation (shared by every function here):

* ``batch``: sequences in the batch; ``seqlen``: tokens per sequence.
* ``nheads``: SSM heads; ``headdim``: channels per head (``P`` in the paper).
* ``ngroups``: groups sharing one ``B``/``C`` projection; heads are grouped group-major, so head ``h``
  reads group ``h // (nheads // ngroups)``.
* ``dstate``: state size per channel (``N`` in the paper).

Per head ``h`` the recurrence is::

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * outer(x_t, B_t)    # (headdim, dstate)
    y_t     = state_t @ C_t + D_h * x_t                                 # (headdim,)

``dt`` is expected to be already positive (softplus, bias and clamping are the caller's job) and ``A``
negative, so every decay factor ``exp(dt * A)`` lies in ``(0, 1]``.

All functions compute in float32 and cast ``y`` and the final state back to ``x.dtype`` (the decode step
keeps the dtype of the state it is given).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    HAS_MAMBA_KERNELS: bool = True
except ImportError:
    mamba_chunk_scan_combined = None
    HAS_MAMBA_KERNELS = False

__all__ = [
    "HAS_MAMBA_KERNELS",
    "ssd_scan",
    "ssd_scan_chunked",
    "ssd_scan_reference",
    "ssd_step",
]


# --------------------------------------------------------------------------------------------------
# Validation and small helpers
# --------------------------------------------------------------------------------------------------


def _shape_error(name: str, expected: str, got: Tensor) -> ValueError:
    return ValueError(f"{name} must have shape {expected}, got {tuple(got.shape)}")


def _check_scan_inputs(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    initial_state: Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate full-sequence inputs; return ``(batch, seqlen, nheads, headdim, ngroups, dstate)``."""
    if x.ndim != 4:
        raise _shape_error("x", "(batch, seqlen, nheads, headdim)", x)
    batch, seqlen, nheads, headdim = x.shape
    if dt.shape != (batch, seqlen, nheads):
        raise _shape_error("dt", f"(batch, seqlen, nheads)=({batch}, {seqlen}, {nheads})", dt)
    if A.shape != (nheads,):
        raise _shape_error("A", f"(nheads,)=({nheads},)", A)
    if B.ndim != 4 or B.shape[:2] != (batch, seqlen):
        raise _shape_error("B", f"(batch, seqlen, ngroups, dstate) with batch={batch}, seqlen={seqlen}", B)
    if C.shape != B.shape:
        raise ValueError(f"C must have the same shape as B {tuple(B.shape)}, got {tuple(C.shape)}")
    ngroups, dstate = B.shape[2], B.shape[3]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"nheads={nheads} (from x) must be divisible by ngroups={ngroups} (from B and C)")
    if D is not None and D.shape != (nheads,):
        raise _shape_error("D", f"(nheads,)=({nheads},)", D)
    if initial_state is not None and initial_state.shape != (batch, nheads, headdim, dstate):
        expected = f"(batch, nheads, headdim, dstate)=({batch}, {nheads}, {headdim}, {dstate})"
        raise _shape_error("initial_state", expected, initial_state)
    return batch, seqlen, nheads, headdim, ngroups, dstate


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _groups_to_heads(t: Tensor, nheads: int, dim: int) -> Tensor:
    """Repeat each group ``nheads // ngroups`` times along ``dim`` (group-major head layout)."""
    ngroups = t.shape[dim]
    if ngroups == nheads:
        return t
    return t.repeat_interleave(nheads // ngroups, dim=dim)


def _segsum(a: Tensor) -> Tensor:
    """Stable segment sums of ``a`` along its last axis.

    Args:
        a: ``(..., T)``.

    Returns:
        ``(..., T, T)`` with ``out[..., i, j] = sum(a[..., j+1 : i+1])`` for ``i >= j`` and ``-inf`` above
        the diagonal, so ``exp(out)`` is the causal decay matrix (zeros above the diagonal).

    Why not ``cumsum(a)[i] - cumsum(a)[j]``: that difference of two large numbers loses precision on long
    chunks; summing only the masked entries avoids the cancellation.
    """
    T = a.shape[-1]
    # rows[..., i, j] = a[..., i]; keep only i > j so the cumsum over i starts after j.
    rows = a.unsqueeze(-1).expand(*a.shape, T)
    strictly_lower = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(diagonal=-1)
    sums = rows.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)
    lower = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(diagonal=0)
    return sums.masked_fill(~lower, float("-inf"))


# --------------------------------------------------------------------------------------------------
# Reference: sequential loop over time
# --------------------------------------------------------------------------------------------------


def ssd_scan_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the SSM recurrence one token at a time (slow, obviously correct).

    Args:
        x: ``(batch, seqlen, nheads, headdim)`` inputs.
        dt: ``(batch, seqlen, nheads)`` positive step sizes.
        A: ``(nheads,)`` negative decay rates.
        B: ``(batch, seqlen, ngroups, dstate)`` input projections.
        C: ``(batch, seqlen, ngroups, dstate)`` output projections.
        D: optional ``(nheads,)`` skip connection.
        initial_state: optional ``(batch, nheads, headdim, dstate)``; zeros when omitted.

    Returns:
        ``y`` ``(batch, seqlen, nheads, headdim)`` and ``final_state`` ``(batch, nheads, headdim, dstate)``,
        both in ``x.dtype``.
    """
    batch, seqlen, nheads, headdim, _, dstate = _check_scan_inputs(x, dt, A, B, C, D, initial_state)
    out_dtype = x.dtype
    xf, dtf, Af = x.float(), dt.float(), A.float()
    Bh = _groups_to_heads(B.float(), nheads, dim=2)  # (batch, seqlen, nheads, dstate)
    Ch = _groups_to_heads(C.float(), nheads, dim=2)
    if initial_state is None:
        state = x.new_zeros(batch, nheads, headdim, dstate, dtype=torch.float32)
    else:
        state = initial_state.float()

    decay = torch.exp(dtf * Af)[..., None, None]  # (batch, seqlen, nheads, 1, 1)
    dBx = (dtf[..., None] * xf)[..., None] * Bh[:, :, :, None, :]  # (batch, seqlen, nheads, headdim, dstate)
    ys = []
    for t in range(seqlen):
        state = decay[:, t] * state + dBx[:, t]
        ys.append((state * Ch[:, t, :, None, :]).sum(dim=-1))  # contract dstate: (batch, nheads, headdim)
    if ys:
        y = torch.stack(ys, dim=1)
    else:
        y = xf.new_zeros(batch, 0, nheads, headdim)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(out_dtype), state.to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Chunked SSD algorithm
# --------------------------------------------------------------------------------------------------


def ssd_scan_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int = 64,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked SSD: quadratic attention-like form inside chunks, linear recurrence across chunks.

    Same contract as :func:`ssd_scan_reference`; ``chunk_size`` (any positive int) only changes how the
    work is split, not the result. Sequences whose length is not a multiple of ``chunk_size`` are padded
    with ``dt = 0`` (decay 1, no input), which leaves the state untouched, and the output is trimmed.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``.
        dt: ``(batch, seqlen, nheads)``, positive.
        A: ``(nheads,)``, negative.
        B: ``(batch, seqlen, ngroups, dstate)``.
        C: ``(batch, seqlen, ngroups, dstate)``.
        chunk_size: tokens per chunk.
        D: optional ``(nheads,)``.
        initial_state: optional ``(batch, nheads, headdim, dstate)``.

    Returns:
        ``y`` ``(batch, seqlen, nheads, headdim)`` and ``final_state`` ``(batch, nheads, headdim, dstate)``,
        both in ``x.dtype``.
    """
    _check_chunk_size(chunk_size)
    batch, seqlen, nheads, headdim, _, dstate = _check_scan_inputs(x, dt, A, B, C, D, initial_state)
    if seqlen == 0:
        return ssd_scan_reference(x, dt, A, B, C, D=D, initial_state=initial_state)
    out_dtype = x.dtype

    pad = (-seqlen) % chunk_size
    nchunks = (seqlen + pad) // chunk_size
    L = chunk_size

    def to_chunks(t: Tensor) -> Tensor:
        # (batch, seqlen, ...) -> (batch, nchunks, L, ...), zero-padding the time axis at the end.
        t = t.float()
        if pad:
            t = F.pad(t, (0,) * (2 * (t.ndim - 2)) + (0, pad))
        return t.reshape(batch, nchunks, L, *t.shape[2:])

    xc = to_chunks(x)  # (b, c, l, h, p)
    dtc = to_chunks(dt)  # (b, c, l, h)
    Bc = _groups_to_heads(to_chunks(B), nheads, dim=3)  # (b, c, l, h, n)
    Cc = _groups_to_heads(to_chunks(C), nheads, dim=3)  # (b, c, l, h, n)

    x_dt = xc * dtc[..., None]  # discretised input dt_t * x_t: (b, c, l, h, p)
    dA = (dtc * A.float()).permute(0, 3, 1, 2)  # log-decay per step: (b, h, c, l)
    dA_cumsum = dA.cumsum(dim=-1)  # log-decay from chunk start to step l (inclusive): (b, h, c, l)

    # 1. Diagonal blocks: outputs from inputs within the same chunk. decay[..., l, s] is the total decay
    #    from step s to step l (zero for s > l), so this is causal masked "attention" C_l . B_s.
    decay = torch.exp(_segsum(dA))  # (b, h, c, l, s)
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * decay
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, x_dt)

    # 2. Chunk states: the state each chunk alone would leave behind (starting from zero), i.e. every
    #    input decayed to the chunk's last step.
    decay_to_end = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)  # (b, h, c, l)
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, decay_to_end, x_dt)  # (b, c, h, p, n)

    # 3. Inter-chunk recurrence: the true state at each chunk boundary. Prepending the initial state as
    #    "chunk -1" and using a segsum over per-chunk total decays does this for all chunks in one einsum.
    if initial_state is None:
        init = chunk_states.new_zeros(batch, 1, nheads, headdim, dstate)
    else:
        init = initial_state.float().unsqueeze(1)
    chunk_states = torch.cat([init, chunk_states], dim=1)  # (b, c+1, h, p, n)
    chunk_decay = torch.exp(_segsum(F.pad(dA_cumsum[..., -1], (1, 0))))  # (b, h, c+1, c+1)
    boundary_states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, chunk_states)  # (b, c+1, h, p, n)
    states_in, final_state = boundary_states[:, :-1], boundary_states[:, -1]

    # 4. State -> output: contribution of the state entering each chunk, decayed to each step in it.
    decay_from_start = torch.exp(dA_cumsum)  # (b, h, c, l)
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, states_in, decay_from_start)

    y = (y_diag + y_off).reshape(batch, nchunks * L, nheads, headdim)[:, :seqlen]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y.to(out_dtype), final_state.to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Single-token decode step
# --------------------------------------------------------------------------------------------------


def ssd_step(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advance the recurrence by one token (decoding).

    Args:
        state: ``(batch, nheads, headdim, dstate)``; not modified.
        x: ``(batch, nheads, headdim)``.
        dt: ``(batch, nheads)``, positive.
        A: ``(nheads,)``, negative.
        B: ``(batch, ngroups, dstate)``.
        C: ``(batch, ngroups, dstate)``.
        D: optional ``(nheads,)``.

    Returns:
        ``y`` ``(batch, nheads, headdim)`` in ``x.dtype`` and a new ``state``
        ``(batch, nheads, headdim, dstate)`` in ``state.dtype``.
    """
    if x.ndim != 3:
        raise _shape_error("x", "(batch, nheads, headdim)", x)
    batch, nheads, headdim = x.shape
    if B.ndim != 3 or B.shape[0] != batch:
        raise _shape_error("B", f"(batch, ngroups, dstate) with batch={batch}", B)
    if C.shape != B.shape:
        raise ValueError(f"C must have the same shape as B {tuple(B.shape)}, got {tuple(C.shape)}")
    ngroups, dstate = B.shape[1], B.shape[2]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"nheads={nheads} (from x) must be divisible by ngroups={ngroups} (from B and C)")
    if state.shape != (batch, nheads, headdim, dstate):
        expected = f"(batch, nheads, headdim, dstate)=({batch}, {nheads}, {headdim}, {dstate})"
        raise _shape_error("state", expected, state)
    if dt.shape != (batch, nheads):
        raise _shape_error("dt", f"(batch, nheads)=({batch}, {nheads})", dt)
    if A.shape != (nheads,):
        raise _shape_error("A", f"(nheads,)=({nheads},)", A)
    if D is not None and D.shape != (nheads,):
        raise _shape_error("D", f"(nheads,)=({nheads},)", D)

    xf, dtf = x.float(), dt.float()
    Bh = _groups_to_heads(B.float(), nheads, dim=1)  # (batch, nheads, dstate)
    Ch = _groups_to_heads(C.float(), nheads, dim=1)
    decay = torch.exp(dtf * A.float())  # (batch, nheads)
    # Out-of-place on purpose: callers (e.g. speculative decoding) may need the previous state.
    new_state = decay[:, :, None, None] * state.float() + (dtf[..., None] * xf)[..., None] * Bh[:, :, None]
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), new_state.to(state.dtype)


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int = 64,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Full-sequence scan: fused ``mamba_ssm`` Triton kernel on CUDA when installed, else chunked PyTorch.

    Both paths compute the same function as :func:`ssd_scan_reference` (up to floating-point rounding).
    The kernel is told ``dt_softplus=False`` with no ``dt_bias`` because ``dt`` arrives already positive.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``.
        dt: ``(batch, seqlen, nheads)``, positive.
        A: ``(nheads,)``, negative.
        B: ``(batch, seqlen, ngroups, dstate)``.
        C: ``(batch, seqlen, ngroups, dstate)``.
        chunk_size: tokens per chunk.
        D: optional ``(nheads,)``.
        initial_state: optional ``(batch, nheads, headdim, dstate)``.

    Returns:
        ``y`` ``(batch, seqlen, nheads, headdim)`` and ``final_state`` ``(batch, nheads, headdim, dstate)``,
        both in ``x.dtype``.
    """
    _check_chunk_size(chunk_size)
    seqlen = _check_scan_inputs(x, dt, A, B, C, D, initial_state)[1]
    if not (HAS_MAMBA_KERNELS and x.is_cuda and seqlen > 0):
        return ssd_scan_chunked(x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_state=initial_state)

    # The Triton kernels index with raw strides and read A (and D) as float32.
    y, final_state = mamba_chunk_scan_combined(
        x.contiguous(),
        dt.contiguous(),
        A.float().contiguous(),
        B.contiguous(),
        C.contiguous(),
        chunk_size,
        D=None if D is None else D.float().contiguous(),
        dt_bias=None,
        initial_states=None if initial_state is None else initial_state.contiguous(),
        dt_softplus=False,
        return_final_states=True,
    )
    # Match the PyTorch paths' dtype contract (the kernel's final-state dtype varies across versions).
    return y.to(x.dtype), final_state.to(x.dtype)
