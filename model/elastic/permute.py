"""Permute a parent's weights so that ranked components are stored most important first.

Every permutation is applied to every tensor that shares the permuted dimension, so the permuted
model computes what the original did (up to float summation order). In place, inside the existing
``Parameter`` / buffer objects; grouped orders (Mamba heads in B/C groups, query heads in KV groups,
experts in routing groups) are checked, not trusted. Depth is never a permutation.

Which tensors each axis permutes, and design notes: docs/elastic.md ("Permutation").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from model.elastic.importance import AXES, Rankings
from model.mlp import MLP


def _check_permutation(order: Tensor, size: int, groups: int = 1, what: str = "order") -> Tensor:
    """Validate ``order`` as a permutation of ``range(size)`` that keeps every index in its group."""
    order = torch.as_tensor(order, dtype=torch.long).reshape(-1)
    if order.numel() != size or not torch.equal(order.sort().values, torch.arange(size)):
        raise ValueError(f"{what}: expected a permutation of 0..{size - 1}, got {order.tolist()}")
    per = size // groups
    if groups > 1 and not torch.equal(order // per, torch.arange(size) // per):
        raise ValueError(f"{what}: moves an index to another group ({groups} groups of {per}): {order.tolist()}")
    return order


def _take(t: Tensor | None, dim: int, index: Tensor) -> None:
    """``t = t.index_select(dim, index)`` in place (same storage object)."""
    if t is None:
        return
    with torch.no_grad():
        t.copy_(t.index_select(dim, index.to(t.device)))


def expand_heads(order: Tensor, head_dim: int) -> Tensor:
    """(heads,) head order -> (heads * head_dim,) channel order."""
    return (order[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


# ---------------------------------------------------------------------- per axis
def permute_hidden(model: nn.Module, order: Tensor) -> None:
    """Permute the residual channels (d_model) of every tensor that touches the residual stream."""
    from model.hybrid import HybridLM  # local import: hybrid imports nothing from here, keep it that way

    assert isinstance(model, HybridLM)
    order = _check_permutation(order, model.config.hidden_size, what="hidden order")
    _take(model.model.embeddings.weight, 1, order)
    _take(model.model.norm_f.weight, 0, order)
    _take(model.lm_head.weight, 1, order)
    for block in model.model.layers:
        _take(block.norm.weight, 0, order)
        m = block.mixer
        if block.kind == "mamba":
            _take(m.in_proj.weight, 1, order)
            _take(m.out_proj.weight, 0, order)
            _take(m.out_proj.bias, 0, order)
        elif block.kind == "attention":
            for proj in (m.q_proj, m.k_proj, m.v_proj):
                _take(proj.weight, 1, order)
            _take(m.o_proj.weight, 0, order)
        elif block.kind == "mlp":
            _permute_mlp_hidden(m, order)
        elif block.kind == "moe":
            _take(m.gate.weight, 1, order)
            _take(m.experts.up_proj, 2, order)
            _take(m.experts.down_proj, 1, order)
            if m.shared_experts is not None:
                _permute_mlp_hidden(m.shared_experts, order)


def _permute_mlp_hidden(mlp: MLP, order: Tensor) -> None:
    _take(mlp.up_proj.weight, 1, order)
    _take(mlp.down_proj.weight, 0, order)
    _take(mlp.down_proj.bias, 0, order)


def permute_mamba_heads(mixer: nn.Module, order: Tensor) -> None:
    """Permute the heads of a :class:`~model.mamba.Mamba2Mixer`; ``order`` must keep heads in their group."""
    h, p, d = mixer.num_heads, mixer.head_dim, mixer.d_inner
    order = _check_permutation(order, h, mixer.n_groups, "mamba head order")
    ch = expand_heads(order, p)
    rows = torch.arange(mixer.in_proj.out_features)
    rows[:d] = ch  # z
    rows[d : 2 * d] = d + ch  # x
    dt_start = mixer.in_proj.out_features - h
    rows[dt_start:] = dt_start + order  # dt; B and C (between x and dt) stay put
    _take(mixer.in_proj.weight, 0, rows)
    _take(mixer.in_proj.bias, 0, rows)
    conv = torch.arange(mixer.conv_dim)
    conv[:d] = ch  # the conv runs over [x | B | C]
    _take(mixer.conv1d.weight, 0, conv)
    _take(mixer.conv1d.bias, 0, conv)
    for t in (mixer.A_log, mixer.D, mixer.dt_bias):
        _take(t, 0, order)
    _take(mixer.norm.weight, 0, ch)
    _take(mixer.out_proj.weight, 1, ch)


def permute_attn_heads(attn: nn.Module, order: Tensor) -> None:
    """Permute the query heads of an :class:`~model.attention.Attention`; each must stay in its KV group."""
    order = _check_permutation(order, attn.num_heads, attn.num_kv_heads, "attention head order")
    ch = expand_heads(order, attn.head_dim)
    _take(attn.q_proj.weight, 0, ch)
    _take(attn.o_proj.weight, 1, ch)


def permute_mlp(mlp: MLP, order: Tensor) -> None:
    """Permute the intermediate channels of a dense MLP or the shared expert."""
    order = _check_permutation(order, mlp.up_proj.out_features, what="ffn order")
    _take(mlp.up_proj.weight, 0, order)
    _take(mlp.up_proj.bias, 0, order)
    _take(mlp.down_proj.weight, 1, order)


def permute_expert_ffn(experts: nn.Module, orders: Sequence[Tensor]) -> None:
    """Permute each routed expert's intermediate channels; ``orders[e]`` for expert e (current index)."""
    if len(orders) != experts.num_experts:
        raise ValueError(f"expert ffn orders: expected {experts.num_experts}, got {len(orders)}")
    f = experts.up_proj.shape[1]
    with torch.no_grad():
        for e, order in enumerate(orders):
            idx = _check_permutation(order, f, what=f"expert {e} ffn order").to(experts.up_proj.device)
            experts.up_proj[e] = experts.up_proj[e].index_select(0, idx)
            experts.down_proj[e] = experts.down_proj[e].index_select(1, idx)


