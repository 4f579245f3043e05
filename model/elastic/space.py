"""The elastic search space: which axes shrink, and to which candidate sizes.

One optional candidate list per axis (``None``: not elastic), strictly descending from the parent's
full size, so candidate 0 is the full model on every axis. Head axes count TOTAL heads per layer
(divisible by the group count). Validation names the axis, the value and what is allowed;
``nvfp4_aligned`` demands widths on NVFP4's 16-element block boundaries.

Design notes: docs/elastic.md ("The search space").
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from model.config import HybridConfig

AXES: tuple[str, ...] = (
    "hidden",
    "mamba_heads",
    "attn_heads",
    "mlp_ffn",
    "moe_ffn",
    "shared_ffn",
    "experts",
    "depth",
)
"""Every elastic axis, in a fixed order (the order of router heads and of error messages)."""

LAYER_AXES: dict[str, str] = {
    "mamba_heads": "mamba",
    "attn_heads": "attention",
    "mlp_ffn": "mlp",
    "moe_ffn": "moe",
    "shared_ffn": "moe",
    "experts": "moe",
}
"""Axes that live inside layers -> the layer kind they apply to (these can be chosen per layer)."""

NVFP4_BLOCK = 16
"""Block length of NVFP4 scales along a weight's input dimension."""


def full_size(config: HybridConfig, axis: str) -> int:
    """The parent's size along ``axis`` (total heads for head axes, layer count for depth)."""
    sizes = {
        "hidden": config.hidden_size,
        "mamba_heads": config.mamba_num_heads,
        "attn_heads": config.num_attention_heads,
        "mlp_ffn": config.intermediate_size,
        "moe_ffn": config.moe_intermediate_size,
        "shared_ffn": config.moe_shared_expert_intermediate_size,
        "experts": config.n_routed_experts,
        "depth": config.num_hidden_layers,
    }
    if axis not in sizes:
        raise ValueError(f"unknown elastic axis {axis!r}; known axes {list(AXES)}")
    return sizes[axis]


def allowed_sizes(config: HybridConfig, axis: str) -> list[int]:
    """Every size the model can take along ``axis`` (descending), ignoring any candidate list.

    Head axes need a multiple of the group count; experts need at least top-k experts and
    ungrouped routing; a missing shared expert cannot shrink.
    """
    full = full_size(config, axis)
    if axis == "mamba_heads":
        return list(range(full, 0, -config.n_groups))
    if axis == "attn_heads":
        return list(range(full, 0, -config.num_key_value_heads))
    if axis == "experts":
        if config.n_group > 1:  # group-limited routing needs every group intact
            return [full]
        return list(range(full, config.num_experts_per_tok - 1, -1))
    if axis == "shared_ffn" and not config.n_shared_experts:
        return [full]
    return list(range(full, 0, -1))


def describe_allowed(values: list[int]) -> str:
    """A short human form of an allowed-value list: explicit when short, a stepped range when long."""
    if len(values) <= 12:
        return str(values)
    step = values[0] - values[1]
    return f"[{values[0]}, {values[1]}, ..., {values[-1]}] (every {step})"


