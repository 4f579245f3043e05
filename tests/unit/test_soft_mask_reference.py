"""Soft masks against slow, literal implementations of the method's formulas.

* Experts: the router of a soft expert mask selects on ``m * (s + b)`` and weights with ``m * s``
  renormalised after masking, where ``m = sum_k p_k * prefix_k``. The reference here loops over
  the candidates as the method states it: per candidate k, logits beyond its expert count set to
  -inf (sigmoid 0) and the bias zeroed there, both scaled by ``p_k``, and summed.
* Norms: a soft hidden (or Mamba head) mask is a mixture of sliced models, each normalising with
  ``eps * p_k`` and scaling by ``sqrt(p_k)``; the method uses ``eps * E[p]`` and the output scale
  ``E[sqrt p] = sum_k p_k sqrt(p_k)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.config import HybridConfig
from model.elastic import candidate_masks, extract, hard_mask, soft_mask
from model.elastic.arch import Architecture
from model.masks import NormFraction, active_fraction, grouped_prefix_mask, prefix_mask
from model.moe import TopKRouter
from model.norms import GatedGroupRMSNorm, RMSNorm
from tests.unit.test_elastic_masks import CFG, SPACE, TOL, ids, parent

# The demo parent's MoE shape: 8 experts, top-2, renormalised weights.
MOE = dict(
    vocab_size=32,
    hidden_size=16,
    pattern="E",
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    moe_shared_expert_intermediate_size=8,
    mamba_num_heads=4,
    mamba_head_dim=4,
    n_groups=1,
)


def reference_soft_routing(
    logits: torch.Tensor,
    bias: torch.Tensor,
    probs: list[float],
    choices: list[int],
    top_k: int,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The method's soft expert routing, one candidate at a time. logits (T, E) -> idx, weights (T, k)."""
    for_weights = torch.zeros_like(logits)
    for_selection = torch.zeros_like(logits)
    for p_k, keep in zip(probs, choices, strict=True):
        cut = logits.clone()
        cut[:, keep:] = -math.inf  # sigmoid(-inf) = 0: experts beyond the candidate's count score 0
        b = bias.clone()
        b[keep:] = 0.0
        scores = torch.sigmoid(cut) * p_k
        for_weights += scores
        for_selection += scores + b * p_k
    idx = for_selection.topk(top_k, dim=-1).indices
    w = for_weights.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling


def _router(seed: int, bias_std: float, weight_std: float = 0.3) -> TopKRouter:
    g = torch.Generator().manual_seed(seed)
    router = TopKRouter(HybridConfig(**MOE))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * weight_std)
        router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * bias_std)
    return router


def _sorted(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order each row's (expert, weight) pairs by expert index (top-k order is not part of the result)."""
    order = idx.argsort(-1)
    return idx.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize("probs", [[0.2, 0.5, 0.3], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.05, 0.05, 0.9]])
@torch.no_grad()
def test_soft_expert_routing_matches_the_reference(probs):
    router = _router(seed=3, bias_std=0.05)  # |bias| << sigmoid: every kept expert has s + b > 0
    x = torch.randn(400, MOE["hidden_size"], generator=torch.Generator().manual_seed(4))
    choices = [8, 6, 4]
    mask = torch.tensor(probs) @ candidate_masks(HybridConfig(**MOE), "experts", choices)
    idx, w = router(x, mask)
    logits = x @ router.weight.t()
    ref_idx, ref_w = reference_soft_routing(logits, router.e_score_correction_bias, probs, choices, 2)
    idx, w = _sorted(idx, w)
    ref_idx, ref_w = _sorted(ref_idx, ref_w)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)


@torch.no_grad()
def test_soft_mask_sends_tail_experts_their_reference_share():
    """With p = (0.2, 0.5, 0.3) over (8, 6, 4) experts, experts 6 and 7 (mask 0.2) keep a real share of the
    tokens: their selection score is scaled by 0.2, not pushed down by log(0.2). Counted from the reference."""
    router = _router(seed=5, bias_std=0.05, weight_std=1.0)  # confident routing, as in a trained MoE
    x = torch.randn(2000, MOE["hidden_size"], generator=torch.Generator().manual_seed(6))
    probs, choices = [0.2, 0.5, 0.3], [8, 6, 4]
    mask = torch.tensor(probs) @ candidate_masks(HybridConfig(**MOE), "experts", choices)
    idx, _ = router(x, mask)
    ref_idx, _ = reference_soft_routing(x @ router.weight.t(), router.e_score_correction_bias, probs, choices, 2)
    share = (idx >= 6).float().mean().item()
    assert share == (ref_idx >= 6).float().mean().item()
    assert share > 0.0


@torch.no_grad()
def test_hard_mask_never_selects_a_masked_expert_even_with_negative_scores():
    """A strongly negative selection bias makes some kept experts' ``s + b`` negative; masked experts (score 0
    under ``m * (s + b)``) must still never be chosen, so the masked router is the sliced model's router."""
    router = _router(seed=7, bias_std=2.0)
    assert (router.e_score_correction_bias[:4] < -1.0).any()
    x = torch.randn(300, MOE["hidden_size"], generator=torch.Generator().manual_seed(8))
    idx, w = router(x, prefix_mask(8, 4))
    assert int(idx.max()) < 4
    sliced = torch.sigmoid(x @ router.weight[:4].t())
    ref_idx = (sliced + router.e_score_correction_bias[:4]).topk(2, dim=-1).indices
    ref_w = sliced.gather(1, ref_idx)
    ref_w = ref_w / (ref_w.sum(-1, keepdim=True) + 1e-20)
    idx, w = _sorted(idx, w)
    ref_idx, ref_w = _sorted(ref_idx, ref_w)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, atol=1e-7, rtol=0)


