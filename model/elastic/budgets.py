"""The trained budgets of a nested family, and their encoding as router inputs.

Design choices:

* A budget is a target fraction of the parent's ACTIVE parameters (what a token touches; see
  :mod:`model.elastic.params`), because that is how mixture-of-experts models are sized and what
  the budget loss compares against.
* :class:`BudgetSet` is sorted descending by fraction on validation, whatever order the user wrote,
  so index 0 is always the full model (fraction 1.0 is required) and the router's one-hot input
  has one fixed meaning. Names and fractions are unique: two budgets with the same fraction would
  make :meth:`BudgetSet.encode` ambiguous.
* A fraction between two trained budgets encodes as the linear interpolation of their one-hots
  (weights proportional to closeness). Fractions outside the trained range are refused rather
  than extrapolated: the router never saw such inputs, and a clamped answer would silently give
  a model of a different size than asked for.
* :meth:`BudgetSet.check_reachable` is a cheap, early guard against configurations that cannot
  train: the smallest architecture of the space (every axis at its smallest candidate) must come
  within the budget loss's dead zone of every target, otherwise the budget loss can never reach
  zero for that budget. Parameter counts are monotone in every axis, so that single architecture
  is the minimum over the whole space.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from model.config import HybridConfig
from model.elastic.arch import Architecture
from model.elastic.params import count_params
from model.elastic.space import ElasticSpace

_EXACT = 1e-9
"""Two fractions closer than this are the same fraction (float noise from YAML / JSON round trips)."""


class UnknownBudgetError(ValueError, KeyError):
    """A budget name that is not in the set; the message lists the valid names.

    A ``ValueError`` (bad input) and a ``KeyError`` (failed lookup), so either ``except`` catches it.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Budget(BaseModel):
    """One trained budget: a name (used as the served model id) and a target active fraction."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Budget name, e.g. 'full', '23b'.")
    fraction: float = Field(gt=0.0, le=1.0, description="Target fraction of the parent's active parameters.")


class BudgetSet(BaseModel):
    """The trained budgets, sorted descending by fraction; the first is the full model (1.0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budgets: list[Budget] = Field(min_length=1, description="Budgets; any order, stored descending.")

    @field_validator("budgets")
    @classmethod
    def _sort_and_check(cls, budgets: list[Budget]) -> list[Budget]:
        ordered = sorted(budgets, key=lambda b: -b.fraction)
        problems: list[str] = []
        names = [b.name for b in ordered]
        dup_names = sorted({n for n in names if names.count(n) > 1})
        if dup_names:
            problems.append(f"budget names must be unique; repeated {dup_names}")
        for a, b in zip(ordered, ordered[1:], strict=False):
            if abs(a.fraction - b.fraction) <= _EXACT:
                problems.append(f"budgets {a.name!r} and {b.name!r} share the fraction {a.fraction}")
        if abs(ordered[0].fraction - 1.0) > _EXACT:
            problems.append(
                f"the largest budget must be the full model (fraction 1.0); got {ordered[0].name!r} "
                f"at {ordered[0].fraction}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return ordered

    @classmethod
    def of(cls, fractions: dict[str, float]) -> BudgetSet:
        """Shorthand: ``BudgetSet.of({"full": 1.0, "small": 0.56})``."""
        return cls(budgets=[Budget(name=n, fraction=f) for n, f in fractions.items()])

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.budgets)

    @property
    def names(self) -> list[str]:
        """Budget names, largest budget first."""
        return [b.name for b in self.budgets]

    @property
    def fractions(self) -> list[float]:
        """Target fractions, descending (the first is 1.0)."""
        return [b.fraction for b in self.budgets]

    @property
    def full(self) -> Budget:
        """The full budget (fraction 1.0)."""
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
        """(n_budgets,) router input for any fraction inside the trained range.

        A trained fraction gives its one-hot; a fraction strictly between trained fractions
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
        """Raise ``ValueError`` unless every budget can come within ``dead_zone`` of its target.

        Returns the smallest active fraction the space reaches (all axes at their smallest
        candidate). A budget is unreachable when that fraction exceeds ``target * (1 + dead_zone)``:
        the budget loss ``|N / (b * N_full) - 1|`` could then never fall inside the dead zone.
        """
        smallest = smallest_active_fraction(config, space, depth_order)
        bad = [b for b in self.budgets if smallest > b.fraction * (1.0 + dead_zone)]
        if bad:
            parts = [f"budget {b.name!r} (target {b.fraction:.4f})" for b in bad]
            raise ValueError(
                f"{', '.join(parts)} cannot be reached: the smallest architecture of the elastic space has an "
                f"active fraction of {smallest:.4f} (> target x {1 + dead_zone:g}); add smaller candidates or "
                "make more axes elastic"
            )
        return smallest


def smallest_architecture(space: ElasticSpace) -> Architecture:
    """Every elastic axis at its smallest candidate (the minimum of every parameter count)."""
    return Architecture(**{axis: space.choices(axis)[-1] for axis in space.elastic_axes})


def smallest_active_fraction(
    config: HybridConfig, space: ElasticSpace, depth_order: Sequence[int] | None = None
) -> float:
    """Active parameters of :func:`smallest_architecture` over the parent's active parameters."""
    space.validate_against(config)
    full = count_params(config).active
    small = count_params(config, smallest_architecture(space), depth_order).active
    return small / full
