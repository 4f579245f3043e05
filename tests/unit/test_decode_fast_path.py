"""The decode plan (:mod:`model.decode`) against the reference forward of the layers.

Every comparison runs both on copies of the same cache and asserts max |difference| <= 1e-5 (float32)
on the logits of every step and on the caches they leave behind; bfloat16 models are held to bfloat16's
rounding (``BF16_ATOL``, on logits of magnitude below 1).
"""

from __future__ import annotations

import pytest
import torch

from model.cache import HybridCache, KVCache, MambaCache, clone_cache, concat_caches, empty_cache
from model.config import HybridConfig
from model.decode import DecodePlan, decode_plan
from model.decode.budget_view import StridedExperts, budget_model
from model.decode.ops import linear, rms_norm
from model.elastic import Architecture
from model.hybrid import HybridLM
from model.masks import ModelMask, prefix_mask
from model.moe import Experts, TopKRouter, dense_experts, expert_loop, expert_path, route, router_scores
from tests.conftest import TINY

ATOL = 1e-5
BF16_ATOL = 2e-2

VARIANTS = {
    "tiny": {},
    "one_group_biases": dict(n_groups=1, use_bias=True, mlp_bias=True, routed_scaling_factor=2.5),
    "no_conv_bias_mha": dict(use_conv_bias=False, num_key_value_heads=4, norm_topk_prob=False),
    "group_routing": dict(n_routed_experts=8, n_group=2, topk_group=1, residual_in_fp32=True),
    "top1_of_8": dict(n_routed_experts=8, num_experts_per_tok=1, pattern="ME*E"),
    "no_shared_expert_large_state": dict(n_shared_experts=0, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32),
}


def _model(overrides: dict, seed: int = 0) -> HybridLM:
    m = HybridLM(HybridConfig(**{**TINY, **overrides})).init_weights(seed)
    with torch.no_grad():  # make the selection bias, the biases and the D skip matter
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in m.named_parameters():
            if name.endswith(".bias") or name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for block in m.model.layers:
            if block.kind == "moe":
                bias = block.mixer.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.3)
    return m.eval()


def _max_diff_caches(a: HybridCache, b: HybridCache) -> float:
    worst = 0.0
    for x, y in zip(a.layers, b.layers, strict=True):
        if isinstance(x, KVCache):
            assert x.length == y.length
            worst = max(worst, (x.k[:, :, : x.length] - y.k[:, :, : y.length]).float().abs().max().item())
            worst = max(worst, (x.v[:, :, : x.length] - y.v[:, :, : y.length]).float().abs().max().item())
        elif isinstance(x, MambaCache):
            assert x.ssm.dtype == y.ssm.dtype
            conv, ssm = (x.conv - y.conv).float(), (x.ssm - y.ssm).float()
            worst = max(worst, conv.abs().max().item(), ssm.abs().max().item())
    assert a.seen_tokens == b.seen_tokens
    return worst


@torch.no_grad()
def _compare(m: HybridLM, ids: torch.Tensor, prefill: int, atol: float = ATOL) -> None:
    """Decode ids[:, prefill:] token by token with the plan and with the reference forward from one prefill;
    logits and caches must agree."""
    plan = DecodePlan(m)
    out = m(ids[:, :prefill], use_cache=True)
    caches = {True: out.cache, False: clone_cache(out.cache)}
    for t in range(prefill, ids.shape[1]):
        tok = ids[:, t : t + 1]
        assert DecodePlan.accepts(tok, caches[True])
        fast, ref = plan(tok, caches[True]), m(tok, cache=caches[False])
        caches = {True: fast.cache, False: ref.cache}
        assert fast.logits.shape == ref.logits.shape == (ids.shape[0], 1, m.config.vocab_size)
        assert fast.logits.dtype == ref.logits.dtype
        assert (fast.logits.float() - ref.logits.float()).abs().max().item() <= atol
        assert _max_diff_caches(caches[True], caches[False]) <= atol


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("batch", [1, 3])
def test_plan_equals_the_reference_forward(variant, batch):
    m = _model(VARIANTS[variant])
    ids = torch.randint(0, 64, (batch, 14), generator=torch.Generator().manual_seed(batch))
    _compare(m, ids, prefill=5)


