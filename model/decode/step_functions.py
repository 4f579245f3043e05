"""The decode step as pure tensor functions, written for ``torch.compile`` (:mod:`model.decode.compiled`).

Each function computes what an eager step of :mod:`model.decode.layers` computes for its rows (one token per
row), which is its reference: the same dtypes at the same points (projections in the weight's dtype
accumulated in float32, the SSM recurrence and the router in float32, norms' statistics in float32), the
Mamba conv and recurrence through the same :func:`~model.mamba.conv_step` / :func:`~model.ssd.ssd_step`.

One row (the latency case) and several rows are traced apart (a graph's row count is 1, or a dynamic size of
at least 2). One row: projections are written as dot products (:func:`gemv`), which inductor generates as
vectorised loops streaming the weight once, and a token's routed experts are chosen on the device (``topk``,
the selected experts' weights read through their indices inside the loops). Several rows: projections are
GEMMs (the AMX operators of :mod:`model.decode.dot_bf16` for bfloat16 weights where the CPU has AMX, its
float32 operators for float32 weights, the library kernel otherwise: each reads a weight once for all rows)
and the routed experts take the grouped path or the dense pass (:func:`moe_rows`), so that the norms, the
conv and SSM updates, the routing and the attention around them fuse into a few loops. Nothing reads a value
back to the host: the whole of :func:`step` is one graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.decode import dot_bf16
from model.mamba import conv_step
from model.moe import dense_experts, route
from model.ssd import ssd_step

F32 = torch.float32

DOT_BF16 = False
"""Whether one-row bfloat16 projections take the bfloat16 dot-product operators (:mod:`model.decode.dot_bf16`);
set by :func:`model.decode.compiled.compiled_step` before a graph is traced (a traced step reads it as a
constant, and the graph is guarded on it)."""

AMX_BF16 = False
"""Whether bfloat16 projections of several rows (and the grouped routed experts) take the AMX operators
(:func:`model.decode.dot_bf16.gemm` / :func:`~model.decode.dot_bf16.gemm_grouped`) rather than the library
GEMMs; set with :data:`DOT_BF16` (:func:`model.decode.dot_bf16.rows_available`)."""

F32_ROWS = False
"""Whether float32 projections of several rows (and the grouped routed experts) take the float32 operators
(:func:`model.decode.dot_bf16.gemm_f32` / :func:`~model.decode.dot_bf16.gemm_f32_grouped`) rather than the
library GEMMs (and the dense pass over every expert); set with :data:`DOT_BF16`
(:func:`model.decode.dot_bf16.f32_rows_available`)."""

Projection = tuple[str, list[Tensor], list[Tensor | None]]
"""What a compiled step multiplies by for one projection: ``("one", [weight], [bias])``; ``("rows", runs,
biases)`` for a budget's row runs of a parent weight (outputs concatenated); ``("cols", runs, [bias])`` for
its column runs (the input split to the runs, outputs summed). Weights (out, in), any memory order."""


# ---------------------------------------------------------------------- the arithmetic (traced, then compiled)
def dot_bf16_weight(w: Tensor) -> bool:
    """Whether a one-row projection by ``w`` takes the bfloat16 dot-product operators (:data:`DOT_BF16`, a
    bfloat16 CPU weight with a contiguous last dimension)."""
    return DOT_BF16 and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.stride(-1) == 1


def amx_weight(w: Tensor) -> bool:
    """Whether a several-rows projection by ``w`` takes the AMX operators (:data:`AMX_BF16`, a bfloat16 CPU weight
    with a contiguous last dimension)."""
    return AMX_BF16 and dot_bf16_weight(w)


def f32_rows_weight(w: Tensor) -> bool:
    """Whether a several-rows projection by ``w`` takes the float32 operators (:data:`F32_ROWS`, a float32 CPU
    weight with a contiguous last dimension)."""
    return F32_ROWS and w.dtype == F32 and w.device.type == "cpu" and w.stride(-1) == 1


def gemv(x: Tensor, w: Tensor) -> Tensor:
    """One row times a weight: x (in,) float32 holding values of w's dtype (callers round to it, as the eager
    GEMM's input is), w (out, in) -> (out,) float32.

    A bfloat16 weight with a contiguous last dimension takes the dot-product operator
    (:func:`model.decode.dot_bf16.gemv`, when :data:`DOT_BF16`). Otherwise written as a product and a sum over
    the weight's contiguous dimension, which inductor generates as a vectorised loop that streams the weight
    once: each output's dot product along a row of an outputs-major weight, or, for an inputs-major one, a
    running sum over its rows."""
    if dot_bf16_weight(w):
        return dot_bf16.gemv(x, w)
    if w.stride(-1) == 1:
        return (x * w.to(F32)).sum(-1)
    return (x[:, None] * w.t().to(F32)).sum(0)


def project_rows(x: Tensor, p: Projection, residual: Tensor | None = None) -> Tensor:
    """:func:`project` of several rows: x (rows, in) -> (rows, out), a GEMM per weight in the weight's dtype (a
    library kernel in the graph, as the eager step calls); the residual added as :func:`project` adds it."""
    form, weights, biases = p
    dtype = weights[0].dtype
    x = x.to(dtype)
    if form == "rows":
        out = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)], -1)
    elif form == "cols":
        pieces = x.split([w.shape[1] for w in weights], -1)
        out = sum(F.linear(piece, w) for piece, w in zip(pieces, weights, strict=True))
        out = out if biases[0] is None else out + biases[0]
    elif residual is not None and residual.dtype == dtype and biases[0] is None:
        return torch.addmm(residual, x, weights[0].t())  # the residual as the GEMM's addend, one rounding
    else:
        out = F.linear(x, weights[0], biases[0])
    if residual is None:
        return out
    return (residual.to(F32) + out.to(F32)).to(dtype) if residual.dtype == dtype else residual + out


def project(x: Tensor, p: Projection, residual: Tensor | None = None) -> Tensor:
    """``linear(x) (+ residual)`` as the eager step computes it: x (rows, in) -> (rows, out) in the weight's
    dtype, accumulated in float32; a residual of that dtype is added before the one rounding (the eager GEMM's
    addend), one of another dtype (a float32 residual stream) after it, promoted. One row: dot products
    (:func:`gemv`); several rows: the AMX operators for bfloat16 weights (:func:`amx_weight`), the float32
    operators for float32 ones (:func:`f32_rows_weight`), otherwise the library GEMMs (:func:`project_rows`)."""
    form, weights, biases = p
    dtype = weights[0].dtype
    if x.shape[0] == 1:
        xf, mul = x.view(-1).to(dtype).to(F32), gemv  # (in,) and (in,) -> (out,) products
    elif all(amx_weight(w) for w in weights):
        xf, mul = x.to(dtype), dot_bf16.gemm  # (rows, in) -> (rows, out)
    elif all(f32_rows_weight(w) for w in weights):
        xf, mul = x.to(F32), dot_bf16.gemm_f32  # (rows, in) -> (rows, out)
    else:
        return project_rows(x, p, residual)
    if form == "rows":
        parts = [mul(xf, w) if b is None else mul(xf, w) + b.to(F32) for w, b in zip(weights, biases, strict=True)]
        acc = torch.cat(parts, -1)
    elif form == "cols":
        pieces = xf.split([w.shape[1] for w in weights], -1)
        acc = sum(mul(piece, w) for piece, w in zip(pieces, weights, strict=True))
        acc = acc if biases[0] is None else acc + biases[0].to(F32)
    else:
        acc = mul(xf, weights[0])
        acc = acc if biases[0] is None else acc + biases[0].to(F32)
    acc = acc[None] if acc.dim() == 1 else acc
    if residual is not None and residual.dtype == dtype:
        return (residual.to(F32) + acc).to(dtype)
    out = acc.to(dtype)
    return out if residual is None else residual + out


def rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """:func:`model.decode.ops.rms_norm` of x cast to the weight's dtype: (..., d) -> same, that dtype (x's
    without a weight); statistics and product in float32."""
    dtype = x.dtype if weight is None else weight.dtype
    xf = x.to(dtype).to(F32)
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (out if weight is None else out * weight.to(F32)).to(dtype)


def mlp_one(h: Tensor, up: Projection, down: Projection, residual: Tensor) -> Tensor:
    """``residual + down(relu(up(h))^2)``: h, residual (rows, hidden) -> (rows, hidden)."""
    return project(torch.relu(project(h, up)).square(), down, residual)


def mlp_step(x: Tensor, norm: Tensor, eps: float, up: Projection, down: Projection) -> Tensor:
    """An MLP block: x (rows, hidden) residual stream -> the block's output (rows, hidden)."""
    return mlp_one(rms(x, norm, eps), up, down, x)


