"""Analytic parameter counts of sub-models: exact integers, and a differentiable expectation.

``total`` is every trainable parameter of the extracted model; ``active`` what one token touches
(everything outside the routed experts, the router, the shared expert and top-k routed experts).
The embedding and ``lm_head`` count in full towards both, the convention of the parent's published
figures. One set of formulas runs on Python ints (:func:`count_params`, exact) and on float64
tensors (:func:`expected_params`, ``N(E[config])``, differentiable).

Design notes (the conventions in full): docs/elastic.md ("Parameter counts").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from model.config import HybridConfig
from model.elastic.arch import Architecture, drop_positions
from model.elastic.space import AXES, LAYER_AXES, ElasticSpace, full_size

Num = TypeVar("Num", int, Tensor)


class ParamCount(NamedTuple):
    """Total and per-token active parameter counts (conventions: docs/elastic.md, "Parameter counts")."""

    total: int
    active: int


# ---------------------------------------------------------------------- shared formulas
def _mlp(c: HybridConfig, h: Num, f: Num) -> Num:
    """Squared-ReLU MLP: up (f, h) and down (h, f), plus biases when ``mlp_bias``."""
    n = 2 * h * f
    return n + f + h if c.mlp_bias else n


def _mamba(c: HybridConfig, h: Num, heads: Num) -> Num:
    """Mamba2 mixer with ``heads`` total heads (groups and state size never shrink)."""
    d = heads * c.mamba_head_dim
    bc = 2 * c.n_groups * c.ssm_state_size
    rows = 2 * d + bc + heads  # in_proj rows [z | x | B | C | dt]
    conv = d + bc  # depthwise conv channels [x | B | C]
    n = h * rows + conv * c.conv_kernel + 3 * heads + d + d * h  # + dt_bias, A_log, D, gated norm, out_proj
    if c.use_bias:
        n = n + rows + h
    if c.use_conv_bias:
        n = n + conv
    return n


def _attention(c: HybridConfig, h: Num, heads: Num) -> Num:
    """q and o scale with the query heads; k and v (KV heads) never shrink."""
    return 2 * h * heads * c.head_dim + 2 * h * c.num_key_value_heads * c.head_dim


def _moe(c: HybridConfig, h: Num, f: Num, shared: Num, experts: Num) -> tuple[Num, Num]:
    """(total, active) of one MoE mixer: router (E, h), E experts of 2*f*h, shared expert."""
    router = experts * h
    expert = 2 * f * h
    shared_n = _mlp(c, h, shared) if c.n_shared_experts else 0
    return router + experts * expert + shared_n, router + c.num_experts_per_tok * expert + shared_n


def _layer(c: HybridConfig, kind: str, h: Num, size) -> tuple[Num, Num]:
    """(total, active) of one block including its pre-norm; ``size(axis)`` gives this layer's sizes."""
    if kind == "mamba":
        n = _mamba(c, h, size("mamba_heads"))
        return n + h, n + h
    if kind == "attention":
        n = _attention(c, h, size("attn_heads"))
        return n + h, n + h
    if kind == "mlp":
        n = _mlp(c, h, size("mlp_ffn"))
        return n + h, n + h
    total, active = _moe(c, h, size("moe_ffn"), size("shared_ffn"), size("experts"))
    return total + h, active + h


def _outer(c: HybridConfig, h: Num) -> Num:
    """Embedding (V, h), final norm (h,), lm_head (V, h)."""
    return 2 * c.vocab_size * h + h


# ---------------------------------------------------------------------- exact counts
def count_params(
    config: HybridConfig,
    arch: Architecture | None = None,
    depth_order: Sequence[int] | None = None,
) -> ParamCount:
    """Exact (total, active) parameters of ``arch`` (the parent when None). Never builds a model."""
    res = (arch or Architecture()).resolve(config, depth_order=depth_order)
    total = active = _outer(config, res.hidden)
    for la in res.kept:
        sizes = {
            "mamba_heads": la.mamba_heads,
            "attn_heads": la.attn_heads,
            "mlp_ffn": la.ffn,
            "moe_ffn": la.ffn,
            "shared_ffn": la.shared_ffn,
            "experts": la.experts,
        }
        t, a = _layer(config, la.kind, res.hidden, sizes.__getitem__)
        total, active = total + t, active + a
    return ParamCount(int(total), int(active))


