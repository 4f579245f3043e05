"""Single-token decode steps, one per layer kind, for a model without masks and with autograd off.

Each step computes what :class:`~model.hybrid.Block` computes for one cached token, ``x + mixer(norm(x))``,
on the residual stream x: (batch, hidden), with the same dtypes as the layers (the SSM recurrence and the
router in float32, everything else in the weights' dtype, a float32 residual stream when the config asks
for one). They take fewer operators than the layers: no mask or dtype branches, the residual added by
the last GEMM, a single token's expert routing finished on the host; the conv and the SSM advance through
the same :func:`~model.mamba.conv_step` and :func:`~model.ssd.ssd_step` as the layer. A case a step does
not cover (an empty cache, an observer on the router, quantized experts) runs the layer itself
(:class:`ReferenceStep`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import HybridCache, MambaCache
from model.decode.ops import cast, linear, rms_norm
from model.hybrid import Block
from model.mamba import conv_step
from model.moe import Experts
from model.ssd import ssd_step

F32 = torch.float32


class ReferenceStep:
    """The block itself on a (batch, 1, hidden) view: the fallback of every step, and the reference."""

    def __init__(self, block: Block) -> None:
        self.block = block

    def __call__(self, x: Tensor, cache: HybridCache, index: int) -> Tensor:
        """x: (batch, hidden) residual stream -> the block's output, same shape; updates ``cache[index]``."""
        return self.block(x[:, None], cache, index, True, None, None, None)[:, 0]


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
    """:meth:`Mamba2Mixer.step <model.mamba.Mamba2Mixer.step>` with the residual added by ``out_proj``."""

    def __init__(self, block: Block) -> None:
        super().__init__(block)
        m = self.mixer
        self.sizes = [m.d_inner, m.conv_dim, m.num_heads]
        self.xbc_sizes = [m.d_inner, m.n_groups * m.state_size, m.n_groups * m.state_size]
        self.heads, self.head_dim, self.groups, self.state = m.num_heads, m.head_dim, m.n_groups, m.state_size
        self.dt_min, self.dt_max = m.dt_min, m.dt_max
        self.params, self.conv, norm = m._parameters, m._modules["conv1d"], m._modules["norm"]
        self.norm_weight, self.group_size, self.norm_eps = norm._parameters, norm.group_size, norm.eps
        self.in_proj, self.out_proj = m._modules["in_proj"], m._modules["out_proj"]

    def __call__(self, x: Tensor, cache: HybridCache, index: int) -> Tensor:
        layer = cache.layers[index]
        if not isinstance(layer, MambaCache):  # a first token without prefill
            return super().__call__(x, cache, index)
        b = x.shape[0]
        h, p, g, n = self.heads, self.head_dim, self.groups, self.state
        z, xbc, dt = linear(self.in_proj, self.normed(x)).split_with_sizes(self.sizes, -1)  # 1.
        conv = self.conv._parameters
        act, conv_state = conv_step(layer.conv, xbc, conv["weight"], conv["bias"])  # 2.
        xs, B, C = F.silu(act, inplace=True).split_with_sizes(self.xbc_sizes, -1)
        params = self.params
        dt = F.softplus(cast(dt, F32) + cast(params["dt_bias"], F32)).clamp_(self.dt_min, self.dt_max)  # 3.
        A = torch.exp(cast(params["A_log"], F32)).neg_()
        y, ssm = ssd_step(layer.ssm, xs.view(b, h, p), dt, A, B.view(b, g, n), C.view(b, g, n), params["D"])
        gated = F.silu(cast(z, F32)).mul_(y.view(b, -1))  # 4. gated group norm, float32 statistics
        weight = self.norm_weight["weight"]
        if g == 1:
            gated = rms_norm(gated, None, self.norm_eps)
        else:
            gated = F.rms_norm(gated.view(b, g, -1), (self.group_size,), None, self.norm_eps).view(b, -1)
        gated = cast(gated, weight.dtype).mul_(weight)
        cache.layers[index] = MambaCache(conv_state, ssm)
        return linear(self.out_proj, gated, x)