def mamba_step(
    x: Tensor,
    norm: Tensor,
    eps: float,
    in_proj: Projection,
    conv_state: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    ssm_state: Tensor,
    gate_norm: Tensor,
    gate_eps: float,
    out_proj: Projection,
    shape: tuple[tuple[int, ...], tuple[int, ...], int, int, int, int, float, float],
) -> Tensor:
    """A Mamba block (:class:`~model.decode.layers.MambaStep`): x (rows, hidden) -> output (rows, hidden); the
    new states are written into ``conv_state`` (rows, conv_dim, K-1) and ``ssm_state`` (rows, heads, head_dim,
    state) in place (a batch's buffers stay its own: rows join by slot, :mod:`model.cache`).

    ``shape``: (in_proj split sizes [z, xBC, dt], xBC split sizes [x, B, C], heads, head_dim, groups, state
    size, dt_min, dt_max)."""
    sizes, xbc_sizes, h, p, g, n, dt_min, dt_max = shape
    b = x.shape[0]
    proj = project(rms(x, norm, eps), in_proj)
    z, xbc, dt = proj.split_with_sizes(list(sizes), -1)
    act, conv = conv_step(conv_state, xbc, conv_weight, conv_bias)
    conv_state.copy_(conv)
    xs, B, C = F.silu(act).split_with_sizes(list(xbc_sizes), -1)
    dt = F.softplus(dt.to(F32) + dt_bias).clamp(dt_min, dt_max)
    y, ssm = ssd_step(ssm_state, xs.view(b, h, p), dt, A, B.view(b, g, n), C.view(b, g, n), D)
    ssm_state.copy_(ssm)
    gated = F.silu(z.to(F32)).view(b, g, -1) * y.view(b, g, -1)  # gated group norm, float32 statistics
    gated = rms(gated, None, gate_eps).view(b, -1)
    gated = gated.to(gate_norm.dtype) * gate_norm
    return project(gated, out_proj, x)


