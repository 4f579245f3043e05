"""One elastic micro-batch, without Ray or DeepSpeed: the trained module, its loss and the router's report.

What stays the same over a training run (the parent's config and parameter counts, the elastic space, the
budgets, the depth order, the loss's dead zone and weight, the KD chunk) is one frozen :class:`ElasticSpec`,
built once per worker; :func:`elastic_loss` and :func:`router_report` take it with what changes per
micro-batch (tokens, the drawn budget, the router schedule's position, the noise generator).

Design choices:

* :class:`ElasticStudent` holds the student AND the router, and the router runs inside its ``forward``:
  under ZeRO-3 DeepSpeed only gathers parameters of modules called through the engine, and both sets of
  parameters then share one optimizer, one clip and one reduction. With the teacher's hidden states it
  also computes the KD loss, so the student's ``lm_head`` is gathered by the engine for the loss.
* The teacher sends its final hidden states (batch, seq, hidden), not logits; the loss applies both
  ``lm_head`` weights chunk by chunk (:func:`~model.elastic.kd_chunked.chunked_kd_loss`: no (tokens x
  vocabulary) float32 tensor). Under ZeRO-3 the teacher's ``lm_head`` is gathered for the loss only.
* The parent's parameter counts are counted once, in :meth:`ElasticSpec.of`, not per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from components.distill import zero3
from components.distill.config import DistillConfig
from model.config import HybridConfig
from model.elastic.budgets import BudgetSet
from model.elastic.build_masks import soft_mask
from model.elastic.kd_chunked import DEFAULT_CHUNK, chunked_kd_loss
from model.elastic.losses import BudgetLossOut, budget_loss, kd_loss
from model.elastic.params import count_params
from model.elastic.router import BudgetRouter, RouterSample
from model.elastic.space import ElasticSpace
from model.hybrid import HybridLM


@dataclass(frozen=True)
class ElasticSpec:
    """What elastic training holds constant over a run, passed as one object (:meth:`of`, :meth:`from_config`)."""

    config: HybridConfig
    """The parent's (the teacher's) architecture: every budget is a sub-model of it."""
    space: ElasticSpace
    """Elastic axes and their candidate sizes."""
    budgets: BudgetSet
    """The trained budgets, largest first (index 0 is the full model)."""
    full_active: int
    """The parent's active parameters (what budgets' active targets are fractions of)."""
    full_total: int
    """The parent's total parameters (what budgets' total targets are fractions of)."""
    depth_order: tuple[int, ...] | None = None
    """Layers in the order depth drops them; None: deepest first."""
    dead_zone: float = 0.05
    """Relative deviation from a target under which the budget loss is 0."""
    alpha: float = 1.0
    """Weight of the budget loss against the KD loss."""
    kd_chunk_tokens: int = DEFAULT_CHUNK
    """Token rows per chunk of the KD loss (0: the reference loss on full logits)."""

    @classmethod
    def of(
        cls,
        config: HybridConfig,
        space: ElasticSpace,
        budgets: BudgetSet,
        *,
        depth_order: list[int] | tuple[int, ...] | None = None,
        dead_zone: float = 0.05,
        alpha: float = 1.0,
        kd_chunk_tokens: int = DEFAULT_CHUNK,
    ) -> ElasticSpec:
        """The spec of the parent ``config``, its parameter counts counted here, once."""
        full = count_params(config)
        order = tuple(depth_order) if depth_order is not None else None
        return cls(config, space, budgets, full.active, full.total, order, dead_zone, alpha, kd_chunk_tokens)

    @classmethod
    def from_config(cls, cfg: DistillConfig, model_config: HybridConfig) -> ElasticSpec:
        """The spec of one distillation phase over the teacher's ``model_config``."""
        return cls.of(
            model_config, cfg.space, cfg.budget_set, depth_order=cfg.depth_order, dead_zone=cfg.dead_zone,
            alpha=cfg.alpha, kd_chunk_tokens=cfg.kd_chunk_tokens,
        )  # fmt: skip

    def budget_loss(self, probs: dict[str, Tensor], budget_index: int) -> BudgetLossOut:
        """:func:`~model.elastic.losses.budget_loss` of router probabilities ``probs`` (axis -> (n_choices,) or
        (n_layers_of_kind, n_choices)) for budget ``budget_index`` (0: the full budget, pinned, no dead zone)."""
        return budget_loss(
            self.config, self.space, probs, self.budgets.budgets[budget_index], budget_index == 0,
            dead_zone=self.dead_zone, depth_order=self.depth_order, full_active=self.full_active,
            full_total=self.full_total,
        )  # fmt: skip