def permute_experts(moe: nn.Module, order: Tensor) -> None:
    """Permute the routed experts of a :class:`~model.moe.MoE` (router rows, bias, expert weights)."""
    order = _check_permutation(order, moe.experts.num_experts, moe.gate.n_group, "expert order")
    _take(moe.gate.weight, 0, order)
    _take(moe.gate.e_score_correction_bias, 0, order)
    _take(moe.experts.up_proj, 0, order)
    _take(moe.experts.down_proj, 0, order)


# ---------------------------------------------------------------------- everything
def apply_rankings(model: nn.Module, rankings: Rankings, axes: Sequence[str] | None = None) -> nn.Module:
    """Permute ``model`` IN PLACE so every ranking's order becomes the storage order; returns ``model``.

    ``axes`` limits which rankings are applied (default: every axis present in ``rankings``).
    """
    wanted = set(rankings.axes if axes is None else axes) - {"depth"}
    unknown = wanted - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; known {list(AXES)}")
    layers = model.model.layers
    if len(rankings.layers) != len(layers):
        raise ValueError(f"rankings cover {len(rankings.layers)} layers, the model has {len(layers)}")
    if "hidden" in wanted and rankings.hidden is not None:
        permute_hidden(model, torch.tensor(rankings.hidden.order))
    for i, (block, lr) in enumerate(zip(layers, rankings.layers, strict=True)):
        if lr.kind != block.kind:
            raise ValueError(f"layer {i}: rankings are for a {lr.kind} layer, the model has {block.kind}")
        m = block.mixer
        if "mamba_heads" in wanted and lr.mamba_heads is not None:
            permute_mamba_heads(m, torch.tensor(lr.mamba_heads.order))
        if "attn_heads" in wanted and lr.attn_heads is not None:
            permute_attn_heads(m, torch.tensor(lr.attn_heads.order))
        if "mlp_ffn" in wanted and lr.mlp_ffn is not None:
            permute_mlp(m, torch.tensor(lr.mlp_ffn.order))
        if "shared_ffn" in wanted and lr.shared_ffn is not None and m.shared_experts is not None:
            permute_mlp(m.shared_experts, torch.tensor(lr.shared_ffn.order))
        # per-expert channel orders are indexed by original expert: apply them before moving experts
        if "moe_ffn" in wanted and lr.moe_ffn is not None:
            permute_expert_ffn(m.experts, [torch.tensor(r.order) for r in lr.moe_ffn])
        if "experts" in wanted and lr.experts is not None:
            permute_experts(m, torch.tensor(lr.experts.order))
    return model