def moe_step(
    x: Tensor,
    norm: Tensor,
    eps: float,
    gate: Tensor,
    score_bias: Tensor,
    up: Tensor,
    down: Tensor,
    shared: tuple[Projection, Projection] | None,
    routing: tuple[int, bool, float],
) -> Tensor:
    """A MoE block (:class:`~model.decode.layers.MoEStep`): x (rows, hidden) -> (rows, hidden); up (E, F, H),
    down (E, H, F); ``routing``: (top_k, renormalise, scaling).

    The router's float32 sigmoid scores, top-k of the scores plus the correction bias, the selected scores
    renormalised and scaled. One token (:meth:`MoEStep.one <model.decode.layers.MoEStep.one>`): the selected
    experts' weights read through their indices inside the GEMV loops (no copy of them is made); several
    (:func:`moe_rows`): every expert on every row."""
    top_k, renormalise, scaling = routing
    dtype = up.dtype
    h = rms(x, norm, eps)
    base = x if shared is None else mlp_one(h, shared[0], shared[1], x)
    if x.shape[0] != 1:
        return moe_rows(h, base, gate, score_bias, up, down, routing)
    scores = torch.sigmoid(gemv(h.view(-1).to(F32), gate))  # (E,): the router's scores as one GEMV
    idx, w = route(scores, score_bias, top_k, renormalise, scaling, in_order=False)  # (k,), (k,)
    if dot_bf16_weight(up) and dot_bf16_weight(down):
        hk = h.view(1, -1).to(dtype).expand(top_k, -1)  # one row for every selected expert (row stride 0)
        act = torch.relu(dot_bf16.gemv_gather(hk, up, idx).to(dtype)).square()  # (k, F)
        y = dot_bf16.gemv_gather(act, down, idx).to(dtype)  # (k, H)
    else:
        hq = h.view(-1).to(dtype).to(F32)
        act = torch.relu((hq * up[idx].to(F32)).sum(-1).to(dtype)).square()  # (k, F)
        y = (act.to(F32)[:, None, :] * down[idx].to(F32)).sum(-1).to(dtype)  # (k, H)
    routed = (w[:, None] * y.to(F32)).sum(0, keepdim=True)
    return (base.to(F32) + routed).to(base.dtype)