def test_plan_rows_on_the_grouped_expert_path(monkeypatch):
    """Several rows whose experts take the grouped path (not the dense one) through the plan."""
    import model.moe as moe_module

    monkeypatch.setattr(moe_module, "_DENSE_MAX_WASTED_MACS", 0)
    assert expert_path(3, 2, 4, 16, 32) == "grouped"
    _compare(_model({}), torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(4)), prefill=4)


@pytest.mark.parametrize("variant", ["tiny", "one_group_biases", "group_routing"])
@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_plan_equals_the_reference_forward(variant, batch):
    """Same comparison in bfloat16 (``group_routing`` also keeps a float32 residual stream)."""
    m = _model(VARIANTS[variant]).to(torch.bfloat16)
    ids = torch.randint(0, 64, (batch, 12), generator=torch.Generator().manual_seed(batch))
    _compare(m, ids, prefill=5, atol=BF16_ATOL)


@torch.no_grad()
def _decode_pieces(m: HybridLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (batch, seq, vocab): the prefill of ids[:, :prefill], then one plan step per later token."""
    plan = DecodePlan(m)
    out = m(ids[:, :prefill], use_cache=True)
    pieces, cache = [out.logits], out.cache
    for t in range(prefill, ids.shape[1]):
        out = plan(ids[:, t : t + 1], cache)
        pieces.append(out.logits)
    return torch.cat(pieces, 1)


def test_plan_decode_equals_full_forward():
    m = _model({})
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        full = m(ids).logits
    assert (_decode_pieces(m, ids, 4) - full).abs().max().item() <= ATOL


@pytest.mark.parametrize("overrides", [{}, dict(residual_in_fp32=True), dict(n_groups=1, use_bias=True)])
def test_bf16_decode_equals_full_forward(overrides):
    """A bfloat16 model: prefill + plan steps against one forward over the whole sequence, both against
    the float32 forward of the same (rounded) weights."""
    m = _model(overrides).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = m(ids).logits
        exact = _model(overrides).to(torch.bfloat16).float()(ids).logits  # the bf16 weights, float32 compute
    decoded = _decode_pieces(m, ids, 4)
    assert decoded.dtype == full.dtype == torch.bfloat16
    assert exact.abs().max().item() > 0.1  # logits of order 1e-1: the tolerance is a few bf16 steps
    assert (decoded.float() - full.float()).abs().max().item() <= BF16_ATOL
    assert (decoded.float() - exact).abs().max().item() <= BF16_ATOL
    assert (full.float() - exact).abs().max().item() <= BF16_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_budget_models_and_generation_take_the_plan(dtype):
    """A budget model's single-token steps and generation's steps run the plan: no block (the reference
    layer) is called after the prefill, in float32 and bfloat16."""
    from model.generate import RowStart, SamplingParams, decode_rows

    parent = _model({"n_routed_experts": 8}).to(dtype)
    budget = budget_model(parent, Architecture(hidden=24, mamba_heads=2, experts=6))
    calls: list[str] = []
    for m in (parent, budget):
        for block in m.model.layers:
            block.register_forward_pre_hook(lambda mod, args: calls.append(mod.kind))
    ids = torch.randint(0, 64, (2, 6))
    out = budget(ids[:, :5], use_cache=True)
    assert calls  # the prefill runs the blocks
    calls.clear()
    step = budget(ids[:, 5:], cache=out.cache)
    assert calls == [] and step.logits.dtype == dtype
    assert budget.decode_plan() is budget.decode_plan()  # built once
    for model in (parent, budget):
        decode_rows(model, [RowStart([1, 2, 3])], SamplingParams(max_new_tokens=4))
        assert calls == ["mamba", "attention", "mamba", "moe", "mlp", "moe"]  # the prefill only
        calls.clear()


@torch.no_grad()
def test_plan_past_kv_capacity_and_from_an_empty_cache():
    """Steps that outgrow the preallocated KV buffer, and a first token decoded into an empty cache."""
    m = _model({})
    plan = DecodePlan(m)
    ids = torch.randint(0, 64, (1, 80))
    full = m(ids).logits
    cache = empty_cache(len(m.model.layers))
    pieces = [plan(ids[:, t : t + 1], cache).logits for t in range(ids.shape[1])]
    assert (torch.cat(pieces, 1) - full).abs().max().item() <= ATOL


@torch.no_grad()
def test_plan_leaves_foreign_states_intact():
    """The plan never writes a Mamba state it is given (each step returns new ones)."""
    m = _model({})
    plan = DecodePlan(m)
    ids = torch.randint(0, 64, (1, 10))
    full = m(ids).logits
    own = m(ids[:, :6], use_cache=True).cache
    foreign = HybridCache(
        [MambaCache(c.conv.clone(), c.ssm.clone()) if isinstance(c, MambaCache) else c for c in clone_cache(own).layers]
    )
    foreign.seen_tokens = own.seen_tokens
    kept = [c.ssm.clone() for c in foreign.layers if isinstance(c, MambaCache)]
    originals = [c for c in foreign.layers if isinstance(c, MambaCache)]
    pieces = [plan(ids[:, t : t + 1], foreign).logits for t in range(6, 10)]
    assert (torch.cat(pieces, 1) - full[:, 6:]).abs().max().item() <= ATOL
    assert all(torch.equal(c.ssm, k) for c, k in zip(originals, kept, strict=True))


def test_masks_and_autograd_are_not_plan_steps():
    """A mask, autograd, several tokens or no cache: the plan does not apply; generation with a mask and a
    budget model under a budget mask take the reference forward."""
    m = _model({})
    ids = torch.randint(0, 64, (2, 9))
    cache = m(ids[:, :4], use_cache=True).cache
    mask = ModelMask(hidden=prefix_mask(m.config.hidden_size, 24))
    assert not DecodePlan.accepts(ids[:, 4:5], cache)  # autograd on
    with torch.no_grad():
        assert DecodePlan.accepts(ids[:, 4:5], cache)
        assert not DecodePlan.accepts(ids[:, 4:5], cache, mask)
        assert not DecodePlan.accepts(ids[:, 4:6], cache)
        assert not DecodePlan.accepts(ids[:, 4:5], None)
        assert not DecodePlan.accepts(ids[:, 4:5], cache, skip_logits=True)
    masked = budget_model(m, Architecture(hidden=24), prefer="masked")
    assert decode_plan(masked) is None and isinstance(decode_plan(m), DecodePlan)
    step = m(ids[:, 4:5], cache=cache)
    assert step.logits.requires_grad  # autograd on: the reference forward, differentiable


def _scale_mamba_weights(m: HybridLM, replace: bool) -> None:
    """Change every Mamba layer's A_log, D, dt_bias and conv taps: in place, or by replacing their data."""
    with torch.no_grad():
        for block in m.model.layers:
            if block.kind == "mamba":
                mixer = block.mixer
                for p, new in (
                    (mixer.A_log, mixer.A_log + 0.5),
                    (mixer.D, mixer.D * -2.0),
                    (mixer.dt_bias, mixer.dt_bias - 0.3),
                    (mixer.conv1d.weight, mixer.conv1d.weight * 1.5),
                ):
                    if replace:
                        p.data = new
                    else:
                        p.copy_(new)


def _one_step_diff(m: HybridLM, plan: DecodePlan, ids: torch.Tensor) -> float:
    out = m(ids[:, :4], use_cache=True)
    cache = clone_cache(out.cache)
    return (plan(ids[:, 4:5], out.cache).logits - m(ids[:, 4:5], cache=cache).logits).abs().max().item()


@torch.no_grad()
def test_plan_derives_again_when_a_weight_is_replaced():
    """A derived tensor's source replaced after the plan was built (``.data =``, as ``.to()`` does) is
    noticed by its data pointer: the plan follows the new weights."""
    m = _model({})
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    plan = DecodePlan(m)
    assert _one_step_diff(m, plan, ids) <= ATOL
    _scale_mamba_weights(m, replace=True)
    assert not plan.stale()
    assert _one_step_diff(m, plan, ids) <= ATOL


@torch.no_grad()
def test_plan_after_in_place_weight_updates_is_stale():
    """A plan is built for fixed weights: after an in-place update it says it is stale and computes the old
    weights' Mamba steps; a new plan computes the new ones."""
    m = _model({})
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    plan = DecodePlan(m)
    assert not plan.stale()
    _scale_mamba_weights(m, replace=False)
    assert plan.stale()
    assert _one_step_diff(m, plan, ids) > 1e-3  # the derived tensors are the old weights'
    fresh = DecodePlan(m)
    assert not fresh.stale()
    assert _one_step_diff(m, fresh, ids) <= ATOL


def _mamba_states(cache: HybridCache) -> list[torch.Tensor]:
    return [c.ssm for c in cache.layers if isinstance(c, MambaCache)]


@torch.no_grad()
def test_copies_of_a_plan_cache_are_never_written():
    """Caches copied from one the plan steps (clone_cache, select, concat_caches) keep their values while the
    original steps on (its KV buffers are written in place), and step themselves like the original did."""
    m = _model({})
    plan = DecodePlan(m)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))
    cache = m(ids[:, :5], use_cache=True).cache
    for t in (5, 6):
        plan(ids[:, t : t + 1], cache)
    copies = [clone_cache(cache), cache.select(torch.tensor([0, 1])), concat_caches([cache])]
    saved = [[s.clone() for s in _mamba_states(c)] for c in copies]
    branch = clone_cache(cache)
    after = [plan(ids[:, t : t + 1], cache).logits for t in range(7, 10)]
    for c, values in zip(copies, saved, strict=True):
        assert all(torch.equal(s, v) for s, v in zip(_mamba_states(c), values, strict=True))
    again = [plan(ids[:, t : t + 1], branch).logits for t in range(7, 10)]  # the branch decodes the same
    assert all(torch.equal(a, b) for a, b in zip(after, again, strict=True))


