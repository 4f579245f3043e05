"""Masks that make the full model compute a sub-model: hard (one architecture) and soft (router mixture).

A hard mask comes from :meth:`Architecture.resolve` (axes at full size get ``None``: no multiply).
Head masks keep the first k heads inside every group (:func:`grouped_prefix_mask`). A soft mask is
``p @ M`` with ``M`` the (n_choices, size) matrix of candidate prefix masks, differentiable in ``p``;
per-layer probabilities are (n_layers_of_that_kind, n_choices).

Design notes (depth gates): docs/elastic.md ("Masks").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from model.config import HybridConfig
from model.elastic.arch import Architecture, drop_positions
from model.elastic.space import LAYER_AXES, ElasticSpace, full_size
from model.masks import LayerMask, ModelMask, grouped_prefix_mask, prefix_mask

_LAYERMASK_FIELD = {
    "mamba_heads": "mamba_heads",
    "attn_heads": "attn_heads",
    "mlp_ffn": "ffn",
    "moe_ffn": "ffn",
    "shared_ffn": "shared_ffn",
    "experts": "experts",
}
"""Elastic axis -> the :class:`LayerMask` field it fills."""


def axis_mask(
    config: HybridConfig, axis: str, keep: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The 0/1 prefix mask of ``axis`` keeping ``keep`` units: (full_size(axis),) (depth excluded)."""
    size = full_size(config, axis)
    if axis == "mamba_heads":
        return grouped_prefix_mask(size, config.n_groups, keep // config.n_groups, device, dtype)
    if axis == "attn_heads":
        return grouped_prefix_mask(size, config.num_key_value_heads, keep // config.num_key_value_heads, device, dtype)
    return prefix_mask(size, keep, device, dtype)


def candidate_masks(
    config: HybridConfig,
    axis: str,
    choices: Sequence[int],
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Stacked prefix masks of every candidate: (n_choices, full_size(axis))."""
    return torch.stack([axis_mask(config, axis, c, device, dtype) for c in choices])


def depth_keep_matrix(
    n_layers: int,
    choices: Sequence[int],
    depth_order: Sequence[int] | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(n_choices, n_layers): 1 where depth candidate k keeps layer i."""
    pos = torch.tensor(drop_positions(n_layers, depth_order), device=device)
    d = torch.tensor(list(choices), device=device)
    return (pos[None, :] >= (n_layers - d)[:, None]).to(dtype)


def hard_mask(
    config: HybridConfig,
    arch: Architecture,
    depth_order: Sequence[int] | None = None,
    device: torch.device | None = None,
    space: ElasticSpace | None = None,
) -> ModelMask:
    """The exact 0/1 mask of ``arch`` (validated against ``config`` and, if given, ``space``)."""
    res = arch.resolve(config, space, depth_order)
    hidden = None if res.hidden == config.hidden_size else axis_mask(config, "hidden", res.hidden, device)
    layers: list[LayerMask] = []
    for la in res.layers:
        lm = LayerMask()
        if la.kind == "mamba" and la.mamba_heads != config.mamba_num_heads:
            lm.mamba_heads = axis_mask(config, "mamba_heads", la.mamba_heads, device)
        elif la.kind == "attention" and la.attn_heads != config.num_attention_heads:
            lm.attn_heads = axis_mask(config, "attn_heads", la.attn_heads, device)
        elif la.kind == "mlp" and la.ffn != config.intermediate_size:
            lm.ffn = axis_mask(config, "mlp_ffn", la.ffn, device)
        elif la.kind == "moe":
            if la.ffn != config.moe_intermediate_size:
                lm.ffn = axis_mask(config, "moe_ffn", la.ffn, device)
            if la.shared_ffn != config.moe_shared_expert_intermediate_size:
                lm.shared_ffn = axis_mask(config, "shared_ffn", la.shared_ffn, device)
            if la.experts != config.n_routed_experts:
                lm.experts = axis_mask(config, "experts", la.experts, device)
        if not la.keep:
            lm.keep = torch.zeros((), device=device)
        layers.append(lm)
    return ModelMask(hidden=hidden, layers=layers)


def soft_mask(
    config: HybridConfig,
    probs: dict[str, Tensor],
    space: ElasticSpace,
    depth_order: Sequence[int] | None = None,
) -> ModelMask:
    """Differentiable mixture mask from per-axis probabilities over the space's candidates.

    ``probs[axis]``: (n_choices,) for a global choice, or (n_layers_of_kind, n_choices) for a
    per-layer choice on a layer axis (needs ``space.per_layer``). ``probs["depth"]`` is always
    (n_choices,). Masks take the dtype and device of the probabilities.
    """
    space.validate_against(config)
    unknown = sorted(set(probs) - set(space.elastic_axes))
    if unknown:
        raise ValueError(
            f"soft_mask: probabilities for {unknown}, which are not elastic axes of the space; "
            f"elastic axes {space.elastic_axes}"
        )
    kinds = config.layer_kinds
    n_layers = len(kinds)
    layers = [LayerMask() for _ in range(n_layers)]
    hidden = None
    for axis, p in probs.items():
        choices = space.choices(axis)
        assert choices is not None  # checked above
        n_choices = len(choices)
        if p.shape[-1] != n_choices or p.dim() not in (1, 2):
            raise ValueError(
                f"soft_mask: {axis} probabilities have shape {tuple(p.shape)}; expected ({n_choices},) "
                f"or (n_layers_of_kind, {n_choices}) for the candidates {choices}"
            )
        if axis == "depth":
            if p.dim() != 1:
                raise ValueError(f"soft_mask: depth probabilities must be ({n_choices},), got {tuple(p.shape)}")
            keep = p @ depth_keep_matrix(n_layers, choices, depth_order, p.device, p.dtype)  # (n_layers,)
            for i in range(n_layers):
                layers[i].keep = keep[i]
            continue
        mixed = p @ candidate_masks(config, axis, choices, p.device, p.dtype)  # (size,) or (n_kind, size)
        if axis == "hidden":
            if p.dim() != 1:
                raise ValueError(f"soft_mask: hidden probabilities must be ({n_choices},), got {tuple(p.shape)}")
            hidden = mixed
            continue
        rows = [i for i, k in enumerate(kinds) if k == LAYER_AXES[axis]]
        if p.dim() == 2:
            if not space.per_layer:
                raise ValueError(f"soft_mask: per-layer {axis} probabilities need an elastic space with per_layer=True")
            if p.shape[0] != len(rows):
                raise ValueError(
                    f"soft_mask: {axis} has {p.shape[0]} rows of probabilities but the model has "
                    f"{len(rows)} {LAYER_AXES[axis]} layers"
                )
        for r, i in enumerate(rows):
            setattr(layers[i], _LAYERMASK_FIELD[axis], mixed[r] if p.dim() == 2 else mixed)
    return ModelMask(hidden=hidden, layers=layers)


def mask_as_dense(config: HybridConfig, mask: ModelMask) -> dict[str, Tensor]:
    """Every mask entry with ``None`` replaced by ones (for comparing hard and soft masks)."""
    out: dict[str, Tensor] = {"hidden": _ones_if_none(mask.hidden, config.hidden_size)}
    for i, kind in enumerate(config.layer_kinds):
        lm = mask.layer(i) or LayerMask()
        out[f"{i}.keep"] = _ones_if_none(lm.keep, None)
        for axis, field in _LAYERMASK_FIELD.items():
            if LAYER_AXES[axis] != kind:
                continue
            out[f"{i}.{field}"] = _ones_if_none(getattr(lm, field), full_size(config, axis))
    return out


def _ones_if_none(t: Tensor | None, size: int | None) -> Tensor:
    if t is not None:
        return t.detach().float().cpu()
    return torch.ones(()) if size is None else torch.ones(size)