def moe_rows(
    h: Tensor,
    base: Tensor,
    gate: Tensor,
    score_bias: Tensor,
    up: Tensor,
    down: Tensor,
    routing: tuple[int, bool, float],
) -> Tensor:
    """The routed experts of several tokens: h (rows, hidden) normed tokens, base (rows, hidden) -> base +
    routed experts. The router of :class:`~model.moe.TopKRouter` (:func:`~model.moe.router_scores`,
    :func:`~model.moe.route`); half-precision experts take the grouped path (:func:`moe_grouped_rows`), and so
    do float32 ones where the float32 operators run (:func:`f32_rows_weight`); other float32 experts the dense
    pass (:func:`~model.moe.dense_experts`): the library grouped GEMM's shape function, which tracing runs,
    takes bfloat16 / float16 only."""
    top_k, renormalise, scaling = routing
    # the router's (rows, hidden) x (hidden, E) as a product and a sum, generated into the norm's loop (a library
    # GEMM of this size costs ~20 us a layer in calls); float32 as router_scores computes it
    scores = torch.sigmoid((h.to(F32)[:, None, :] * gate.to(F32)).sum(-1))  # (rows, E)
    idx, w = route(scores, score_bias, top_k, renormalise, scaling, in_order=False)  # (rows, k)
    if up.dtype in (torch.bfloat16, torch.float16) or (f32_rows_weight(up) and f32_rows_weight(down)):
        return moe_grouped_rows(h, base, idx, w, up, down)
    return dense_experts(h.to(up.dtype), idx, w, up, down, base)