def nvfp4_problem(config: HybridConfig, axis: str, value: int) -> str | None:
    """Why ``value`` on ``axis`` would split an NVFP4 block, or None when it is aligned."""
    if axis == "mamba_heads":
        width, what = (value // config.n_groups) * config.mamba_head_dim, "channels per Mamba group"
    elif axis == "attn_heads":
        width, what = (value // config.num_key_value_heads) * config.head_dim, "channels per KV group"
    elif axis in ("hidden", "mlp_ffn", "moe_ffn", "shared_ffn"):
        width, what = value, "channels"
    else:  # experts and depth never become an input dimension
        return None
    if width % NVFP4_BLOCK:
        return (
            f"{axis}: {value} gives {width} {what}, not a multiple of {NVFP4_BLOCK} "
            f"(nvfp4_aligned needs whole NVFP4 blocks)"
        )
    return None


class ElasticSpace(BaseModel):
    """Candidate sizes per elastic axis; see the module docstring for the conventions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: list[int] | None = Field(None, description="Residual width d_model candidates, descending; first = full.")
    mamba_heads: list[int] | None = Field(
        None, description="TOTAL Mamba heads per layer, descending; each divisible by n_groups (k kept per group)."
    )
    attn_heads: list[int] | None = Field(
        None,
        description="TOTAL attention query heads, descending; each divisible by num_key_value_heads "
        "(the first k heads of every KV group are kept).",
    )
    mlp_ffn: list[int] | None = Field(None, description="Intermediate width of dense MLP ('-') layers, descending.")
    moe_ffn: list[int] | None = Field(None, description="Intermediate width of every routed expert, descending.")
    shared_ffn: list[int] | None = Field(None, description="Intermediate width of the shared expert, descending.")
    experts: list[int] | None = Field(
        None, description="Routed experts per MoE layer, descending; each >= num_experts_per_tok; needs n_group == 1."
    )
    depth: list[int] | None = Field(
        None, description="Number of layers kept, descending; layers are dropped in a ranked depth order."
    )
    per_layer: bool = Field(False, description="Allow architectures to choose layer-axis sizes per layer.")
    nvfp4_aligned: bool = Field(
        False, description="Require every elastic width along an input dimension to be a multiple of 16."
    )

    @field_validator(*AXES)
    @classmethod
    def _descending(cls, values: list[int] | None, info) -> list[int] | None:
        if values is None:
            return None
        if not values:
            raise ValueError(f"{info.field_name}: empty candidate list; use null for a non-elastic axis")
        if any(v <= 0 for v in values):
            raise ValueError(f"{info.field_name}: candidates must be positive, got {values}")
        if any(a <= b for a, b in zip(values, values[1:], strict=False)):
            raise ValueError(f"{info.field_name}: candidates must be strictly descending, got {values}")
        return values

    # ------------------------------------------------------------------ queries
    @property
    def elastic_axes(self) -> list[str]:
        """Axes with a candidate list, in :data:`AXES` order."""
        return [a for a in AXES if getattr(self, a) is not None]

    def choices(self, axis: str) -> list[int] | None:
        """The candidate list of ``axis`` (None when the axis is not elastic)."""
        if axis not in AXES:
            raise ValueError(f"unknown elastic axis {axis!r}; known axes {list(AXES)}")
        return getattr(self, axis)

    def validate_against(self, config: HybridConfig) -> None:
        """Raise one ``ValueError`` listing every candidate the model cannot take (axis, value, allowed)."""
        problems: list[str] = []
        for axis in self.elastic_axes:
            values: list[int] = getattr(self, axis)
            full = full_size(config, axis)
            allowed = allowed_sizes(config, axis)
            if values[0] != full:
                problems.append(f"{axis}: first candidate {values[0]} must be the full size {full}")
            bad = [v for v in values if v not in allowed]
            if bad:
                why = ""
                if axis == "experts" and config.n_group > 1:
                    why = f" (n_group={config.n_group}: group-limited routing cannot drop experts)"
                elif axis == "experts":
                    why = f" (at least num_experts_per_tok={config.num_experts_per_tok})"
                elif axis == "mamba_heads":
                    why = f" (multiples of n_groups={config.n_groups})"
                elif axis == "attn_heads":
                    why = f" (multiples of num_key_value_heads={config.num_key_value_heads})"
                elif axis == "shared_ffn" and not config.n_shared_experts:
                    why = " (the model has no shared expert)"
                problems.append(f"{axis}: {bad} not allowed; allowed values {describe_allowed(allowed)}{why}")
            if self.nvfp4_aligned:
                problems.extend(p for v in values if (p := nvfp4_problem(config, axis, v)) is not None)
        if problems:
            raise ValueError("elastic space does not fit the model: " + "; ".join(problems))
