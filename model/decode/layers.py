"""Single-token decode steps, one per layer kind, for a model without masks and with autograd off.

Each step computes what :class:`~model.hybrid.Block` computes for one cached token, ``x + mixer(norm(x))``,
on the residual stream x: (batch, hidden), with the same dtypes as the layers (the SSM recurrence and the
router in float32, everything else in the weights' dtype, a float32 residual stream when the config asks
for one). They take fewer operators than the layers: no mask or dtype branches, the residual added by
the last GEMM, a single token's expert routing finished on the host, several tokens' routing and experts
in one dense pass, the Mamba step's weight-derived tensors computed once when the step is built. The conv
and the SSM advance through the same :func:`~model.mamba.conv_step` and :func:`~model.ssd.ssd_step` as the
layer; states that are a batch's buffers (:meth:`MambaCache.owned <model.cache.MambaCache.owned>`) are
written in place, others replaced by new ones, as the layer does. A case a step does not cover (an empty
cache, an observer on the router, quantized experts) runs the layer itself (:class:`ReferenceStep`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import HybridCache, MambaCache
from model.decode.ops import cast, linear, rms_norm
from model.hybrid import Block
from model.mamba import conv_step
from model.moe import Experts, dense_experts, expert_path, route, router_scores, top_experts
from model.ssd import ssd_step

F32 = torch.float32


class ReferenceStep:
    """The block itself on a (batch, 1, hidden) view: the fallback of every step, and the reference."""

    def __init__(self, block: Block) -> None:
        self.block = block

    def __call__(self, x: Tensor, cache: HybridCache, index: int) -> Tensor:
        """x: (batch, hidden) residual stream -> the block's output, same shape; updates ``cache[index]``."""
        return self.block(x[:, None], cache, index, True, None, None, None)[:, 0]

    def stale(self) -> bool:
        """Whether tensors this step derived from the weights no longer match them (none here)."""
        return False


class _Step(ReferenceStep):
    """What every fast step shares: the pre-norm of the block."""

    def __init__(self, block: Block) -> None:
        super().__init__(block)
        norm = block._modules["norm"]
        self.norm_params, self.eps = norm._parameters, norm.eps
        self.mixer = block._modules["mixer"]

    def normed(self, x: Tensor) -> Tensor:
        """RMSNorm of the residual stream, in the norm weight's dtype: (batch, hidden) -> same."""
        weight = self.norm_params["weight"]
        return rms_norm(cast(x, weight.dtype), weight, self.eps)


