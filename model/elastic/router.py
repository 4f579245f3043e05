"""The budget router: budget one-hot in, a distribution over candidate sizes per elastic axis out.

One small bias-free MLP per elastic axis, ``Linear(n_budgets -> hidden) -> LeakyReLU(0.1) ->
Linear(hidden -> n_choices)`` (``n_choices * n_layers_of_kind`` outputs for per-layer choices).
Samples are Gumbel-softmax, ``softmax((scale_t * logits + G) / tau_t)``, with a schedule on a global
step spanning both distillation phases, an occasional straight-through hard sample, and all
randomness from one explicit ``torch.Generator``. The initialisation puts the full budget near the
largest candidate and spreads the smaller ones by rank.

Design notes (schedule, initialisation, prior table): docs/elastic.md ("The budget router").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from model.config import HybridConfig
from model.elastic.arch import Architecture, LayerOverride
from model.elastic.budgets import Budget, BudgetSet
from model.elastic.space import LAYER_AXES, ElasticSpace

_FULL_PROB = 0.9
"""Initial softmax probability of the largest candidate for the full budget (at scale 1, no noise)."""
_SPREAD_RATIO = 2.0
"""Initial odds of a smaller budget's preferred candidate against each other candidate."""


class RouterConfig(BaseModel):
    """Hyper-parameters of :class:`BudgetRouter` and its sampling schedules."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: int = Field(128, gt=0, description="Hidden width of every per-axis MLP.")
    tau_start: float = Field(1.0, gt=0, description="Gumbel-softmax temperature at step 0.")
    tau_end: float = Field(0.05, gt=0, description="Temperature at the last step (geometric decay).")
    scale_start: float = Field(1.0, gt=0, description="Logit scale at step 0.")
    scale_end: float = Field(10.0, gt=0, description="Logit scale at the last step (linear ramp).")
    hard_sample_prob: float = Field(
        0.004, ge=0, le=1, description="Share of steps with a hard straight-through sample."
    )
    per_layer: bool = Field(False, description="One choice per layer on layer axes (needs space.per_layer).")
    seed: int = Field(0, ge=0, description="Seeds the initialisation and the default per-step noise generator.")
    schedule_steps: int | None = Field(
        None,
        ge=1,
        description="Length of the tau / scale schedule in global steps, over both distillation phases (e.g. "
        "phase-1 steps + phase-2 steps: one anneal across both). None: step_offset + the steps of the run "
        "(phase 1 anneals fully; phase 2 takes phase 1's value from its init_from).",
    )
    step_offset: int = Field(
        0,
        ge=0,
        description="Global schedule step of the run's first step: 0 in phase 1; phase 2 starts where phase 1 "
        "ended (filled in from init_from when left at 0).",
    )

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        if self.tau_end > self.tau_start:
            raise ValueError(f"tau_end ({self.tau_end}) must not exceed tau_start ({self.tau_start})")
        return self

    def schedule_at(self, step: int, run_steps: int) -> tuple[int, int]:
        """(global step, schedule length) of step ``step`` of a run of ``run_steps`` steps.

        The values :meth:`BudgetRouter.tau` / :meth:`BudgetRouter.scale` / ``forward`` take as
        ``(step, total)``. Past the schedule's end they hold ``tau_end`` / ``scale_end``.
        """
        total = self.schedule_steps if self.schedule_steps is not None else self.step_offset + run_steps
        return self.step_offset + step, total


@dataclass
class RouterSample:
    """One router draw.

    ``probs[axis]``: (n_choices,) or (n_layers_of_kind, n_choices) rows summing to 1 (float32), the
    input of :func:`~model.elastic.build_masks.soft_mask` and of the budget loss.
    ``logits[axis]``: the raw (unscaled, noise-free) logits of the same shape.
    ``hard``: whether this draw is a straight-through one-hot sample.
    """

    probs: dict[str, Tensor]
    logits: dict[str, Tensor]
    hard: bool
    tau: float = 1.0
    scale: float = 1.0


class BudgetRouter(nn.Module):
    """Per-axis MLPs mapping a budget encoding (n_budgets,) to candidate distributions."""

    def __init__(
        self,
        config: HybridConfig,
        space: ElasticSpace,
        budgets: BudgetSet,
        router_config: RouterConfig | None = None,
    ) -> None:
        super().__init__()
        rc = router_config or RouterConfig()
        space.validate_against(config)
        if rc.per_layer and not space.per_layer:
            raise ValueError("RouterConfig.per_layer=True needs an elastic space with per_layer=True")
        if rc.hidden < len(budgets):
            raise ValueError(
                f"RouterConfig.hidden ({rc.hidden}) must be at least the number of budgets ({len(budgets)})"
            )
        self.config = config
        self.space = space
        self.budgets = budgets
        self.router_config = rc
        self.n_budgets = len(budgets)
        kinds = config.layer_kinds
        # Parent layer indices of each layer axis (rows of per-layer choices, parent order).
        self.layer_rows: dict[str, list[int]] = {}
        self.axes: list[str] = []
        for axis in space.elastic_axes:
            if axis in LAYER_AXES:
                rows = [i for i, k in enumerate(kinds) if k == LAYER_AXES[axis]]
                if not rows:
                    continue  # no layer of that kind: the axis changes nothing
                self.layer_rows[axis] = rows
            self.axes.append(axis)
        self.heads = nn.ModuleDict(
            {
                axis: nn.Sequential(
                    nn.Linear(self.n_budgets, rc.hidden, bias=False),
                    nn.LeakyReLU(0.1),
                    nn.Linear(rc.hidden, self.n_rows(axis) * self.n_choices(axis), bias=False),
                )
                for axis in self.axes
            }
        )
        self.reset_parameters()

    # ------------------------------------------------------------------ shapes
    def n_choices(self, axis: str) -> int:
        return len(self.space.choices(axis))

    def is_per_layer(self, axis: str) -> bool:
        return self.router_config.per_layer and axis in LAYER_AXES

    def n_rows(self, axis: str) -> int:
        """Rows of choices: layers of the axis's kind when per-layer, else 1."""
        return len(self.layer_rows[axis]) if self.is_per_layer(axis) else 1

    # ------------------------------------------------------------------ initialisation
    def initial_logits(self, axis: str) -> Tensor:
        """(n_budgets, n_choices) prior logits (docs/elastic.md, "The budget router")."""
        n_b, n_c = self.n_budgets, self.n_choices(axis)
        table = torch.zeros(n_b, n_c)
        if n_c == 1:
            return table
        table[0, 0] = math.log(_FULL_PROB / (1 - _FULL_PROB) * (n_c - 1))
        for j in range(1, n_b):
            # rank j of n_b (0 = full) leans to the candidate at the same relative position
            table[j, round(j / (n_b - 1) * (n_c - 1))] = math.log(_SPREAD_RATIO)
        return table

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic initialisation from ``RouterConfig.seed`` (docs/elastic.md, "The budget router")."""
        g = torch.Generator().manual_seed(self.router_config.seed)
        n_b = self.n_budgets
        for axis in self.axes:
            first, _, second = self.heads[axis]
            w1 = torch.randn(first.weight.shape, generator=g) * 0.5  # (hidden, n_budgets)
            w1[:n_b] = torch.eye(n_b)
            w2 = torch.randn(second.weight.shape, generator=g) * 1e-3  # (rows * n_choices, hidden)
            w2[:, :n_b] = self.initial_logits(axis).T.repeat(self.n_rows(axis), 1)
            first.weight.copy_(w1)
            second.weight.copy_(w2)

    # ------------------------------------------------------------------ schedules
    def tau(self, step: int, total: int) -> float:
        """``tau_start * decay**step`` with ``decay = (tau_end / tau_start) ** (1 / total)``; tau_end at ``total``."""
        rc = self.router_config
        if total <= 0:
            return rc.tau_end
        t = min(max(step, 0), total) / total
        return rc.tau_start * (rc.tau_end / rc.tau_start) ** t

    def scale(self, step: int, total: int) -> float:
        """Linear ramp from ``scale_start`` at step 0 to ``scale_end`` at ``total``."""
        rc = self.router_config
        if total <= 0:
            return rc.scale_end
        t = min(max(step, 0), total) / total
        return rc.scale_start + (rc.scale_end - rc.scale_start) * t

    def step_generator(self, step: int) -> torch.Generator:
        """The default CPU generator of ``step``: identical on every worker sharing the seed."""
        return torch.Generator().manual_seed((self.router_config.seed * 1_000_003 + step) % (2**63))

    # ------------------------------------------------------------------ forward
    def _input(self, budget_vec: Tensor) -> Tensor:
        weight = self.heads[self.axes[0]][0].weight if self.axes else None
        if tuple(budget_vec.shape) != (self.n_budgets,):
            raise ValueError(f"budget_vec must have shape ({self.n_budgets},), got {tuple(budget_vec.shape)}")
        if weight is None:
            return budget_vec
        return budget_vec.to(device=weight.device, dtype=weight.dtype)

    def logits(self, budget_vec: Tensor) -> dict[str, Tensor]:
        """Raw logits per axis: (n_choices,) or (n_layers_of_kind, n_choices) when per-layer."""
        x = self._input(budget_vec)
        out = {}
        for axis in self.axes:
            flat = self.heads[axis](x)
            out[axis] = flat.view(self.n_rows(axis), self.n_choices(axis)) if self.is_per_layer(axis) else flat
        return out

    def forward(
        self,
        budget_vec: Tensor,
        step: int,
        total_steps: int,
        generator: torch.Generator | None = None,
        hard: bool | None = None,
    ) -> RouterSample:
        """Draw relaxed (or, rarely, straight-through hard) choices for the budget ``budget_vec`` (n_budgets,).

        ``step`` / ``total_steps``: the schedule position, global over both phases
        (:meth:`RouterConfig.schedule_at`). ``generator``: the source of all randomness (default
        :meth:`step_generator`). ``hard``
        forces (True) or forbids (False) a hard sample; None draws it with ``hard_sample_prob``.
        The coin is drawn either way, so the noise stream does not depend on ``hard``.
        """
        g = generator if generator is not None else self.step_generator(step)
        coin = torch.rand((), generator=g, device=g.device).item()
        is_hard = coin < self.router_config.hard_sample_prob if hard is None else bool(hard)
        tau, scale = self.tau(step, total_steps), self.scale(step, total_steps)
        logits = self.logits(budget_vec)
        probs = {}
        for axis in self.axes:
            z = logits[axis].float()
            noise = _gumbel(z.shape, g).to(z.device)
            y = torch.softmax((scale * z + noise) / tau, dim=-1)
            if is_hard:
                one_hot = torch.zeros_like(y).scatter_(-1, y.argmax(-1, keepdim=True), 1.0)
                y = one_hot - y.detach() + y  # forward: one-hot; backward: the relaxed gradient
            probs[axis] = y
        return RouterSample(probs=probs, logits=logits, hard=is_hard, tau=tau, scale=scale)

    # ------------------------------------------------------------------ architectures
    @torch.no_grad()
    def argmax_arch(self, budget_vec: Tensor) -> Architecture:
        """The architecture of the most likely candidate on every axis (deterministic, no noise).

        Per-layer choices become layer overrides, unless every layer of the kind picks the same
        size, which is then written as the global value (so the budget stays extractable as one
        standalone config).
        """
        global_sizes: dict[str, int] = {}
        overrides: dict[int, dict[str, int]] = {}
        for axis, z in self.logits(budget_vec).items():
            choices = self.space.choices(axis)
            idx = z.argmax(-1)
            if not self.is_per_layer(axis):
                global_sizes[axis] = choices[int(idx)]
                continue
            sizes = [choices[int(i)] for i in idx]
            if len(set(sizes)) == 1:
                global_sizes[axis] = sizes[0]
                continue
            for layer, size in zip(self.layer_rows[axis], sizes, strict=True):
                overrides.setdefault(layer, {})[axis] = size
        layers = {i: LayerOverride(**ov) for i, ov in sorted(overrides.items())}
        return Architecture(**global_sizes, layers=layers)

    def feasible_arch(
        self,
        budget_vec: Tensor,
        target: Budget | float,
        tolerance: float = 0.05,
        depth_order: Sequence[int] | None = None,
        max_combinations: int = 200_000,
    ) -> Architecture:
        """The architecture nearest the argmax that meets every target of ``target`` within ``tolerance``.

        ``target``: a :class:`~model.elastic.budgets.Budget` (each stated total / active target is
        checked) or a float (an active fraction). A late router can saturate on an architecture
        the budget loss no longer moves (its Gumbel samples are one-hot, so its gradients vanish).
        This selection keeps the router's ranking but enforces the targets: among every
        combination of candidates with ``|N_kind / (target_kind * N_full_kind) - 1| <= tolerance``
        on every stated kind it returns the one that gives up the least raw-logit margin,
        ``sum_axes (max_k z_k - z_chosen)`` (the argmax costs 0, so an on-target argmax is returned
        unchanged); ties go to the smaller largest deviation. Exhaustive over global choices;
        per-layer routers and spaces of more than ``max_combinations`` architectures raise
        ``ValueError`` (use the argmax there).
        """
        from model.elastic.params import count_params

        budget = target if isinstance(target, Budget) else Budget(name="target", active=target)
        if self.router_config.per_layer:
            raise ValueError("feasible selection enumerates global choices; a per-layer router needs select='argmax'")
        logits = {axis: z.detach().double() for axis, z in self.logits(budget_vec).items()}
        n = math.prod(len(z) for z in logits.values())
        if n > max_combinations:
            raise ValueError(
                f"feasible selection would enumerate {n:,} architectures (max_combinations={max_combinations:,}); "
                "use select='argmax' or a smaller space"
            )
        full = count_params(self.config)
        best: tuple[float, float, Architecture] | None = None
        axes = list(logits)
        for idx in itertools.product(*(range(len(logits[a])) for a in axes)):
            cost = sum(float(logits[a].max() - logits[a][i]) for a, i in zip(axes, idx, strict=True))
            if best is not None and cost > best[0]:
                continue
            arch = Architecture(**{a: self.space.choices(a)[i] for a, i in zip(axes, idx, strict=True)})
            deviation = max(budget.deviations(count_params(self.config, arch, depth_order), full).values())
            if deviation <= tolerance and (best is None or (cost, deviation) < best[:2]):
                best = (cost, deviation, arch)
        if best is None:
            raise ValueError(
                f"no architecture of the space is within {100 * tolerance:g}% of every target of budget "
                f"{budget.name!r} ({budget.describe()}); widen the candidate lists or the tolerance"
            )
        return best[2]

    def architectures(
        self,
        budget_set: BudgetSet | None = None,
        select: str = "argmax",
        tolerance: float = 0.05,
        depth_order: Sequence[int] | None = None,
    ) -> dict[str, Architecture]:
        """``{budget name: architecture}`` for every budget (default: the router's own set).

        ``select="argmax"``: the most likely candidate per axis (the method's rule);
        ``select="feasible"``: :meth:`feasible_arch`, the nearest on-target architecture.
        """
        bs = budget_set or self.budgets
        if len(bs) != self.n_budgets:
            raise ValueError(f"the router was built for {self.n_budgets} budgets; got a set of {len(bs)}")
        if select == "argmax":
            return {name: self.argmax_arch(bs.one_hot(name)) for name in bs.names}
        if select == "feasible":
            return {b.name: self.feasible_arch(bs.one_hot(b.name), b, tolerance, depth_order) for b in bs.budgets}
        raise ValueError(f"select must be 'argmax' or 'feasible', got {select!r}")


def _gumbel(shape: torch.Size, generator: torch.Generator) -> Tensor:
    """Standard Gumbel noise ``-log(-log(U))`` of ``shape`` (float32) on the generator's device."""
    u = torch.rand(shape, generator=generator, device=generator.device)
    u = u.clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - torch.finfo(torch.float32).eps)
    return -torch.log(-torch.log(u))
