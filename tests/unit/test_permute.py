"""Ranking and permutation: a permuted model computes what the parent did, and its scores come out sorted."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from model.config import HybridConfig
from model.elastic.depth import depth_ranking, removal_mask
from model.elastic.importance import (
    AXES,
    ImportanceAccumulator,
    Rankings,
    calibrate,
    rank_model,
    rankings_from_accumulator,
)
from model.elastic.permute import apply_rankings, permute_attn_heads, permute_experts, permute_mamba_heads
from model.elastic.reap import expert_prune_mask
from model.hybrid import HybridLM
from tests.conftest import TINY

CFG = dict(TINY, pattern="M*ME-E*M", n_routed_experts=6, num_experts_per_tok=2, use_bias=True, mlp_bias=True)


def _parent(seed: int = 0, **changes) -> HybridLM:
    """A tiny parent whose every tensor is random, so no permutation bug can hide behind a constant."""
    m = HybridLM(HybridConfig(**{**CFG, **changes})).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(("bias", "A_log", "D")) or "gate.weight" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)  # make attention far from uniform, so a head mix-up shows
            if name.endswith("dt_bias"):
                p.add_(3.0)  # larger steps: the per-head A and D then matter
        for block in m.model.layers:
            if block.kind == "moe":
                block.mixer.gate.e_score_correction_bias.copy_(0.2 * torch.randn(6, generator=g))
    return m.eval()


def _batches(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 13), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def parent_and_rankings():
    m = _parent()
    return m, rank_model(m, _batches(), depth=True, progress=False)


@pytest.mark.parametrize("axes", [[a] for a in AXES] + [list(AXES)], ids=lambda a: "+".join(a))
def test_permuted_model_equals_parent(parent_and_rankings, axes):
    parent, rankings = parent_and_rankings
    permuted = apply_rankings(copy.deepcopy(parent), rankings, axes)
    ids = torch.randint(0, 64, (3, 17))
    changed = [k for k, v in permuted.state_dict().items() if not torch.equal(v, parent.state_dict()[k])]
    assert changed, "the ranking should have moved something"
    diff = (permuted(ids).logits - parent(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


def _random_rankings(rankings: Rankings, config: HybridConfig, seed: int = 0) -> Rankings:
    """The same structure with random orders (group-preserving where it must be)."""
    g = torch.Generator().manual_seed(seed)

    def shuffle(r, groups: int = 1):
        n = len(r.order)
        per = n // groups
        pieces = []
        for k in range(groups):
            local = torch.randperm(per, generator=g)
            if per > 1 and torch.equal(local, torch.arange(per)):  # never the identity: every tensor must move
                local = local.roll(1)
            pieces.append(local + k * per)
        order = torch.cat(pieces)
        return r.model_copy(update={"order": order.tolist()})

    out = rankings.model_copy(deep=True)
    out.hidden = shuffle(out.hidden)
    for lr in out.layers:
        if lr.mamba_heads:
            lr.mamba_heads = shuffle(lr.mamba_heads, config.n_groups)
        if lr.attn_heads:
            lr.attn_heads = shuffle(lr.attn_heads, config.num_key_value_heads)
        for name in ("mlp_ffn", "shared_ffn", "experts"):
            if getattr(lr, name):
                setattr(lr, name, shuffle(getattr(lr, name), config.n_group if name == "experts" else 1))
        if lr.moe_ffn:
            lr.moe_ffn = [shuffle(r) for r in lr.moe_ffn]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_orders_keep_the_function(parent_and_rankings, seed):
    """Any valid order (not only the calibrated one) leaves the function unchanged: every tensor is covered."""
    parent, rankings = parent_and_rankings
    shuffled = _random_rankings(rankings, parent.config, seed)
    permuted = apply_rankings(copy.deepcopy(parent), shuffled)
    ids = torch.randint(0, 64, (3, 17))
    state, before = permuted.state_dict(), parent.state_dict()
    unchanged = [k for k in state if torch.equal(state[k], before[k])]
    assert all(k.endswith(("k_proj.weight", "v_proj.weight")) for k in unchanged), unchanged
    assert (permuted(ids).logits - parent(ids).logits).abs().max() <= 1e-5


def test_permuted_model_equals_parent_with_cache(parent_and_rankings):
    parent, rankings = parent_and_rankings
    permuted = apply_rankings(copy.deepcopy(parent), rankings)
    ids = torch.randint(0, 64, (2, 9))
    out = permuted(ids[:, :5], use_cache=True)
    steps = [out.logits]
    for t in range(5, 9):
        out = permuted(ids[:, t : t + 1], cache=out.cache)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), parent(ids).logits, atol=1e-5, rtol=1e-5)


def _assert_descending(values, groups: int = 1, what: str = "") -> None:
    v = torch.tensor(values).reshape(groups, -1)
    slack = 1e-6 * v.abs().max().item()
    assert (v[:, :-1] >= v[:, 1:] - slack).all(), f"{what} not sorted: {v.tolist()}"


def test_scores_after_permutation_are_sorted(parent_and_rankings):
    parent, rankings = parent_and_rankings
    permuted = apply_rankings(copy.deepcopy(parent), rankings)
    again = rank_model(permuted, _batches(), progress=False)
    c = permuted.config
    _assert_descending(again.hidden.scores, what="hidden")
    for i, lr in enumerate(again.layers):
        if lr.mamba_heads:
            _assert_descending(lr.mamba_heads.scores, c.n_groups, f"mamba heads {i}")
            assert lr.mamba_heads.order == list(range(c.mamba_num_heads))
        if lr.attn_heads:
            _assert_descending(lr.attn_heads.scores, c.num_key_value_heads, f"attention heads {i}")
        for name in ("mlp_ffn", "shared_ffn", "experts"):
            if getattr(lr, name):
                _assert_descending(getattr(lr, name).scores, what=f"{name} {i}")
        for e, r in enumerate(lr.moe_ffn or []):
            _assert_descending(r.scores, what=f"expert {e} ffn {i}")
        # the recomputed scores are the original ones in storage order
        orig = rankings.layers[i]
        if lr.experts:
            expected = [orig.experts.scores[j] for j in orig.experts.order]
            torch.testing.assert_close(torch.tensor(lr.experts.scores), torch.tensor(expected), rtol=1e-5, atol=1e-7)


def test_accumulator_merge_equals_single_pass():
    m = _parent()
    batches = _batches(4)
    whole = calibrate(m, batches, progress=False)
    a = calibrate(m, batches[:1], progress=False)
    b = calibrate(m, batches[1:], progress=False)
    merged = ImportanceAccumulator.from_state_dict(a.state_dict()).merge(
        ImportanceAccumulator.from_state_dict(b.state_dict())
    )
    assert merged.num_tokens == whole.num_tokens == 4 * 2 * 13
    s1, s2 = whole.scores(), merged.scores()
    assert s1.keys() == s2.keys()
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], rtol=1e-10, atol=1e-12, msg=k)
    # rankings (and their JSON) are identical too
    r1 = rankings_from_accumulator(whole, m.config).to_dict()
    r2 = rankings_from_accumulator(merged, m.config).to_dict()
    assert r1["layers"][3]["experts"]["order"] == r2["layers"][3]["experts"]["order"]


def test_aggregation_rule_by_hand():
    acc = ImportanceAccumulator()
    a = torch.tensor([[[1.0, -2.0], [3.0, 0.0]], [[-1.0, 1.0], [1.0, 1.0]]])  # (batch 2, seq 2, ch 2)
    acc.update("x", a)
    # |a|.mean(seq) = [[2, 1], [1, 1]] -> squared, summed over batch = [5, 2]
    torch.testing.assert_close(acc.scores()["x"], torch.tensor([5.0, 2.0], dtype=torch.float64).sqrt())


def test_reap_matches_definition():
    """REAP of every expert, recomputed from the routing by brute force."""
    m = _parent()
    ids = _batches(1)[0]
    moe = m.model.layers[3].mixer
    seen = {}

    def grab(module, args):
        seen["x"] = args[0].reshape(-1, args[0].shape[-1])

    h = moe.register_forward_pre_hook(grab)
    acc = calibrate(m, [ids], axes=["experts"], progress=False)
    h.remove()
    x = seen["x"]
    idx, w = moe.gate(x)
    w = w / moe.gate.scaling
    want = torch.zeros(6, dtype=torch.float64)
    count = torch.zeros(6, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(idx.shape[1]):
            e = idx[t, slot].item()
            f = torch.relu(x[t] @ moe.experts.up_proj[e].t()).square() @ moe.experts.down_proj[e].t()
            want[e] += w[t, slot].item() * f.norm().item()
            count[e] += 1
    want = torch.where(count > 0, want / count.clamp_min(1), want)
    torch.testing.assert_close(acc.scores()["reap.3"], want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(acc.scores()["frequency.3"], count)


def test_rankings_json_round_trip(parent_and_rankings):
    _, rankings = parent_and_rankings
    text = json.dumps(rankings.to_dict())
    back = Rankings.from_dict(json.loads(text))
    assert back == rankings
    assert back.depth is not None and sorted(back.depth.order) == list(range(8))
    freq = rankings.with_expert_score("frequency")
    lr = freq.layers[3]
    assert lr.experts.scores == lr.expert_frequency
    both = rankings.with_expert_score("reap_sum").layers[3]
    assert both.experts.scores == pytest.approx(
        [a * b for a, b in zip(lr.expert_reap, lr.expert_frequency, strict=True)]
    )


def test_depth_ranking_is_greedy():
    m = _parent()
    batches = _batches(2)
    d = depth_ranking(m, batches, progress=False)
    n = len(m.model.layers)
    assert sorted(d.removal_order) == list(range(n))
    assert d.removal_order[0] == min(range(n), key=lambda j: (d.single_scores[j], j))
    # removing everything but the kept layers reproduces the recorded score of that step
    with torch.no_grad():
        full = [m(b).logits for b in batches]
    mask = removal_mask(n, d.removal_order[:3])
    with torch.no_grad():
        got = sum(
            float(((z - m(b, mask=mask).logits) ** 2).sum() / (z**2).sum()) for b, z in zip(batches, full, strict=True)
        )
    assert got / 2 == pytest.approx(d.removal_scores[2], rel=1e-6)
    assert d.kept_layers(2) == sorted(d.order[:2])


def test_grouped_orders_must_stay_in_their_group():
    m = _parent()
    with pytest.raises(ValueError, match="another group"):
        permute_mamba_heads(m.model.layers[0].mixer, torch.tensor([2, 1, 0, 3]))
    with pytest.raises(ValueError, match="another group"):
        permute_attn_heads(m.model.layers[1].mixer, torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="permutation"):
        permute_experts(m.model.layers[3].mixer, torch.tensor([0, 0, 1, 2, 3, 4]))


def test_grouped_expert_routing_permutes_within_groups():
    m = _parent(n_group=2, topk_group=1)
    rankings = rank_model(m, _batches(), axes=["experts", "moe_ffn"], progress=False)
    for lr in rankings.layers:
        if lr.experts:
            assert sorted(lr.experts.order[:3]) == [0, 1, 2]
    ids = torch.randint(0, 64, (2, 11))
    permuted = apply_rankings(copy.deepcopy(m), rankings)
    assert (permuted(ids).logits - m(ids).logits).abs().max() <= 1e-5


def test_expert_prune_mask_keeps_ranked_prefix(parent_and_rankings):
    parent, rankings = parent_and_rankings
    permuted = apply_rankings(copy.deepcopy(parent), rankings, ["experts"])
    mask = expert_prune_mask(permuted.config, 3)
    ids = torch.randint(0, 64, (2, 7))
    # keeping the top 3 after permutation == masking the original top-3 experts in place
    original_mask = expert_prune_mask(parent.config, 3)
    for i, lr in enumerate(rankings.layers):
        if lr.experts:
            keep = torch.zeros(6)
            keep[lr.experts.order[:3]] = 1
            original_mask.layers[i].experts = keep
    torch.testing.assert_close(permuted(ids, mask=mask).logits, parent(ids, mask=original_mask).logits)
    with pytest.raises(ValueError, match="keep"):
        expert_prune_mask(parent.config, 1)