def mlp(module: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """``residual + down_proj(relu(up_proj(x))^2)`` of an :class:`~model.mlp.MLP`: (rows, hidden) -> same."""
    parts = module._modules
    return linear(parts["down_proj"], torch.relu(linear(parts["up_proj"], x)).square_(), residual)


class MLPStep(_Step):
    def __call__(self, x: Tensor, cache: HybridCache, index: int) -> Tensor:
        return mlp(self.mixer, self.normed(x), x)


class MambaStep(_Step):
    """:meth:`Mamba2Mixer.step <model.mamba.Mamba2Mixer.step>` with the residual added by ``out_proj``.

    The tensors a step derives from the weights are derived once, when the step is built (:meth:`derive`):
    ``A = -exp(A_log)``, ``D`` and ``dt_bias`` in float32 and the conv taps laid out time-major (the layout
    :func:`~model.mamba.conv_step` computes in, so it copies nothing). A step re-derives them when a source
    tensor is replaced (its data pointer changes: ``.to()``, ``.data =``, a new parameter), not when one is
    updated in place: build a new plan after changing the weights in place.
    """

    def __init__(self, block: Block) -> None:
        super().__init__(block)
        m = self.mixer
        self.sizes = [m.d_inner, m.conv_dim, m.num_heads]
        self.xbc_sizes = [m.d_inner, m.n_groups * m.state_size, m.n_groups * m.state_size]
        self.heads, self.head_dim, self.groups, self.state = m.num_heads, m.head_dim, m.n_groups, m.state_size
        self.dt_min, self.dt_max = m.dt_min, m.dt_max
        self.params, self.conv, norm = m._parameters, m._modules["conv1d"]._parameters, m._modules["norm"]
        self.norm_weight, self.norm_eps = norm._parameters, norm.eps
        self.in_proj, self.out_proj = m._modules["in_proj"], m._modules["out_proj"]
        self.derive()

    def sources(self) -> tuple[int, ...]:
        """The data pointers of the tensors :meth:`derive` reads (0 for a missing conv bias)."""
        p, conv, bias = self.params, self.conv, self.conv["bias"]
        return (
            p["A_log"].data_ptr(),
            p["D"].data_ptr(),
            p["dt_bias"].data_ptr(),
            conv["weight"].data_ptr(),
            0 if bias is None else bias.data_ptr(),
        )

    def derive(self) -> None:
        """Derive ``A`` (heads,) = -exp(A_log), ``D`` / ``dt_bias`` (heads,) in float32, and the conv weight
        (conv_dim, 1, K) as a view of contiguous (K, conv_dim) taps, from the current weights."""
        p = self.params
        self.key = self.sources()
        self.A = torch.exp(p["A_log"].detach().to(F32)).neg_()
        self.D = cast(p["D"].detach(), F32)
        self.dt_bias = cast(p["dt_bias"].detach(), F32)
        weight = self.conv["weight"].detach()  # (conv_dim, 1, K)
        self.conv_weight = weight.squeeze(1).t().contiguous().t().unsqueeze(1)

    def stale(self) -> bool:
        """Whether the derived tensors no longer match the weights (an in-place update since :meth:`derive`;
        a replaced source is derived again by the next step)."""
        if self.sources() != self.key:
            return False
        p = self.params
        A = torch.exp(p["A_log"].detach().to(F32)).neg_()
        return not (
            torch.equal(self.A, A)
            and torch.equal(self.D, p["D"].detach().to(F32))
            and torch.equal(self.dt_bias, p["dt_bias"].detach().to(F32))
            and torch.equal(self.conv_weight, self.conv["weight"].detach())
        )

    def __call__(self, x: Tensor, cache: HybridCache, index: int) -> Tensor:
        layer = cache.layers[index]
        if not isinstance(layer, MambaCache):  # a first token without prefill
            return super().__call__(x, cache, index)
        if self.sources() != self.key:  # a weight was replaced (moved, cast, reassigned)
            self.derive()
        b = x.shape[0]
        h, p, g, n = self.heads, self.head_dim, self.groups, self.state
        proj = linear(self.in_proj, self.normed(x))  # 1.
        z, xbc, dt = proj.split_with_sizes(self.sizes, -1)
        act, conv_state = conv_step(layer.conv, xbc, self.conv_weight, self.conv["bias"])  # 2.
        # States in buffers with free rows for rows that join (model.cache) are written in place, so the
        # buffers stay the batch's; other states are replaced, as the model's forward does.
        owned = layer.owned()
        if owned:
            conv_state = layer.conv.copy_(conv_state)
        xs, B, C = F.silu(act, inplace=True).split_with_sizes(self.xbc_sizes, -1)
        dt = F.softplus(cast(dt, F32) + self.dt_bias).clamp_(self.dt_min, self.dt_max)  # 3.
        xs, B, C = xs.view(b, h, p), B.view(b, g, n), C.view(b, g, n)
        y, ssm = ssd_step(layer.ssm, xs, dt, self.A, B, C, self.D, out=layer.ssm if owned else None)
        gated = F.silu(cast(z, F32))  # 4. gated group norm, float32 statistics
        if g == 1:
            gated = rms_norm(gated.mul_(y.view(b, -1)), None, self.norm_eps)
        else:
            gated = rms_norm(gated.view(b, g, -1).mul_(y.view(b, g, -1)), None, self.norm_eps).view(b, -1)
        weight = self.norm_weight["weight"]
        gated = cast(gated, weight.dtype).mul_(weight)
        cache.layers[index] = MambaCache(conv_state, ssm, layer.base if owned else None)
        return linear(self.out_proj, gated, x)


class AttentionStep(_Step):
    """The new key / value written straight into the cache slot; one query needs no transposes:
    (b, heads, 1, head_dim) is the memory of (b, 1, heads * head_dim)."""

    def __init__(self, block: Block) -> None:
        super().__init__(block)
        m = self.mixer
        self.heads, self.kv, self.d = m.num_heads, m.num_kv_heads, m.head_dim
        parts = m._modules
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (parts[f"{n}_proj"] for n in "qkvo")

    def __call__(self, x: Tensor, cache: HybridCache, index: int) -> Tensor:
        layer = cache.layers[index]
        past = layer.length if layer is not None else 0
        if past == 0 or past >= layer.k.shape[2]:  # empty (no prefill) or full: the layer grows the cache
            return super().__call__(x, cache, index)
        b, kv, d, heads = x.shape[0], self.kv, self.d, self.heads
        hn = self.normed(x)
        q = linear(self.q_proj, hn)
        layer.k.select(2, past).copy_(linear(self.k_proj, hn).view(b, kv, d))
        layer.v.select(2, past).copy_(linear(self.v_proj, hn).view(b, kv, d))
        layer.length = n = past + 1
        k, v = layer.k.narrow(2, 0, n), layer.v.narrow(2, 0, n)  # (b, kv, n, d) views of the cache
        out = one_query_attention(q.view(b, kv, heads // kv, d), k, v, layer.attention_mask(n))
        return linear(self.o_proj, out.view(b, heads * d), x)


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention of ONE query per head: what ``F.scaled_dot_product_attention`` computes,
    in three GEMMs and a softmax instead of its blocked kernel (on CPU about 1 ms a call at this size, most of
    a small model's step).

    q: (b, kv, group, d), query head ``j * group + i`` reading key / value head j (``enable_gqa``'s pairing);
    k, v: (b, kv, n, d); mask: (b, 1, 1, n) bool, True where a slot may be attended, or None.
    Returns (b, kv, group, d) in q's dtype. Computed in float32 whatever the dtype (as the fused kernels
    accumulate): a bf16 batched GEMM of these shapes costs ~0.2 ms on CPU, the float32 copies of k and v
    a few microseconds.
    """
    scores = torch.matmul(cast(q, F32), cast(k, F32).transpose(2, 3)).mul_(q.shape[-1] ** -0.5)  # (b, kv, g, n)
    if mask is not None:  # rows of different lengths: each row's leading padding slots take no weight
        scores = scores.masked_fill_(~mask, float("-inf"))
    return cast(torch.matmul(torch.softmax(scores, -1), cast(v, F32)), q.dtype)


class MoEStep(_Step):
    """Shared expert on the residual, then the routed experts added onto it.

    One token (:meth:`one`): its routing is finished on the host, the selected experts' scores renormalised
    in Python floats, and each selected expert's output added, scaled, onto the sum (only those experts'
    weights are read). Several tokens whose experts take the dense path (:meth:`dense_rows`): routing and
    experts in one pass, every expert on every row, mixed by a dense (rows, experts) routing matrix, the
    sum added by the down projection's GEMM. Otherwise (:meth:`rows`) the router and
    :class:`~model.moe.Experts` as they are.
    """

    def __init__(self, block: Block) -> None:
        super().__init__(block)
        m = self.mixer
        self.gate, self.experts = m._modules["gate"], m._modules["experts"]
        self.shared = m._modules.get("shared_experts")

    def __call__(self, x: Tensor, cache: HybridCache, index: int) -> Tensor:
        gate, experts = self.gate, self.experts
        if self.mixer.observer is not None or gate.n_group > 1 or not isinstance(experts, Experts):
            return super().__call__(x, cache, index)  # observed, grouped routing, or quantized experts
        h = self.normed(x)
        base = x if self.shared is None else mlp(self.shared, h, x)
        t = h.shape[0]
        if t == 1:
            return self.one(h, base, base is not x)
        e, f, hidden = experts._parameters["up_proj"].shape
        if expert_path(t, gate.top_k, e, f, hidden) == "dense":
            return self.dense_rows(h, base)
        return self.rows(h, base)

    def one(self, h: Tensor, base: Tensor, fresh: bool) -> Tensor:
        """h: (1, hidden) normed token, base: (1, hidden) residual (+ shared expert) -> base + routed experts.

        ``fresh``: base is a tensor of this step's own (the shared expert's output), so the experts' outputs
        are added onto it in place; otherwise (the residual stream itself) onto a new tensor."""
        gate, params = self.gate, self.experts._parameters
        scores = router_scores(h, gate._parameters["weight"])  # (1, E)
        idx = top_experts(scores, gate._buffers["e_score_correction_bias"], gate.top_k, in_order=False)
        ids = idx.view(-1).tolist()
        ws = scores.view(-1).tolist()
        ws = [ws[e] for e in ids]
        total = sum(ws) + 1e-20 if gate.norm_topk_prob else 1.0
        up, down = params["up_proj"], params["down_proj"]
        out = base
        for e, we in zip(ids, ws, strict=True):
            y = F.linear(torch.relu_(F.linear(h, up[e])).square_(), down[e])
            alpha = we / total * gate.scaling
            out = out.add_(y, alpha=alpha) if fresh or out is not base else torch.add(out, y, alpha=alpha)
        return out

    def dense_rows(self, h: Tensor, base: Tensor) -> Tensor:
        """h: (T, hidden) normed tokens, base: (T, hidden) -> base + routed experts, every expert on every row.

        The router's arithmetic (:func:`~model.moe.router_scores`, :func:`~model.moe.route`), then the routing
        weights scattered into a dense (T, E) matrix that scales each expert's activations, the down projection
        summing over experts and adding the residual (:func:`~model.moe.dense_experts`, the dense path's own
        arithmetic).
        """
        gate, params = self.gate, self.experts._parameters
        scores = router_scores(h, gate._parameters["weight"])
        bias = gate._buffers["e_score_correction_bias"]
        idx, w = route(scores, bias, gate.top_k, gate.norm_topk_prob, gate.scaling, in_order=False)  # (T, k)
        return dense_experts(h, idx, w, params["up_proj"], params["down_proj"], base)

    def rows(self, h: Tensor, base: Tensor) -> Tensor:
        """h: (T, hidden) normed tokens, base: (T, hidden) -> base + routed experts (router and experts as
        they are)."""
        idx, w = self.gate(h)
        return base + self.experts(h, idx, w)


STEPS: dict[str, type[ReferenceStep]] = {
    "mamba": MambaStep,
    "attention": AttentionStep,
    "moe": MoEStep,
    "mlp": MLPStep,
}
"""The step of each layer kind (any other kind runs :class:`ReferenceStep`)."""


__all__ = ["STEPS", "ReferenceStep", "mlp", "one_query_attention"]
