"""The trained budgets of a nested family, and their encoding as router inputs.

A budget states a target fraction of the parent's TOTAL parameters, of its ACTIVE parameters, or both
(MoE models need both); the full budget is the parent (every target 1.0). :class:`BudgetSet` is
sorted descending, so index 0 is the full model. A key between two trained budgets encodes as the
interpolation of their one-hots; keys outside the trained range are refused.
:meth:`BudgetSet.check_reachable` rejects early what cannot train.

Design notes (keys, ordering, reachability): docs/elastic.md ("Budgets").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor

from model.config import HybridConfig
from model.elastic.arch import Architecture
from model.elastic.params import ParamCount, count_params
from model.elastic.space import ElasticSpace

TargetKind = Literal["total", "active"]
TARGET_KINDS: tuple[TargetKind, ...] = ("total", "active")
"""The two parameter counts a budget can target, in the order they are reported."""

MAX_LISTED_ARCHITECTURES = 20_000
"""Spaces with at most this many global architectures are listed in full by the feasibility check."""

_EXACT = 1e-9
"""Two fractions closer than this are the same fraction (float noise from YAML / JSON round trips)."""


class UnknownBudgetError(ValueError, KeyError):
    """A budget name that is not in the set; the message lists the valid names.

    A ``ValueError`` (bad input) and a ``KeyError`` (failed lookup), so either ``except`` catches it.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Budget(BaseModel):
    """One trained budget: a name (used as the served model id) and its target fractions of the parent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Budget name, e.g. 'full', '23b'.")
    total: float | None = Field(
        None, gt=0.0, le=1.0, description="Target fraction of the parent's total parameters (None: no total target)."
    )
    active: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Target fraction of the parent's active parameters (None: no active target). 'fraction' is "
        "accepted as this field's older name.",
    )

    @model_validator(mode="before")
    @classmethod
    def _fraction_is_active(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "fraction" not in data:
            return data
        data = dict(data)
        fraction = data.pop("fraction")
        if data.get("active") is not None and fraction is not None and not math.isclose(fraction, data["active"]):
            raise ValueError(
                f"budget {data.get('name')!r}: 'fraction' ({fraction}) is the active target and disagrees with "
                f"'active' ({data['active']}); state only 'active'"
            )
        if data.get("active") is None:
            data["active"] = fraction
        return data

    @model_validator(mode="after")
    def _one_target(self) -> Budget:
        if self.total is None and self.active is None:
            raise ValueError(
                f"budget {self.name!r} states no target; give 'total' and/or 'active' (fractions of the parent's "
                "total / active parameters)"
            )
        return self

    @property
    def targets(self) -> dict[TargetKind, float]:
        """The stated targets, ``{"total": ..., "active": ...}`` (either may be missing)."""
        return {k: v for k in TARGET_KINDS if (v := getattr(self, k)) is not None}

    @property
    def fraction(self) -> float:
        """The active target, or the total target of a budget that states only that."""
        return self.active if self.active is not None else self.total  # type: ignore[return-value]

    def deviations(self, count: ParamCount, full: ParamCount) -> dict[TargetKind, float]:
        """Relative miss ``|N / (target * N_full) - 1|`` of ``count`` on every stated target."""
        return {k: abs(getattr(count, k) / (t * getattr(full, k)) - 1.0) for k, t in self.targets.items()}

    def describe(self) -> str:
        """``total 0.38, active 0.56`` (the stated targets)."""
        return ", ".join(f"{k} {v:.4g}" for k, v in self.targets.items())


class BudgetSet(BaseModel):
    """The trained budgets, sorted descending; the first is the full model (every target 1.0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budgets: list[Budget] = Field(min_length=1, description="Budgets; any order, stored descending.")

    @field_validator("budgets")
    @classmethod
    def _sort_and_check(cls, budgets: list[Budget]) -> list[Budget]:
        kind = _key_kind(budgets)
        ordered = sorted(budgets, key=lambda b: -_key(b, kind))
        problems: list[str] = []
        names = [b.name for b in ordered]
        dup_names = sorted({n for n in names if names.count(n) > 1})
        if dup_names:
            problems.append(f"budget names must be unique; repeated {dup_names}")
        for a, b in zip(ordered, ordered[1:], strict=False):
            if abs(_key(a, kind) - _key(b, kind)) <= _EXACT:
                problems.append(f"budgets {a.name!r} and {b.name!r} share the {kind} target {_key(a, kind)}")
            for k in TARGET_KINDS:
                ta, tb = getattr(a, k), getattr(b, k)
                if ta is not None and tb is not None and tb > ta + _EXACT:
                    problems.append(
                        f"budget {b.name!r} is smaller than {a.name!r} ({kind} {_key(b, kind)} < {_key(a, kind)}) "
                        f"but has a larger {k} target ({tb} > {ta}); nested budgets shrink in both"
                    )
        full = ordered[0]
        off = {k: v for k, v in full.targets.items() if abs(v - 1.0) > _EXACT}
        if off:
            problems.append(
                f"the largest budget must be the full model (every target 1.0); got {full.name!r} with {off}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        # the full budget is the parent: it meets both targets at 1.0 whatever it stated
        return [Budget(name=full.name, total=1.0, active=1.0), *ordered[1:]]

    @classmethod
    def of(cls, fractions: dict[str, float]) -> BudgetSet:
        """Shorthand with active targets: ``BudgetSet.of({"full": 1.0, "small": 0.56})``."""
        return cls(budgets=[Budget(name=n, active=f) for n, f in fractions.items()])

    @classmethod
    def of_targets(cls, targets: dict[str, dict[str, float]]) -> BudgetSet:
        """Shorthand with explicit targets: ``BudgetSet.of_targets({"full": {"total": 1.0}, "s": {"total": 0.4}})``."""
        return cls(budgets=[Budget(name=n, **t) for n, t in targets.items()])

    @property
    def key_kind(self) -> TargetKind:
        """The target budgets are ordered and encoded by: ``active`` if every budget states one, else ``total``."""
        return _key_kind(self.budgets)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.budgets)

    @property
    def names(self) -> list[str]:
        """Budget names, largest budget first."""
        return [b.name for b in self.budgets]

    @property
    def fractions(self) -> list[float]:
        """Every budget's key (its :attr:`key_kind` target), descending (the first is 1.0)."""
        kind = self.key_kind
        return [_key(b, kind) for b in self.budgets]

    @property
    def full(self) -> Budget:
        """The full budget (every target 1.0)."""
        return self.budgets[0]

    def index(self, name: str) -> int:
        """Position of ``name`` (0 = full); :class:`UnknownBudgetError` listing the valid names otherwise."""
        for i, b in enumerate(self.budgets):
            if b.name == name:
                return i
        raise UnknownBudgetError(f"unknown budget {name!r}; valid budgets {self.names}")

    def get(self, name: str) -> Budget:
        """The budget called ``name``; :class:`UnknownBudgetError` listing the valid names otherwise."""
        return self.budgets[self.index(name)]

    def is_full(self, name: str) -> bool:
        return self.index(name) == 0

    # ------------------------------------------------------------------ router inputs
    def one_hot(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Tensor:
        """(n_budgets,) one-hot of the budget ``name``."""
        out = torch.zeros(len(self), dtype=dtype, device=device)
        out[self.index(name)] = 1.0
        return out

    def encode(self, fraction: float, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Tensor:
        """(n_budgets,) router input for any key (a :attr:`key_kind` fraction) inside the trained range.

        A trained key gives its one-hot; a key strictly between trained keys
        ``f_hi > f > f_lo`` gives ``w * onehot(hi) + (1 - w) * onehot(lo)`` with
        ``w = (f - f_lo) / (f_hi - f_lo)``. Outside ``[smallest, 1.0]``: ``ValueError``.
        """
        fr = self.fractions
        if not fr[-1] - _EXACT <= fraction <= fr[0] + _EXACT:
            raise ValueError(
                f"fraction {fraction} is outside the trained range [{fr[-1]}, {fr[0]}] "
                f"(budgets {dict(zip(self.names, fr, strict=True))}); the router cannot extrapolate"
            )
        out = torch.zeros(len(self), dtype=dtype, device=device)
        for i, f in enumerate(fr):
            if abs(f - fraction) <= _EXACT:
                out[i] = 1.0
                return out
        # fr is descending: find hi > fraction > lo
        hi = max(i for i, f in enumerate(fr) if f > fraction)
        lo = hi + 1
        w = (fraction - fr[lo]) / (fr[hi] - fr[lo])
        out[hi] = w
        out[lo] = 1.0 - w
        return out

    # ------------------------------------------------------------------ feasibility
    def check_reachable(
        self,
        config: HybridConfig,
        space: ElasticSpace,
        depth_order: Sequence[int] | None = None,
        dead_zone: float = 0.05,
    ) -> float:
        """Raise ``ValueError`` unless every budget can come within ``dead_zone`` of each of its targets.

        Returns the smallest active fraction the space reaches (all axes at their smallest
        candidate). A target is unreachable when the smallest architecture's fraction exceeds
        ``target * (1 + dead_zone)``: the budget loss ``|N / (b * N_full) - 1|`` could then never
        fall inside the dead zone. When the space is not per-layer and lists at most
        :data:`MAX_LISTED_ARCHITECTURES` architectures, a budget with several targets that no
        architecture meets together within ``dead_zone`` is refused too, naming the nearest one.
        """
        smallest = smallest_fractions(config, space, depth_order)
        problems = []
        for b in self.budgets:
            for k, t in b.targets.items():
                if smallest[k] > t * (1.0 + dead_zone):
                    problems.append(
                        f"budget {b.name!r} ({k} target {t:.4f}) cannot be reached: the smallest architecture of the "
                        f"elastic space has {k} fraction {smallest[k]:.4f} (> target x {1 + dead_zone:g})"
                    )
        if not problems:
            problems = self._joint_problems(config, space, depth_order, dead_zone)
        if problems:
            raise ValueError(
                "; ".join(problems) + "; add smaller candidates, make more axes elastic or change the targets"
            )
        return smallest["active"]

    def _joint_problems(
        self, config: HybridConfig, space: ElasticSpace, depth_order: Sequence[int] | None, dead_zone: float
    ) -> list[str]:
        """Budgets with several targets that no listed architecture meets together (empty if the space is too large)."""
        multi = [b for b in self.budgets[1:] if len(b.targets) > 1]
        if not multi or space.per_layer:  # per-layer sizes reach architectures a global listing misses
            return []
        archs = list_architectures(space)
        if archs is None:
            return []
        full = count_params(config)
        counts = [(a, count_params(config, a, depth_order)) for a in archs]
        problems = []
        for b in multi:
            worst = [(max(b.deviations(c, full).values()), a, c) for a, c in counts]
            dev, arch, c = min(worst, key=lambda t: t[0])
            if dev > dead_zone:
                problems.append(
                    f"budget {b.name!r} ({b.describe()}): no architecture of the space meets every target within "
                    f"{100 * dead_zone:g}%; the nearest, {arch.to_dict()}, has total {c.total / full.total:.4f} and "
                    f"active {c.active / full.active:.4f}"
                )
        return problems


def _key_kind(budgets: Sequence[Budget]) -> TargetKind:
    """``active`` if every budget but the full one states an active target, else ``total`` (all must state one)."""
    rest = [b for b in budgets if not all(abs(v - 1.0) <= _EXACT for v in b.targets.values())]
    if all(b.active is not None for b in rest):
        return "active"
    if all(b.total is not None for b in rest):
        return "total"
    raise ValueError(
        "every budget must state an active target, or every budget a total target (budgets are ordered and "
        f"interpolated by it); got {[(b.name, b.targets) for b in budgets]}"
    )


def _key(budget: Budget, kind: TargetKind) -> float:
    """The budget's ``kind`` target; the full budget (every stated target 1.0) is 1.0 on both."""
    value = getattr(budget, kind)
    return value if value is not None else budget.fraction


def smallest_architecture(space: ElasticSpace) -> Architecture:
    """Every elastic axis at its smallest candidate (the minimum of every parameter count)."""
    return Architecture(**{axis: space.choices(axis)[-1] for axis in space.elastic_axes})


def smallest_fractions(
    config: HybridConfig, space: ElasticSpace, depth_order: Sequence[int] | None = None
) -> dict[TargetKind, float]:
    """Total and active parameters of :func:`smallest_architecture` over the parent's."""
    space.validate_against(config)
    full = count_params(config)
    small = count_params(config, smallest_architecture(space), depth_order)
    return {"total": small.total / full.total, "active": small.active / full.active}


def smallest_active_fraction(
    config: HybridConfig, space: ElasticSpace, depth_order: Sequence[int] | None = None
) -> float:
    """Active parameters of :func:`smallest_architecture` over the parent's active parameters."""
    return smallest_fractions(config, space, depth_order)["active"]


def list_architectures(space: ElasticSpace, limit: int = MAX_LISTED_ARCHITECTURES) -> list[Architecture] | None:
    """Every global architecture of the space (one candidate per elastic axis), or None if more than ``limit``."""
    axes = space.elastic_axes
    if math.prod(len(space.choices(a)) for a in axes) > limit:
        return None
    return [
        Architecture(**dict(zip(axes, sizes, strict=True)))
        for sizes in itertools.product(*(space.choices(a) for a in axes))
    ]
