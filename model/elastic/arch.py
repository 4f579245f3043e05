"""One sub-model of the elastic family: an :class:`Architecture`, and its per-layer resolution.

``None`` on an axis means "full size", so ``Architecture()`` is the parent. Head axes hold TOTAL
heads; per-layer overrides are keyed by the ORIGINAL layer index; depth is a count of kept layers,
which layers go coming from a ranked ``depth_order`` (default: the last layers first).
:meth:`Architecture.resolve` gives the concrete per-layer sizes (:class:`ResolvedArch`), the single
input of mask building, slicing and counting.

Design notes: docs/elastic.md ("Architectures").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from model.config import LAYER_KINDS, HybridConfig
from model.elastic.space import AXES, LAYER_AXES, ElasticSpace, allowed_sizes, describe_allowed, full_size

_KIND_CHAR = {kind: char for char, kind in LAYER_KINDS.items()}


class LayerOverride(BaseModel):
    """Per-layer sizes that replace the architecture's global choice on one layer (None = global)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mamba_heads: int | None = Field(None, gt=0, description="TOTAL Mamba heads of this Mamba layer.")
    attn_heads: int | None = Field(None, gt=0, description="TOTAL query heads of this attention layer.")
    mlp_ffn: int | None = Field(None, gt=0, description="Intermediate width of this dense MLP layer.")
    moe_ffn: int | None = Field(None, gt=0, description="Routed-expert width of this MoE layer.")
    shared_ffn: int | None = Field(None, gt=0, description="Shared-expert width of this MoE layer.")
    experts: int | None = Field(None, gt=0, description="Routed experts of this MoE layer.")


class Architecture(BaseModel):
    """Sizes of one nested sub-model; every ``None`` is the parent's full size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: int | None = Field(None, gt=0, description="Residual width d_model.")
    mamba_heads: int | None = Field(None, gt=0, description="TOTAL Mamba heads per layer (k per group kept).")
    attn_heads: int | None = Field(None, gt=0, description="TOTAL query heads per attention layer.")
    mlp_ffn: int | None = Field(None, gt=0, description="Dense MLP intermediate width.")
    moe_ffn: int | None = Field(None, gt=0, description="Routed-expert intermediate width.")
    shared_ffn: int | None = Field(None, gt=0, description="Shared-expert intermediate width.")
    experts: int | None = Field(None, gt=0, description="Routed experts per MoE layer.")
    depth: int | None = Field(None, gt=0, description="Layers kept (dropped in the given depth order).")
    layers: dict[int, LayerOverride] = Field(
        default_factory=dict, description="Per-layer overrides keyed by the parent's layer index."
    )

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Architecture:
        """From a plain dict (e.g. JSON); layer keys may be strings. Unknown keys raise ValueError."""
        try:
            return cls.model_validate(data)
        except Exception as err:  # pydantic's ValidationError is a ValueError; keep the message
            raise ValueError(f"invalid architecture {data!r}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """Only the axes that are set; per-layer overrides only when present."""
        out: dict[str, Any] = {a: getattr(self, a) for a in AXES if getattr(self, a) is not None}
        if self.layers:
            out["layers"] = {i: ov.model_dump(exclude_none=True) for i, ov in sorted(self.layers.items())}
        return out

    @classmethod
    def largest_in(cls, space: ElasticSpace, config: HybridConfig) -> Architecture:
        """The largest architecture of ``space``: every elastic axis at its first (full) candidate."""
        space.validate_against(config)
        return cls(**{axis: getattr(space, axis)[0] for axis in space.elastic_axes})

    # ------------------------------------------------------------------ validation
    def validate(
        self, config: HybridConfig, space: ElasticSpace | None = None, depth_order: Sequence[int] | None = None
    ) -> None:
        """Raise one ``ValueError`` listing every size the model (or the space) cannot take.

        Without a space the model's own limits apply (at most the full size, head counts divisible
        by the group count, experts >= top-k, ...); with a space every value must be one of that
        axis's candidates (only the full size on a non-elastic axis).
        """
        problems: list[str] = []
        if space is not None:
            space.validate_against(config)

        def check(where: str, axis: str, value: int | None) -> None:
            if value is None:
                return
            if space is not None:
                allowed = space.choices(axis) or [full_size(config, axis)]
                source = "candidates of the elastic space" if space.choices(axis) else "axis is not elastic"
            else:
                allowed = allowed_sizes(config, axis)
                source = "sizes the model can take"
            if value not in allowed:
                problems.append(f"{where}: {value} not allowed; allowed values {describe_allowed(allowed)} ({source})")

        for axis in AXES:
            check(axis, axis, getattr(self, axis))
        if self.layers and space is not None and not space.per_layer:
            problems.append("layers: per-layer overrides need an elastic space with per_layer=True")
        kinds = config.layer_kinds
        for index, override in sorted(self.layers.items()):
            if not 0 <= index < len(kinds):
                problems.append(f"layers: layer index {index} out of range; allowed 0..{len(kinds) - 1}")
                continue
            for axis in LAYER_AXES:
                value = getattr(override, axis)
                if value is None:
                    continue
                if LAYER_AXES[axis] != kinds[index]:
                    problems.append(
                        f"layers[{index}].{axis}: layer {index} is a {kinds[index]} layer; "
                        f"{axis} applies to {LAYER_AXES[axis]} layers only"
                    )
                    continue
                check(f"layers[{index}].{axis}", axis, value)
        n_layers = config.num_hidden_layers
        if depth_order is not None or (self.depth is not None and self.depth < n_layers):
            try:
                order = check_depth_order(n_layers, depth_order)
                if self.depth is not None and n_layers - self.depth > len(order):
                    problems.append(
                        f"depth: {self.depth} drops {n_layers - self.depth} layers but depth_order lists only "
                        f"{len(order)}; allowed depths {list(range(n_layers, n_layers - len(order) - 1, -1))}"
                    )
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("invalid architecture: " + "; ".join(problems))

    # ------------------------------------------------------------------ resolution
    def resolve(
        self, config: HybridConfig, space: ElasticSpace | None = None, depth_order: Sequence[int] | None = None
    ) -> ResolvedArch:
        """Validate, then give every layer of the parent its concrete sizes and keep flag."""
        self.validate(config, space, depth_order)
        n_layers = config.num_hidden_layers
        depth = self.depth if self.depth is not None else n_layers
        dropped = set(check_depth_order(n_layers, depth_order)[: n_layers - depth])

        def size(axis: str, index: int) -> int:
            override = self.layers.get(index)
            value = getattr(override, axis) if override is not None else None
            if value is None:
                value = getattr(self, axis)
            return full_size(config, axis) if value is None else value

        layers = []
        for i, kind in enumerate(config.layer_kinds):
            layers.append(
                LayerArch(
                    index=i,
                    kind=kind,
                    keep=i not in dropped,
                    mamba_heads=size("mamba_heads", i) if kind == "mamba" else None,
                    attn_heads=size("attn_heads", i) if kind == "attention" else None,
                    ffn=size("mlp_ffn", i) if kind == "mlp" else size("moe_ffn", i) if kind == "moe" else None,
                    shared_ffn=size("shared_ffn", i) if kind == "moe" else None,
                    experts=size("experts", i) if kind == "moe" else None,
                )
            )
        hidden = self.hidden if self.hidden is not None else config.hidden_size
        return ResolvedArch(hidden=hidden, layers=layers)


@dataclass(frozen=True)
class LayerArch:
    """Concrete sizes of one parent layer; fields that do not apply to ``kind`` are None.

    ``ffn`` is the dense MLP width for ``mlp`` layers and the routed-expert width for ``moe``.
    """

    index: int
    kind: str
    keep: bool
    mamba_heads: int | None = None
    attn_heads: int | None = None
    ffn: int | None = None
    shared_ffn: int | None = None
    experts: int | None = None

    @property
    def char(self) -> str:
        """The pattern character of this layer's kind."""
        return _KIND_CHAR[self.kind]