_SMALL_ATTENTION = 1 << 15
"""Query elements x cached tokens up to which a multi-threaded CPU step uses :func:`broadcast_attention`
(ATen's grain size: below it elementwise kernels run on one thread, so that path opens no parallel region)."""


def use_broadcast(q: Tensor, work: int) -> bool:
    """Whether one query's attention over ``work`` = query elements x cached tokens takes
    :func:`broadcast_attention`: a float32 CPU query, small work, and more than one thread."""
    return work <= _SMALL_ATTENTION and q.dtype == F32 and q.device.type == "cpu" and torch.get_num_threads() > 1


def broadcast_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One query per head: q (b * kv, heads per kv group, d), k / v (b, kv, n, d) -> (b * kv, heads per group, d).

    The query heads of a KV group are consecutive (as ``enable_gqa`` pairs them), so each group is a batch
    with its heads as rows: no repeat of K/V. Broadcast products and sums instead of
    ``scaled_dot_product_attention`` / ``bmm`` / ``softmax``: those CPU kernels open an OpenMP parallel
    region whatever the size, and on a shared CPU one region can wait a scheduler time slice for its
    second thread.
    """
    b, kv, n, d = k.shape
    k = k.reshape(b * kv, 1, n, d)  # a view when the cache is contiguous
    v = v.reshape(b * kv, n, d)
    scores = (q.unsqueeze(2) * k).sum(-1).mul_(d**-0.5)  # (b * kv, heads per group, n)
    # softmax; expm1 + 1 rather than exp, whose vectorised kernel is threaded from 128 elements up
    p = torch.expm1(scores - scores.amax(-1, keepdim=True)).add_(1.0)
    p = p.div_(p.sum(-1, keepdim=True))
    return (p.unsqueeze(-1) * v.unsqueeze(1)).sum(2)


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
        if layer.pad is not None:  # rows of different lengths: mask each row's leading padding slots
            mask = layer.attention_mask(n)
            out = F.scaled_dot_product_attention(q.view(b, heads, 1, d), k, v, attn_mask=mask, enable_gqa=heads != kv)
        elif use_broadcast(q, q.numel() * n):
            out = broadcast_attention(q.view(b * kv, heads // kv, d), k, v)
        else:
            out = F.scaled_dot_product_attention(q.view(b, heads, 1, d), k, v, enable_gqa=heads != kv)
        return linear(self.o_proj, out.reshape(b, heads * d), x)


class MoEStep(_Step):
    """Shared expert on the residual, then the routed experts added onto it.

    One token (:meth:`one`): its routing is finished on the host, the selected experts' scores renormalised
    in Python floats, and each selected expert's output added, scaled, onto the sum (only those experts'
    weights are read). Several tokens (:meth:`rows`): the router and :class:`~model.moe.Experts` as they are.
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
        return self.one(h, base) if h.shape[0] == 1 else self.rows(h, base)

    def one(self, h: Tensor, base: Tensor) -> Tensor:
        """h: (1, hidden) normed token, base: (1, hidden) residual (+ shared expert) -> base + routed experts."""
        gate, params = self.gate, self.experts._parameters
        scores = torch.sigmoid(F.linear(cast(h, F32), cast(gate._parameters["weight"], F32)))  # (1, E)
        bias = cast(gate._buffers["e_score_correction_bias"], F32)
        idx = torch.topk(scores + bias, gate.top_k, sorted=False).indices
        ids = idx.view(-1).tolist()
        ws = scores.view(-1).tolist()
        ws = [ws[e] for e in ids]
        total = sum(ws) + 1e-20 if gate.norm_topk_prob else 1.0
        up, down = params["up_proj"], params["down_proj"]
        out = base
        for e, we in zip(ids, ws, strict=True):
            y = F.linear(torch.relu(F.linear(h, up[e])).square_(), down[e])
            alpha = we / total * gate.scaling
            out = torch.add(out, y, alpha=alpha) if out is base else out.add_(y, alpha=alpha)
        return out

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


__all__ = ["STEPS", "ReferenceStep", "broadcast_attention", "mlp", "use_broadcast"]