def test_attention_with_grouped_kv_heads():
    """The attention step with several, one and as many KV heads as query heads."""
    for overrides in ({}, dict(num_key_value_heads=4), dict(num_key_value_heads=1)):
        m = _model(overrides)
        _compare(m, torch.randint(0, 64, (2, 9)), prefill=4)


@torch.no_grad()
def test_plan_under_inference_mode():
    m = _model({})
    ids = torch.randint(0, 64, (1, 9))
    ref = m(ids).logits
    plan = DecodePlan(m)
    with torch.inference_mode():
        out = m(ids[:, :4], use_cache=True)
        pieces = [out.logits] + [plan(ids[:, t : t + 1], out.cache).logits for t in range(4, 9)]
    assert (torch.cat(pieces, 1) - ref).abs().max().item() <= ATOL


def test_rms_norm_and_linear_helpers():
    x, w = torch.randn(1, 40), torch.randn(40)
    ref = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert (rms_norm(x, w, 1e-5) - ref).abs().max().item() <= ATOL
    assert (rms_norm(x, None, 1e-5) - ref / w).abs().max().item() <= 1e-4
    xs = torch.randn(3, 40)
    ref = w * xs / torch.sqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert (rms_norm(xs, w, 1e-5) - ref).abs().max().item() <= ATOL
    assert (rms_norm(xs.bfloat16(), w.bfloat16(), 1e-5).float() - ref).abs().max().item() <= BF16_ATOL * 4
    groups = torch.randn(3, 2, 20)  # any rank (the Mamba step's gated norm per group): over the last dim
    ref = groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert (rms_norm(groups, None, 1e-5) - ref).abs().max().item() <= ATOL
    lin = torch.nn.Linear(40, 7, bias=False)
    res = torch.randn(3, 7)
    with torch.no_grad():
        assert (linear(lin, xs, res) - (lin(xs) + res)).abs().max().item() <= ATOL
        lin_b = torch.nn.Linear(40, 7)
        assert (linear(lin_b, xs, res) - (lin_b(xs) + res)).abs().max().item() <= ATOL
        half = torch.nn.Linear(40, 7).bfloat16()  # a bf16 projection onto a float32 residual: promoted
        got = linear(half, xs.bfloat16(), res)
        assert got.dtype == torch.float32
        assert (got - (half(xs.bfloat16()).float() + res)).abs().max().item() == 0
        seen = []
        handle = lin.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
        linear(lin, xs)
        handle.remove()
        assert seen == [(3, 7)]  # a hooked module is called, not bypassed