def expert_order(flat: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The (row, expert) assignments flat (N,) int64 sorted by expert, stably (``flat.argsort(stable=True)``):
    -> order (N,) (the assignment at each sorted place), back (N,) (each assignment's sorted place, order's
    inverse), offs (E,) int32 (cumulative counts, ``F.grouped_mm``'s offsets).

    Written as comparisons and sums (an assignment's place is the number of assignments to lower experts plus
    the earlier ones to its own), which inductor generates as a few small loops: N is rows * k (tens), and the
    library's sort, cumulative sum and scatters cost ~10 us a call each, a dozen calls a MoE layer."""
    n = flat.shape[0]
    ids = torch.arange(n, device=flat.device)
    same = flat[None, :] == flat[:, None]  # (N, N)
    earlier = (same & (ids[None, :] < ids[:, None])).sum(1)  # same-expert assignments before each
    lower = (flat[None, :] < flat[:, None]).sum(1)  # assignments to lower experts
    back = lower + earlier  # (N,)
    order = torch.empty_like(back).scatter_(0, back, ids)
    experts_ids = torch.arange(experts, device=flat.device)
    offs = (flat[None, :] <= experts_ids[:, None]).sum(1).to(torch.int32)  # (E,): assignments to experts <= e
    return order, back, offs


def moe_grouped_rows(h: Tensor, base: Tensor, idx: Tensor, w: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """:class:`~model.moe.Experts`' grouped path (:meth:`MoEStep.rows <model.decode.layers.MoEStep.rows>`): the
    (row, expert) assignments idx / w (rows, k) sorted by expert (stably, :func:`expert_order`), each expert's
    slice through one grouped GEMM per projection (``F.grouped_mm``, or the operators
    :func:`~model.decode.dot_bf16.gemm_grouped` where :func:`amx_weight` and
    :func:`~model.decode.dot_bf16.gemm_f32_grouped` where :func:`f32_rows_weight`: the offsets are data, every
    shape static in rows * k), the outputs put back in (row, k) order, scaled by their routing weights and
    summed per row (a gather and a sum, which inductor generates, where the eager path's ``index_add`` would
    leave the graph's C++ wrapper for a Python fallback). Only the selected experts' work is done."""
    e, top_k = up.shape[0], idx.shape[1]
    order, back, offs = expert_order(idx.reshape(-1), e)
    token = order // top_k
    hs = h.to(up.dtype)[token]  # (rows * k, hidden), sorted by expert
    if amx_weight(up) and amx_weight(down):  # the AMX operators (float32 out, rounded as the GEMM rounds)
        act = torch.relu(dot_bf16.gemm_grouped(hs, up, offs).to(up.dtype)).square()  # (rows * k, F)
        ys = dot_bf16.gemm_grouped(act, down, offs).to(up.dtype)  # (rows * k, hidden)
    elif f32_rows_weight(up) and f32_rows_weight(down):  # the float32 operators
        act = torch.relu(dot_bf16.gemm_f32_grouped(hs, up, offs)).square()  # (rows * k, F)
        ys = dot_bf16.gemm_f32_grouped(act, down, offs)  # (rows * k, hidden)
    else:
        act = torch.relu(F.grouped_mm(hs, up.transpose(1, 2), offs=offs)).square()
        ys = F.grouped_mm(act, down.transpose(1, 2), offs=offs)
    ys = ys[back].view(h.shape[0], top_k, ys.shape[-1])  # (rows, k, hidden), each row's experts in idx order
    return base + (ys * w.to(ys.dtype)[..., None]).sum(1)


def attention_in(
    x: Tensor, norm: Tensor, eps: float, q: Projection, k: Projection, v: Projection
) -> tuple[Tensor, Tensor, Tensor]:
    """An attention block's query, key and value of one token per row: x (rows, hidden) -> three (rows, out)."""
    h = rms(x, norm, eps)
    return project(h, q), project(h, k), project(h, v)


def head_step(x: Tensor, norm: Tensor, eps: float, head: Projection) -> Tensor:
    """The final norm and the LM head: x (rows, hidden) -> (normed (rows, hidden), logits (rows, vocab))."""
    h = rms(x, norm, eps)
    return h, project(h, head)


def segment(
    x: Tensor,
    attention: tuple[Tensor, Projection] | None,
    layers: list[tuple[str, tuple[Any, ...]]],
    tail: tuple[str, tuple[Any, ...]],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The layers between two attention layers as one function: x (rows, hidden) -> (x after them, the tail's
    outputs); their Mamba layers' states are updated in place (:func:`mamba_step`).

    ``attention``: the previous attention layer's output (rows, heads * head_dim) and its output projection,
    applied first with the residual (None at the start of the model); ``layers``: ("mamba" | "moe" | "mlp",
    the arguments of :func:`mamba_step` / :func:`moe_step` / :func:`mlp_step` after x); ``tail``:
    ("attention", :func:`attention_in`'s arguments after x) for the next attention layer's query, key and
    value, or ("head", :func:`head_step`'s) for the final norm and the logits."""
    if attention is not None:
        x = project(attention[0], attention[1], x)
    for kind, args in layers:
        if kind == "mamba":
            x = mamba_step(x, *args)
        elif kind == "moe":
            x = moe_step(x, *args)
        else:
            x = mlp_step(x, *args)
    kind, args = tail
    return x, attention_in(x, *args) if kind == "attention" else head_step(x, *args)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    pos: Tensor,
    pad: Tensor | None,
    geometry: tuple[int, int, int],
) -> Tensor:
    """One token per row attending its history, its key and value written into the cache first (what
    :class:`~model.decode.layers.AttentionStep` does between its projections).

    q (rows, heads * d), k / v (rows, kv * d); k_cache / v_cache (rows, kv, capacity, d), written in place at
    slot ``pos`` (a (1,) int64 tensor: the position is data, so one graph serves every length); ``pad``:
    (rows,) int64, the leading padding slots of each row (:class:`~model.cache.KVCache`'s), or None for none;
    ``geometry``: (kv heads, query heads, head_dim). Each query attends slots ``pad..pos`` of the whole buffer,
    the others masked: the buffer's capacity, not the history's length, is the shape the graph sees (marked
    dynamic by the caller), so a growing history never compiles again.
    :func:`~model.decode.layers.one_query_attention`'s arithmetic: float32 scores, softmax and weighted sum,
    cast back to q's dtype. Returns (rows, heads * d)."""
    kv, heads, d = geometry
    b = q.shape[0]
    k_cache.index_copy_(2, pos, k.view(b, kv, 1, d).to(k_cache.dtype))
    v_cache.index_copy_(2, pos, v.view(b, kv, 1, d).to(v_cache.dtype))
    scores = torch.matmul(q.view(b, kv, heads // kv, d).to(F32), k_cache.to(F32).transpose(2, 3)) * d**-0.5
    slots = torch.arange(k_cache.shape[2], device=pos.device)
    masked = slots > pos  # slots not written yet
    if pad is not None:  # and each row's leading padding
        masked = masked | (slots < pad[:, None]).view(b, 1, 1, -1)
    weights = torch.softmax(scores.masked_fill(masked, float("-inf")), -1)
    return torch.matmul(weights, v_cache.to(F32)).to(q.dtype).view(b, heads * d)


def step(
    x: Tensor,
    segments: list[tuple[list[tuple[str, tuple[Any, ...]]], tuple[str, tuple[Any, ...]]]],
    attentions: list[tuple[Tensor, Tensor, Tensor, Tensor | None, tuple[int, int, int], Projection]],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """A whole decode step: x (rows, hidden) embedded tokens -> (x after the last layer, (normed final hidden
    (rows, hidden), logits (rows, vocab))); the Mamba states and KV buffers are written in place.

    ``segments``: per run of layers between attention layers, (its layers, its tail) as :func:`segment` takes
    them; ``attentions``: per attention layer ending a segment, (k_cache, v_cache, pos, pad, geometry, o_proj)
    for :func:`attend` and the output projection the next segment applies first."""
    attention: tuple[Tensor, Projection] | None = None
    for i, (layers, tail) in enumerate(segments):
        x, outs = segment(x, attention, layers, tail)
        if i == len(attentions):
            return x, outs
        k_cache, v_cache, pos, pad, geometry, o_proj = attentions[i]
        attention = (attend(*outs, k_cache, v_cache, pos, pad, geometry), o_proj)
    raise ValueError("step: the last segment must end in the head")


__all__ = [
    "Projection",
    "attend",
    "attention_in",
    "expert_order",
    "gemv",
    "head_step",
    "mamba_step",
    "mlp_step",
    "moe_grouped_rows",
    "moe_rows",
    "moe_step",
    "project",
    "project_rows",
    "segment",
    "step",
]