@dataclass(frozen=True)
class ResolvedArch:
    """Every parent layer with its concrete sizes (dropped layers included, with ``keep=False``)."""

    hidden: int
    layers: list[LayerArch]

    @property
    def kept(self) -> list[LayerArch]:
        """The layers the sub-model keeps, in order."""
        return [la for la in self.layers if la.keep]

    @property
    def pattern(self) -> str:
        """The sub-model's layer pattern (the parent's with dropped layers removed)."""
        return "".join(la.char for la in self.kept)


def default_depth_order(n_layers: int) -> list[int]:
    """Drop from the last layer backwards: ``[n-1, ..., 0]``."""
    return list(range(n_layers - 1, -1, -1))


def check_depth_order(n_layers: int, depth_order: Sequence[int] | None) -> list[int]:
    """The depth order as a list (default when None); ValueError unless distinct indices in range."""
    if depth_order is None:
        return default_depth_order(n_layers)
    order = [int(i) for i in depth_order]
    bad = [i for i in order if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"depth_order: layer indices {bad} out of range; allowed 0..{n_layers - 1}")
    if len(set(order)) != len(order):
        raise ValueError(f"depth_order: repeated layer indices in {order}")
    return order


def drop_positions(n_layers: int, depth_order: Sequence[int] | None) -> list[int]:
    """Per layer, its position in the depth order (``n_layers`` for layers never dropped).

    Layer i is kept at depth d exactly when ``position[i] >= n_layers - d``.
    """
    order = check_depth_order(n_layers, depth_order)
    pos = [n_layers] * n_layers
    for p, i in enumerate(order):
        pos[i] = p
    return pos