# ---------------------------------------------------------------------- MoE paths
def _experts(e: int = 8, f: int = 12, h: int = 16, seed: int = 0) -> Experts:
    cfg = HybridConfig(**{**TINY, "n_routed_experts": e, "moe_intermediate_size": f, "hidden_size": h})
    ex = Experts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.up_proj.copy_(torch.randn(ex.up_proj.shape, generator=g) * 0.3)  # outputs of order 1
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.3)
    return ex


def _routing(t: int, k: int, e: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return idx, torch.rand(t, k, generator=g)


def test_expert_loop_sums_weighted_expert_outputs():
    """Expert e multiplies by e + 1: row 0 = 0.5 * 1 * 1 + 0.25 * 2 * 1, row 1 = 1 * 2 * 2 + 2 * 1 * 2; the
    stacked form (one call over all slices) and the observer's norms agree."""
    x = torch.tensor([[1.0], [2.0]])
    idx = torch.tensor([[0, 1], [1, 0]])
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    seen: list[torch.Tensor] = []
    out = expert_loop(x, idx, w, 3, lambda rows, e: rows * (e + 1), lambda i, ww, n: seen.append(n))
    assert out.tolist() == [[1.0], [8.0]]
    assert seen[0].tolist() == [[1.0, 2.0], [4.0, 2.0]]
    stacked = lambda rows, counts: rows * torch.repeat_interleave(torch.arange(1.0, 4.0), counts)[:, None]  # noqa: E731
    assert expert_loop(x, idx, w, 3, None, None, stacked).tolist() == [[1.0], [8.0]]


@pytest.mark.parametrize("t", [1, 2, 3])
def test_sparse_expert_path_equals_dense_and_grouped(t):
    ex = _experts()
    k, e = 2, 8
    assert expert_path(t, k, e, 1024, 1024) == "sparse"
    x = torch.randn(t, 16)
    idx, w = _routing(t, k, e, seed=t)
    ffn = torch.rand(12)
    for mask in (None, ffn):
        norms: list[torch.Tensor] = []
        observe = lambda i, ww, n, norms=norms: norms.append(n)  # noqa: E731
        sparse = ex._sparse(x, idx, w, mask, observe)
        dense = ex._dense(x, idx, w, mask, observe)
        grouped = ex._grouped(x, idx, w, mask, None)
        assert (sparse - dense).abs().max().item() <= ATOL
        assert (sparse - grouped).abs().max().item() <= ATOL
        assert (norms[0] - norms[1]).abs().max().item() <= 1e-4
    # with autograd on, gradients reach the routing weights and the expert weights
    w.requires_grad_(True)
    ex._sparse(x, idx, w, None, None).sum().backward()
    assert w.grad is not None and ex.up_proj.grad is not None


def test_expert_path_choice():
    # large experts: the sparse loop while assignments are fewer than experts, then dense, then grouped
    assert expert_path(1, 2, 8, 1024, 1024) == "sparse"
    assert expert_path(3, 2, 8, 1024, 1024) == "sparse"
    assert expert_path(4, 2, 8, 64, 1024) == "dense"  # 8 assignments on 8 experts, little waste
    assert expert_path(16, 2, 8, 1024, 1024) == "grouped"  # too much arithmetic wasted
    # experts small enough to read in full: dense even for one token
    assert expert_path(1, 2, 8, 64, 128) == "dense"
    assert expert_path(2, 2, 8, 64, 128) == "dense"
    assert expert_path(1, 2, 8, 64, 129) == "sparse"
    assert expert_path(1024, 2, 8, 64, 128) == "grouped"


@pytest.mark.parametrize("inputs_major", [False, True])
@pytest.mark.parametrize("t", [1, 2, 16])
def test_dense_expert_path_with_either_down_layout(inputs_major, t):
    """The dense path's one-GEMM down projection (inputs-major ``down_proj``) and its batched one agree
    with the grouped path, with and without an FFN mask and an observer."""
    ex = _experts()
    if inputs_major:
        with torch.no_grad():
            ex.down_proj.data = ex.down_proj.detach().transpose(1, 2).contiguous().transpose(1, 2)
    x = torch.randn(t, 16)
    idx, w = _routing(t, 2, 8, seed=t)
    ffn = torch.rand(12)
    for mask in (None, ffn):
        norms: list[torch.Tensor] = []
        observe = lambda i, ww, n, norms=norms: norms.append(n)  # noqa: E731
        ref = ex._grouped(x, idx, w, mask, observe)
        for obs in (None, observe):
            assert (ex._dense(x, idx, w, mask, obs) - ref).abs().max().item() <= ATOL
        assert (norms[0] - norms[1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("renormalise", [True, False])
def test_the_tensor_routing_and_dense_experts_equal_the_modules(renormalise):
    """:func:`~model.moe.route` of :func:`~model.moe.router_scores` is the router without masks (the same experts
    in the same order; unsorted, the same set and weights), on one token's (E,) scores too; and
    :func:`~model.moe.dense_experts` is the residual plus the grouped path, with either down layout and with a
    residual of the experts' dtype (added by the GEMM) or a float32 one (promoted)."""
    router = TopKRouter(HybridConfig(**{**TINY, "n_routed_experts": 8, "norm_topk_prob": renormalise}))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
        router.scaling = 2.5
    x = torch.randn(5, TINY["hidden_size"], generator=g)
    idx, w = router(x)
    scores = router_scores(x, router.weight)
    args = (router.e_score_correction_bias, router.top_k, renormalise, router.scaling)
    got_idx, got_w = route(scores, *args)
    assert torch.equal(got_idx, idx) and torch.equal(got_w, w)
    any_idx, any_w = route(scores, *args, in_order=False)
    order = any_idx.argsort(-1)  # the router sorts by score; compare the sets by expert index
    assert torch.equal(any_idx.gather(1, order), idx.sort(-1).values)
    assert torch.equal(any_w.gather(1, order), w.gather(1, idx.argsort(-1)))
    one_idx, one_w = route(scores[0], *args)
    assert torch.equal(one_idx, idx[0]) and torch.equal(one_w, w[0])

    ex = _experts()
    h = torch.randn(3, 16, generator=g)
    idx, w = _routing(3, 2, 8, seed=3)
    for inputs_major in (False, True):
        if inputs_major:
            with torch.no_grad():
                ex.down_proj.data = ex.down_proj.detach().transpose(1, 2).contiguous().transpose(1, 2)
        up, down = ex.up_proj.detach(), ex.down_proj.detach()
        ref = ex._grouped(h, idx, w, None, None).detach()
        assert (dense_experts(h, idx, w, up, down) - ref).abs().max().item() <= ATOL
        base = torch.randn(3, 16, generator=g)
        assert (dense_experts(h, idx, w, up, down, base) - (base + ref)).abs().max().item() <= ATOL
        hb, ub, db = h.bfloat16(), up.bfloat16(), down.bfloat16()
        promoted = dense_experts(hb, idx, w, ub, db, base)  # a float32 residual stream on bf16 experts
        assert promoted.dtype == torch.float32
        assert torch.equal(promoted, base + dense_experts(hb, idx, w, ub, db))


@pytest.mark.parametrize("t", [1, 3, 6, 40])
def test_strided_expert_views_equal_a_contiguous_copy(t):
    """Width-sliced expert views (StridedExperts) on every path, against the same experts copied."""
    full = _experts(e=8, f=12, h=16)
    e, f, h, k = 6, 8, 12, 2
    view = StridedExperts.__new__(StridedExperts)
    torch.nn.Module.__init__(view)
    view.num_experts = e
    view.up_proj = torch.nn.Parameter(full.up_proj.detach()[:e, :f, :h], requires_grad=False)
    view.down_proj = torch.nn.Parameter(full.down_proj.detach()[:e, :h, :f], requires_grad=False)
    assert not view.up_proj.is_contiguous()
    copy = _experts(e=e, f=f, h=h)
    with torch.no_grad():
        copy.up_proj.copy_(view.up_proj)
        copy.down_proj.copy_(view.down_proj)
    x = torch.randn(t, h)
    idx, w = _routing(t, k, e, seed=t)
    with torch.no_grad():
        assert (view(x, idx, w) - copy(x, idx, w)).abs().max().item() <= ATOL
        assert (view._dense(x, idx, w, None, None) - copy._grouped(x, idx, w, None, None)).abs().max() <= ATOL
        assert (view._grouped(x, idx, w, None, None) - copy._dense(x, idx, w, None, None)).abs().max() <= ATOL


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(n_groups=1, use_bias=True, mlp_bias=True),
        dict(mamba_num_heads=8, n_groups=4, num_attention_heads=8, num_key_value_heads=4, use_bias=True),
    ],
)
@pytest.mark.parametrize("batch", [1, 2])
@torch.no_grad()
def test_budget_views_decode_like_the_masked_parent(overrides, batch):
    """Budget view models (split projections, strided experts) against the masked parent: prefill, then the
    fast decode path."""
    parent = _model({"n_routed_experts": 8, **overrides})
    cfg = parent.config
    arch = Architecture(
        hidden=24,
        mamba_heads=cfg.mamba_num_heads // 2,
        attn_heads=cfg.num_attention_heads // 2,
        moe_ffn=8,
        shared_ffn=16,
        mlp_ffn=32,
        experts=6,
    )
    view = budget_model(parent, arch)
    masked = budget_model(parent, arch, prefer="masked")
    ids = torch.randint(0, 64, (batch, 12))
    a, b = view(ids[:, :5], use_cache=True), masked(ids[:, :5], use_cache=True)
    assert (a.logits - b.logits).abs().max().item() <= ATOL
    for t in range(5, 12):
        a, b = view(ids[:, t : t + 1], cache=a.cache), masked(ids[:, t : t + 1], cache=b.cache)
        assert (a.logits - b.logits).abs().max().item() <= ATOL


@pytest.mark.parametrize("inputs_major", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_split_projections_equal_the_gathered_weights(inputs_major, bias):
    """Row / column runs of a weight as split projections, against index_select of the same weight."""
    from model.decode.budget_view import store_transposed
    from model.decode.split_linear import RowSplitLinear, col_linear, row_linear

    lin = torch.nn.Linear(20, 48, bias=bias)
    if inputs_major:
        store_transposed(lin.weight)
    rows = torch.cat([torch.arange(0, 6), torch.arange(12, 18), torch.arange(24, 30), torch.arange(40, 44)])
    split = row_linear(lin, rows, 16)
    assert isinstance(split, RowSplitLinear) and len(split.runs) == 4  # one view per run, nothing copied
    assert all(w.untyped_storage().data_ptr() == lin.weight.untyped_storage().data_ptr() for w, _ in split.runs)
    x = torch.randn(3, 2, 16)
    got = split(x)
    want = torch.nn.functional.linear(x, lin.weight[rows, :16], lin.bias[rows] if bias else None)
    assert (got - want).abs().max().item() <= ATOL
    lin_t = torch.nn.Linear(48, 20, bias=bias)
    if inputs_major:
        store_transposed(lin_t.weight)
    xs = torch.randn(3, 2, rows.numel())
    got = col_linear(lin_t, rows, 16)(xs)
    want = torch.nn.functional.linear(xs, lin_t.weight[:16][:, rows], lin_t.bias[:16] if bias else None)
    assert (got - want).abs().max().item() <= ATOL
    # the decode path's 2-D inputs (one row and several), with the residual added by the split GEMMs
    with torch.no_grad():
        for n in (1, 3):
            x2, res = torch.randn(n, 16), torch.randn(n, 16)
            want = torch.nn.functional.linear(x2, lin.weight[rows, :16], lin.bias[rows] if bias else None)
            assert (linear(row_linear(lin, rows, 16), x2) - want).abs().max().item() <= ATOL
            xc = torch.randn(n, rows.numel())
            want = torch.nn.functional.linear(xc, lin_t.weight[:16][:, rows], lin_t.bias[:16] if bias else None) + res
            assert (linear(col_linear(lin_t, rows, 16), xc, res) - want).abs().max().item() <= ATOL


@pytest.mark.parametrize("grouped", [False, True])
@torch.no_grad()
def test_views_store_the_parent_inputs_major_without_changing_it(monkeypatch, grouped):
    """Building a view re-lays the parent's projections out as (in, out) in memory: same parameters, same
    values, same outputs (dense and grouped expert paths), and a budget's lm_head is a contiguous block."""
    import model.moe as moe_module

    if grouped:
        monkeypatch.setattr(moe_module, "_DENSE_MAX_WASTED_MACS", 0)
    parent = _model({"n_routed_experts": 8})
    ids = torch.randint(0, 64, (2, 30))
    before = parent(ids).logits
    params = dict(parent.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    view = budget_model(parent, Architecture(hidden=24, moe_ffn=8, experts=6))
    assert dict(parent.named_parameters()) == params  # the same parameter objects
    assert all(torch.equal(p, values[n]) for n, p in parent.named_parameters())
    assert parent.lm_head.weight.t().is_contiguous()
    moe = next(b.mixer for b in parent.model.layers if b.kind == "moe")
    assert moe.experts.up_proj.transpose(1, 2).is_contiguous()
    assert view.lm_head.weight.t().is_contiguous()  # the row prefix of the transposed matrix
    assert view.lm_head.weight.data_ptr() == parent.lm_head.weight.data_ptr()
    assert (parent(ids).logits - before).abs().max().item() <= ATOL