# ---------------------------------------------------------------------- differentiable expectation
def expected_sizes(space: ElasticSpace, probs: dict[str, Tensor]) -> dict[str, Tensor]:
    """``E[k_axis] = p_axis . choices_axis`` per axis: () for (n_choices,) probabilities, (n_layers,) per layer."""
    out = {}
    for axis, p in probs.items():
        choices = space.choices(axis)
        if choices is None:
            raise ValueError(f"expected_sizes: {axis} is not an elastic axis of the space {space.elastic_axes}")
        out[axis] = p @ torch.tensor(choices, dtype=p.dtype, device=p.device)
    return out


def expected_params(
    config: HybridConfig,
    expected: dict[str, Tensor],
    depth_order: Sequence[int] | None = None,
    by_layer: bool = False,
) -> tuple[Tensor, Tensor]:
    """Differentiable (total, active) at the expected sizes; float64 scalars.

    Without per-layer sizes the layers of one kind are counted once (``by_layer=True`` forces the
    per-layer sum, the reference of that shortcut).

    ``expected[axis]``: a scalar (one size for every layer) or, for a layer axis, a vector with one
    entry per layer of that kind (parent layer order). Missing axes are at full size.
    ``expected["depth"]``: either a scalar expected depth, in which case layer i contributes with
    weight ``clamp(E[d] - (n_layers - position_i) + 1, 0, 1)`` (piecewise linear in E[d], exact at
    integers), or an (n_layers,) vector of keep probabilities (e.g. the soft mask's keep gates).
    """
    unknown = sorted(set(expected) - set(AXES))
    if unknown:
        raise ValueError(f"expected_params: unknown axes {unknown}; known axes {list(AXES)}")
    kinds = config.layer_kinds
    n_layers = len(kinds)
    device = next((t.device for t in expected.values() if isinstance(t, Tensor)), None)

    def as64(axis: str) -> Tensor | None:
        t = expected.get(axis)
        return None if t is None else torch.as_tensor(t, device=device).to(torch.float64)

    hidden = as64("hidden")
    if hidden is not None and hidden.dim() != 0:
        raise ValueError(f"expected_params: hidden must be a scalar, got shape {tuple(hidden.shape)}")
    h = hidden if hidden is not None else torch.tensor(float(config.hidden_size), dtype=torch.float64, device=device)

    per_axis: dict[str, Tensor | None] = {a: as64(a) for a in LAYER_AXES}
    for axis, t in per_axis.items():
        n_kind = kinds.count(LAYER_AXES[axis])
        if t is not None and t.dim() > 0 and tuple(t.shape) != (n_kind,):
            raise ValueError(
                f"expected_params: {axis} has shape {tuple(t.shape)}; expected a scalar or ({n_kind},) "
                f"(one entry per {LAYER_AXES[axis]} layer)"
            )

    depth = as64("depth")
    if depth is None:
        keep = torch.ones(n_layers, dtype=torch.float64, device=device)
    elif depth.dim() == 0:
        pos = torch.tensor(drop_positions(n_layers, depth_order), dtype=torch.float64, device=device)
        keep = (depth - (n_layers - pos) + 1).clamp(0.0, 1.0)
    elif tuple(depth.shape) == (n_layers,):
        keep = depth
    else:
        raise ValueError(f"expected_params: depth must be a scalar or ({n_layers},) keep probabilities")

    total = active = _outer(config, h)
    if not by_layer and all(t is None or t.dim() == 0 for t in per_axis.values()):
        # Every layer of a kind has the same sizes: one count per kind, weighted by the kind's summed keep
        # gates. The per-layer loop below is the reference (a 52-layer parent costs 4 counts instead of 52).
        def global_size(axis: str) -> Tensor | int:
            t = per_axis[axis]
            return full_size(config, axis) if t is None else t

        for kind in sorted(set(kinds)):
            rows = torch.tensor([i for i, k in enumerate(kinds) if k == kind], device=device)
            t_k, a_k = _layer(config, kind, h, global_size)
            kept = keep[rows].sum()
            total = total + kept * t_k
            active = active + kept * a_k
        return total, active
    ordinal = {kind: 0 for kind in set(kinds)}
    for i, kind in enumerate(kinds):
        r = ordinal[kind]
        ordinal[kind] += 1

        def size(axis: str, r: int = r) -> Tensor | int:
            t = per_axis[axis]
            if t is None:
                return full_size(config, axis)
            return t if t.dim() == 0 else t[r]

        t_i, a_i = _layer(config, kind, h, size)
        total = total + keep[i] * t_i
        active = active + keep[i] * a_i
    return total, active