# ---------------------------------------------------------------------- norms
def test_norm_fraction_of_hard_and_soft_masks():
    hard = active_fraction(prefix_mask(8, 6))
    assert hard.fraction.item() == pytest.approx(0.75, abs=1e-7)
    assert hard.scale.item() == pytest.approx(math.sqrt(0.75), abs=1e-7)
    # p = (0.2, 0.5, 0.3) over keeping (8, 6, 4) of 8: E[p] = 0.2 + 0.375 + 0.15 = 0.725,
    # E[sqrt p] = 0.2 * 1 + 0.5 * sqrt(0.75) + 0.3 * sqrt(0.5) = 0.84514...
    soft = torch.tensor([0.2, 0.5, 0.3]) @ torch.stack([prefix_mask(8, k) for k in (8, 6, 4)])
    nf = active_fraction(soft)
    assert nf.fraction.item() == pytest.approx(0.725, abs=1e-6)
    assert nf.scale.item() == pytest.approx(0.2 + 0.5 * math.sqrt(0.75) + 0.3 * math.sqrt(0.5), abs=1e-6)
    # grouped (Mamba heads): 2 groups of 4 heads, keep 3 or 1 per group with p = (0.6, 0.4)
    grouped = 0.6 * grouped_prefix_mask(8, 2, 3) + 0.4 * grouped_prefix_mask(8, 2, 1)
    g = active_fraction(grouped, groups=2)
    assert g.fraction.item() == pytest.approx(0.6 * 0.75 + 0.4 * 0.25, abs=1e-6)
    assert g.scale.item() == pytest.approx(0.6 * math.sqrt(0.75) + 0.4 * math.sqrt(0.25), abs=1e-6)


def test_norm_fraction_is_differentiable_in_the_probabilities():
    logits = torch.tensor([0.3, -0.2, 0.1], requires_grad=True)
    p = torch.softmax(logits, -1)
    nf = active_fraction(p @ torch.stack([prefix_mask(8, k) for k in (8, 6, 4)]))
    nf.scale.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@torch.no_grad()
def test_soft_norms_use_expected_sqrt_fraction():
    """RMSNorm and the gated group norm under a soft mask: ``E[sqrt p] * x / sqrt(mean(x^2) + eps * E[p])``."""
    g = torch.Generator().manual_seed(9)
    probs, keeps = [0.2, 0.5, 0.3], [16, 12, 4]
    mask = torch.tensor(probs) @ torch.stack([prefix_mask(16, k) for k in keeps])
    x = torch.randn(5, 16, generator=g) * mask
    norm = RMSNorm(16, eps=0.5)  # a large eps makes the eps term visible
    norm.weight.data = torch.randn(16, generator=g)
    e_p = sum(p * k / 16 for p, k in zip(probs, keeps, strict=True))
    e_sqrt = sum(p * math.sqrt(k / 16) for p, k in zip(probs, keeps, strict=True))
    expected = norm.weight * x * e_sqrt / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.5 * e_p)
    torch.testing.assert_close(norm(x, active_fraction(mask)), expected, atol=1e-6, rtol=1e-6)
    # a plain tensor is a 0/1 mask's fraction: scale sqrt(p)
    plain = norm(x, torch.tensor(0.75))
    torch.testing.assert_close(plain, norm(x, NormFraction(torch.tensor(0.75), torch.tensor(0.75).sqrt())))

    gated = GatedGroupRMSNorm(16, group_size=8, eps=0.5)
    heads = 0.6 * grouped_prefix_mask(4, 2, 2) + 0.4 * grouped_prefix_mask(4, 2, 1)  # 4 heads of 4 channels
    y = torch.randn(3, 16, generator=g) * heads.repeat_interleave(4)
    z = torch.randn(3, 16, generator=g)
    h = (y * torch.nn.functional.silu(z)).view(3, 2, 8)
    e_p, e_sqrt = 0.6 * 1.0 + 0.4 * 0.5, 0.6 * 1.0 + 0.4 * math.sqrt(0.5)
    ref = (h * e_sqrt / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 0.5 * e_p)).view(3, 16)
    torch.testing.assert_close(gated(y, z, active_fraction(heads, groups=2)), ref, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_masked_equals_sliced_still_holds_with_expert_and_hidden_masks():
    model = parent()
    arch = Architecture(hidden=24, mamba_heads=4, experts=4, moe_ffn=16)
    x = ids()
    torch.testing.assert_close(
        model(x, mask=hard_mask(model.config, arch)).logits, extract(model, arch)(x).logits, atol=TOL, rtol=0
    )
    # a soft mask with all its weight on one candidate is that candidate's hard mask
    one_hot = {"hidden": torch.tensor([0.0, 0.0, 1.0]), "experts": torch.tensor([0.0, 1.0, 0.0])}
    soft = soft_mask(model.config, one_hot, SPACE)
    arch2 = Architecture(hidden=24, experts=4)
    torch.testing.assert_close(model(x, mask=soft).logits, extract(model, arch2)(x).logits, atol=TOL, rtol=0)
    assert CFG["n_routed_experts"] == 6