class ElasticStudent(nn.Module):
    """The trained module: the student HybridLM and its BudgetRouter, run together in ``forward``; with the
    teacher's hidden states it also computes the KD loss (so that, under ZeRO-3, the student's ``lm_head``
    is gathered by the engine for the loss: the worker registers it as an external parameter of this module)."""

    def __init__(self, student: HybridLM, router: BudgetRouter, depth_order: list[int] | None = None) -> None:
        super().__init__()
        self.student = student
        self.router = router
        self.depth_order = depth_order

    def forward(
        self,
        input_ids: Tensor,
        budget_vec: Tensor,
        step: int,
        total_steps: int,
        generator: torch.Generator,
        hard: bool | None = None,
        teacher_hidden: Tensor | None = None,
        teacher_head: Tensor | None = None,
        loss_mask: Tensor | None = None,
        kd_chunk_tokens: int = DEFAULT_CHUNK,
    ) -> tuple[Tensor, RouterSample]:
        """input_ids (batch, seq), budget_vec (n_budgets,) -> student logits (batch, seq, vocab) and the sample;
        with ``teacher_hidden`` (batch, seq, teacher hidden) and ``teacher_head`` (vocab, teacher hidden), the
        float32 KD loss of the masked student against the teacher (``loss_mask`` (batch, seq)) and the sample.

        ``step`` / ``total_steps``: the router schedule's global position; ``hard``: see :meth:`BudgetRouter.forward`;
        ``kd_chunk_tokens``: token rows per chunk of :func:`chunked_kd_loss` (0: the reference :func:`kd_loss` on
        full logits).
        """
        sample = self.router(budget_vec, step, total_steps, generator=generator, hard=hard)
        probs = {axis: p.to(self.student.lm_head.weight.dtype) for axis, p in sample.probs.items()}
        mask = soft_mask(self.student.config, probs, self.router.space, self.depth_order)
        if teacher_hidden is None:
            return self.student(input_ids, mask=mask).logits, sample
        hidden = self.student(input_ids, mask=mask, skip_logits=True).hidden
        if kd_chunk_tokens == 0:
            logits = self.student.lm_head(hidden)
            return kd_loss(logits, F.linear(teacher_hidden, teacher_head), loss_mask), sample
        kd = chunked_kd_loss(
            hidden, self.student.lm_head.weight, loss_mask=loss_mask, teacher_hidden=teacher_hidden,
            teacher_lm_head_weight=teacher_head, chunk_size=kd_chunk_tokens,
        )  # fmt: skip
        return kd, sample


def elastic_loss(
    model: nn.Module,
    teacher: nn.Module,
    spec: ElasticSpec,
    input_ids: Tensor,
    loss_mask: Tensor,
    budget_index: int,
    schedule: tuple[int, int],
    generator: torch.Generator,
    hard: bool | None = None,
) -> tuple[Tensor, Tensor, BudgetLossOut, RouterSample]:
    """(total loss, KD loss, budget loss, router sample) of one elastic micro-batch.

    ``model``: an :class:`ElasticStudent` or a DeepSpeed engine around one; ``teacher``: the frozen HybridLM
    or its ZeRO-3 engine. ``input_ids`` / ``loss_mask``: (batch, seq); ``budget_index``: the drawn budget in
    ``spec.budgets``; ``schedule``: the router schedule's global (step, total steps)
    (:meth:`RouterConfig.schedule_at`); ``generator``: the router noise; ``hard``: force or forbid a hard
    router sample (None: the router's coin). The total is ``kd + spec.alpha * budget loss``.
    """
    teacher_lm = getattr(teacher, "module", teacher)  # the HybridLM inside a DeepSpeed engine
    with torch.no_grad():
        teacher_hidden = teacher(input_ids, skip_logits=True).hidden  # (batch, seq, hidden)
    vec = spec.budgets.one_hot(spec.budgets.budgets[budget_index].name)
    head = teacher_lm.lm_head.weight
    with zero3.gathered([head]):
        kd, sample = model(
            input_ids, vec, *schedule, generator, hard, teacher_hidden, head, loss_mask, spec.kd_chunk_tokens
        )
    bl = spec.budget_loss(sample.probs, budget_index)
    return kd + spec.alpha * bl.loss.to(kd.dtype), kd, bl, sample


@torch.no_grad()
def router_report(router: BudgetRouter, spec: ElasticSpec, schedule: tuple[int, int]) -> dict[str, float]:
    """Noise-free router state per budget at the schedule's global (step, total steps): probabilities
    ``softmax(scale * logits / tau)`` per axis (averaged over layers for per-layer choices), the expected
    active / total parameters and their ratios to the stated targets."""
    out: dict[str, float] = {}
    tau, scale = router.tau(*schedule), router.scale(*schedule)
    for i, b in enumerate(spec.budgets.budgets):
        logits = router.logits(spec.budgets.one_hot(b.name))
        probs = {axis: torch.softmax(scale * z.float() / tau, dim=-1) for axis, z in logits.items()}
        for axis, p in probs.items():
            row = p.reshape(-1, p.shape[-1]).mean(0)
            for k, v in enumerate(row.tolist()):
                out[f"router/{b.name}/{axis}/p{k}"] = v
        bl = spec.budget_loss(probs, i)
        out[f"params/{b.name}/expected_active"] = float(bl.expected_active)
        out[f"params/{b.name}/expected_total"] = float(bl.expected_total)
        for kind, ratio in bl.ratios.items():
            out[f"params/{b.name}/{kind}_ratio"] = float(ratio)
    return out
