"""Training losses of elastic distillation: token-level KD and the router's budget loss.

``kd_loss`` is the forward ``KL(teacher || student)`` at temperature 1, log-softmaxes in float32,
mean over the masked tokens. ``budget_loss`` plugs the router's expected sizes into the analytic
parameter counts and penalises ``|N / (b * N_full) - 1|`` per stated target, zero inside the dead
zone; the full budget has no dead zone and a pinning term towards the largest candidates.

Design notes: docs/elastic.md ("Losses").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from model.config import HybridConfig
from model.elastic.budgets import Budget
from model.elastic.params import count_params, expected_params, expected_sizes
from model.elastic.space import ElasticSpace


class BudgetLossOut(NamedTuple):
    """``loss`` () differentiable; ``expected_active`` / ``expected_total`` () float64 parameter counts.

    ``ratios[kind]`` () is ``expected_kind / (target_kind * N_full_kind)`` (1.0 = on target) for every
    stated target, ``ratio`` the one of the budget's :attr:`~model.elastic.budgets.Budget.fraction`
    (its active target, else its total target), and ``pin`` () the pinning term (0 for budgets
    other than the full one); all are detached, for logging.
    """

    loss: Tensor
    expected_active: Tensor
    expected_total: Tensor
    ratio: Tensor
    pin: Tensor
    ratios: dict[str, Tensor]


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """Forward KL(teacher || student) per token at temperature 1, averaged over masked tokens.

    student_logits, teacher_logits: (..., vocab), e.g. (batch, seq, vocab); loss_mask: (...)
    bool or 0/1 (None = every token). Returns a float32 scalar.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"kd_loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must have the same shape"
        )
    log_s = F.log_softmax(student_logits.float(), dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    p_t = log_t.exp()
    # xlogy-style: where p_t == 0 the term is 0 even if log_t is -inf
    per_token = torch.where(p_t > 0, p_t * (log_t - log_s), torch.zeros_like(p_t)).sum(-1)  # (...)
    if loss_mask is None:
        return per_token.mean()
    if loss_mask.shape != per_token.shape:
        raise ValueError(
            f"kd_loss: loss_mask has shape {tuple(loss_mask.shape)}; expected {tuple(per_token.shape)} "
            "(the logits' shape without the vocabulary dimension)"
        )
    m = loss_mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1.0)


def pin_loss(probs: dict[str, Tensor]) -> Tensor:
    """``sum_axes MSE(p_axis, onehot(0))``: pulls every axis to its largest (first) candidate. Shape ()."""
    terms = []
    for p in probs.values():
        target = torch.zeros_like(p)
        target[..., 0] = 1.0
        terms.append(F.mse_loss(p, target))
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()


def budget_loss(
    config: HybridConfig,
    space: ElasticSpace,
    probs: dict[str, Tensor],
    target: Budget | float,
    is_full: bool,
    dead_zone: float = 0.05,
    pin_weight: float = 10.0,
    depth_order: Sequence[int] | None = None,
    full_active: int | None = None,
    full_total: int | None = None,
) -> BudgetLossOut:
    """Budget loss of one router sample for the budget ``target``.

    ``target``: a :class:`~model.elastic.budgets.Budget` (one term per stated target) or a float,
    an active-parameter fraction. ``probs[axis]``: (n_choices,) or (n_layers_of_kind, n_choices)
    distributions over the space's candidates (a :class:`~model.elastic.router.RouterSample`'s
    ``probs``). ``full_active`` / ``full_total``: the parent's counts, computed from ``config``
    when None (pass them to skip the recount). ``is_full``: the full budget (no dead zone, pinned).
    """
    if isinstance(target, Budget):
        targets = target.targets
        primary = "active" if target.active is not None else "total"
    else:
        if not 0.0 < target <= 1.0:
            raise ValueError(f"budget_loss: the target fraction must be in (0, 1], got {target}")
        targets, primary = {"active": float(target)}, "active"
    if not probs:
        raise ValueError("budget_loss: no probabilities (the space has no elastic axis the router covers)")
    dtype = next(iter(probs.values())).dtype
    if full_active is None or full_total is None:
        full = count_params(config)
        full_active = full.active if full_active is None else full_active
        full_total = full.total if full_total is None else full_total
    n_full = {"active": full_active, "total": full_total}
    # expected_sizes gives () per global axis and (n_layers_of_kind,) per per-layer axis
    expected = expected_sizes(space, {axis: p.double() for axis, p in probs.items()})
    total, active = expected_params(config, expected, depth_order)
    counts = {"active": active, "total": total}
    loss = torch.zeros((), dtype=torch.float64, device=active.device)
    ratios = {}
    for kind, fraction in targets.items():
        ratio = counts[kind] / (fraction * n_full[kind])
        deviation = (ratio - 1.0).abs()
        if not is_full:  # the full budget has no dead zone: it must be the parent
            deviation = torch.where(deviation < dead_zone, torch.zeros_like(deviation), deviation)
        loss = loss + deviation
        ratios[kind] = ratio.detach()
    pin = pin_loss(probs).double() if is_full else torch.zeros((), dtype=torch.float64, device=loss.device)
    loss = loss + pin_weight * pin
    return BudgetLossOut(
        loss=loss.to(dtype),
        expected_active=active,
        expected_total=total,
        ratio=ratios[primary],
        pin=pin.detach(),
        ratios=ratios,
    )
