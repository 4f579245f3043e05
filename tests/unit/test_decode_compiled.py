"""Compiled one-row decode steps (:mod:`model.decode.compiled`) against the eager plan's steps.

The eager steps are the reference (themselves tested against the layers' forward in test_decode_fast_path.py).
Both decode from copies of one prefill; float32 logits and the caches left behind agree to 1e-5, bfloat16 to
bfloat16's rounding. Compiling takes a few seconds per distinct model shape, so the models here are few.
"""

from __future__ import annotations

import pytest
import torch

from model.cache import clone_cache, concat_caches
from model.config import HybridConfig
from model.decode import DecodePlan
from model.decode.budget_view import StridedExperts, budget_model
from model.decode.compiled import CompiledStep
from model.decode.split_linear import ColSplitLinear, RowSplitLinear
from model.elastic import Architecture
from model.hybrid import HybridLM
from tests.conftest import TINY
from tests.unit.test_decode_fast_path import _max_diff_caches, _model

pytestmark = pytest.mark.skipif(
    not torch._inductor.cpp_builder.get_cpp_compiler(), reason="torch.compile on CPU needs a C++ compiler"
)
ATOL = 1e-5


@torch.no_grad()
def _decode_both(model: HybridLM, plan: DecodePlan, ids: torch.Tensor, prefill: int, steps: int) -> float:
    """Greedy-free decoding of ``ids`` after ``prefill`` tokens with ``plan`` and with an eager plan; returns the
    largest logit difference, after asserting every compiled step ran compiled and the caches agree."""
    eager = DecodePlan(model)
    out = model(ids[:, :prefill], use_cache=True)
    caches = [out.cache, clone_cache(out.cache)]
    worst = 0.0
    for t in range(prefill, prefill + steps):
        tok = ids[:, t : t + 1]
        assert plan.compiled is not None and plan.compiled.runs(model.model.embeddings(tok.view(-1)), caches[0])
        fast, ref = plan(tok, caches[0]), eager(tok, caches[1])
        worst = max(worst, (fast.logits.float() - ref.logits.float()).abs().max().item())
    assert _max_diff_caches(caches[0], caches[1]) <= ATOL * 10
    return worst


def _ids(n: int, seed: int = 3, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (rows, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_compiled_steps_equal_the_eager_steps_in_float32_across_a_kv_cache_growth():
    """Every layer kind (Mamba, attention, MoE, MLP) in one compiled step per run of layers; the prefill leaves
    the KV buffers full, so the first step grows them."""
    m = _model({})
    plan = DecodePlan(m, compiled=True)
    assert plan.warm() > 0 and plan.compile_error is None, plan.compile_summary()
    plan.compiled = plan.compiled or CompiledStep(plan.steps, plan.norm_f, plan.lm_head)  # kept even if slower
    assert [s.attention for s in plan.compiled.segments] == [1, None]  # pattern M*ME-E: one attention layer
    assert _decode_both(m, plan, _ids(20), prefill=7, steps=12) <= ATOL


@torch.no_grad()
def test_compiled_steps_hold_bfloat16_to_its_rounding():
    m = _model({}).to(torch.bfloat16)
    plan = DecodePlan(m, compiled=True)
    plan.warm()
    plan.compiled = plan.compiled or CompiledStep(plan.steps, plan.norm_f, plan.lm_head)
    ids = _ids(12, seed=5)
    out = m(ids[:, :8], use_cache=True)
    for t in range(8, 12):  # each step from the same state: rounding differences do not accumulate
        tok = ids[:, t : t + 1]
        fast, ref = plan(tok, clone_cache(out.cache)), DecodePlan(m)(tok, clone_cache(out.cache))
        assert fast.logits.dtype == torch.bfloat16
        assert (fast.logits.float() - ref.logits.float()).abs().max().item() <= 2e-2
        out = m(tok, cache=out.cache)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("copies", [True, False])
@torch.no_grad()
def test_a_budget_views_compiled_steps_read_its_runs_prefixes_and_strided_experts(copies, rows):
    """A budget view: split projections (runs of the parent's rows / columns), inputs-major prefixes and strided
    expert stacks. With copies the compiled step reads outputs-major contiguous copies of them; without (a
    zero bound), the views themselves. Both equal the eager steps, for one row and for several, and the parent
    is untouched."""
    parent = _model({})
    before = {k: v.clone() for k, v in parent.state_dict().items()}
    budget = budget_model(parent, Architecture(hidden=24, mamba_heads=2, moe_ffn=8, experts=3))
    kinds = {type(m) for m in budget.modules()}
    assert {RowSplitLinear, ColSplitLinear, StridedExperts} <= kinds
    plan = DecodePlan(budget, max_copy_bytes=None if copies else 0, compiled=True)
    assert (plan.compiled.copied_bytes > 0) == copies
    assert bool(plan.compiled.copies) == copies and bool(plan.compiled.expert_copies) == copies
    assert _decode_both(budget, plan, _ids(16, seed=7, rows=rows), prefill=5, steps=6) <= ATOL
    assert all(torch.equal(v, before[k]) for k, v in parent.state_dict().items())


@torch.no_grad()
def test_a_weight_changed_in_place_is_never_read_through_a_stale_copy(monkeypatch):
    from model.decode import plan as plan_module

    # No measured kernel copies: which projections get one depends on timings (a projection with a fresh
    # kernel copy needs none of the compiled step's), and the compiled step's own copies are under test.
    measured = plan_module.prepare_decode_linears
    monkeypatch.setattr(plan_module, "prepare_decode_linears", lambda model, **kw: measured(model, max_copy_bytes=0))
    parent = _model({})
    budget = budget_model(parent, Architecture(hidden=24, mamba_heads=2))
    plan = DecodePlan(budget, compiled=True)
    row = next(m for m in budget.modules() if type(m) is RowSplitLinear)
    assert id(row) in plan.compiled.copies
    parent.model.layers[0].mixer.in_proj.weight.mul_(1.5)  # the budget's view sees it; its copy is stale
    ids = _ids(12, seed=11)
    assert _decode_both(budget, plan, ids, prefill=6, steps=3) <= ATOL
    assert id(row) not in plan.compiled.copies


@torch.no_grad()
def test_steps_the_compiled_step_does_not_cover_run_eagerly():
    """Rows of a count the compiled step is switched off for (warm found it slower), and a projection watched
    by a forward hook (which must see every call), take the eager steps; the results are the eager plan's."""
    m = _model({})
    plan = DecodePlan(m, compiled=True)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    out = m(ids[:, :8], use_cache=True)
    x = m.model.embeddings(ids[:, 8])
    assert plan.compiled.runs(x, out.cache)
    plan.compiled.several_rows = False
    assert not plan.compiled.runs(x, out.cache) and plan.compiled.runs(x[:1], out.cache)
    fast, ref = plan(ids[:, 8:], clone_cache(out.cache)), DecodePlan(m)(ids[:, 8:], clone_cache(out.cache))
    assert torch.equal(fast.logits, ref.logits)
    seen = []
    handle = m.model.layers[0].mixer.out_proj.register_forward_hook(lambda *a: seen.append(1))
    try:
        one = m(ids[:1, :8], use_cache=True)
        assert not plan.compiled.runs(m.model.embeddings(ids[:1, 8]), one.cache)
        seen.clear()  # the prefill called it too
        plan(ids[:1, 8:], one.cache)
        assert seen == [1]
    finally:
        handle.remove()


@torch.no_grad()
def test_a_compiler_that_fails_leaves_the_eager_plan_and_says_why(tmp_path, monkeypatch):
    """No usable C++ compiler (a fresh inductor cache, so nothing is reused): warm() reports the failure and the
    plan decodes eagerly."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    m = HybridLM(HybridConfig(**{**TINY, "hidden_size": 40, "pattern": "ME"})).init_weights(0).eval()
    plan = DecodePlan(m, compiled=True)
    with torch._inductor.config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-compiler"))}):
        plan.warm()
    assert plan.compiled is None and plan.compile_error
    assert "failed, eager kept" in plan.compile_summary()
    ids = _ids(6)
    out = m(ids[:, :5], use_cache=True)
    assert torch.allclose(
        plan(ids[:, 5:], clone_cache(out.cache)).logits, m(ids[:, 5:], cache=out.cache).logits, atol=ATOL
    )


@torch.no_grad()
def test_warm_measures_both_and_keeps_the_compiled_steps_only_when_faster():
    m = _model({})
    plan = DecodePlan(m, compiled=True)
    compiled = plan.compiled
    plan.warm(rounds=3, calls=2, rows=3)
    for ms in (plan.step_ms, plan.rows_ms):
        assert set(ms) == {"eager", "compiled"} and all(v > 0 for v in ms.values())
    assert compiled.one_row == (plan.step_ms["compiled"] < plan.step_ms["eager"])
    assert compiled.several_rows == (plan.rows_ms["compiled"] < plan.rows_ms["eager"])
    assert (plan.compiled is not None) == (compiled.one_row or compiled.several_rows)
    summary = plan.compile_summary()
    assert "one-row step compiled" in summary and "3-row step compiled" in summary, summary
    assert DecodePlan(m).compile_summary() == "compiled steps off"


@torch.inference_mode()  # as serving decodes, and warm() compiles
def test_prompts_of_any_length_reuse_the_warm_graphs():
    """A prefill leaves each conv state as a view whose row stride depends on the prompt's length; the compiled
    step takes it in its own layout, so requests with new prompt lengths never compile (a compile under traffic
    costs seconds), and the states it returns keep that layout."""
    m = _model({})
    plan = DecodePlan(m, compiled=True)
    plan.warm(prompt_tokens=16)
    plan.compiled = plan.compiled or CompiledStep(plan.steps, plan.norm_f, plan.lm_head)
    eager = DecodePlan(m)
    for length in (5, 9, 23):
        ids = _ids(length + 3, seed=length)
        out = m(ids[:, :length], use_cache=True)
        caches = [out.cache, clone_cache(out.cache)]
        with torch.compiler.set_stance("fail_on_recompile"):
            for t in range(length, length + 3):
                fast = plan(ids[:, t : t + 1], caches[0])
                ref = eager(ids[:, t : t + 1], caches[1])
                assert (fast.logits - ref.logits).abs().max().item() <= ATOL
        for layer in caches[0].layers:
            if hasattr(layer, "conv"):
                rows, channels, taps = layer.conv.shape
                assert layer.conv.stride() == (channels * taps, 1, channels)


@torch.no_grad()
def test_a_weight_in_another_memory_order_gets_a_graph_of_its_own():
    """Graphs are shared by every plan of one model shape; one compiled for an outputs-major weight is never run
    on a weight of the same shape stored inputs-major (same values, transposed storage): the graph's guards on
    strides send it to a graph of its own, and both decode as the eager steps do."""
    m = _model({})
    plan = DecodePlan(m, compiled=True, max_copy_bytes=0)
    plan.compiled = CompiledStep(plan.steps, plan.norm_f, plan.lm_head)
    assert _decode_both(m, plan, _ids(12, seed=13), prefill=6, steps=2) <= ATOL
    out_proj = m.model.layers[0].mixer.out_proj
    out_proj.weight.data = out_proj.weight.data.t().contiguous().t()  # inputs-major storage, same values
    plan = DecodePlan(m, compiled=True, max_copy_bytes=0)
    plan.compiled = CompiledStep(plan.steps, plan.norm_f, plan.lm_head)
    assert plan.compiled.projection(out_proj)[1][0].stride(-1) != 1
    assert _decode_both(m, plan, _ids(12, seed=13), prefill=6, steps=2) <= ATOL


@torch.inference_mode()  # as serving decodes, and warm() compiles
def test_several_rows_of_any_count_and_padding_run_one_graph_and_equal_each_row_decoded_alone():
    """A batch of rows with histories of different lengths (shorter ones left-padded in the KV buffers) in one
    compiled call per step: every row's logits equal that row decoded alone by the eager steps, and a batch of
    another row count, padded or not, runs the same graph (the row count is dynamic in it), through a KV
    buffer's growth and rows leaving (the rest's shared padding trimmed: a view of the wider buffer). Two
    attention layers: each has its own padding tensor, in the warm-up's unpadded batch as in a padded one.
    A batch in buffers with free rows runs the same graph, writes its Mamba states in place, and a row joins
    it by slot (written into a free row: the other rows stay where they are)."""
    m = _model({"pattern": "M*E-*E"})
    plan = DecodePlan(m, compiled=True)
    plan.warm(rounds=1, calls=1, rows=2)
    plan.compiled = plan.compiled or CompiledStep(plan.steps, plan.norm_f, plan.lm_head)
    plan.compiled.one_row = plan.compiled.several_rows = True
    eager = DecodePlan(m)
    for rows, padded, spare in ((3, True, 0), (5, False, 2), (4, True, 0)):
        ids = _ids(30, seed=rows, rows=rows + spare)
        lengths = [6 + 3 * i if padded else 8 for i in range(rows)]
        alone = [m(ids[i : i + 1, :n], use_cache=True).cache for i, n in enumerate(lengths)]
        batch = concat_caches([clone_cache(c) for c in alone], rows=rows + spare)
        assert (batch.layers[1].pad is not None) == padded and batch.spare_rows() == spare
        kept = list(range(rows))
        with torch.compiler.set_stance("fail_on_recompile"):
            for t in range(20, 26):
                if t == 23 and padded:  # the longest row leaves; the others' shared padding is trimmed
                    kept = kept[:-1]
                    trim = int(batch.layers[1].pad[kept].min())
                    assert trim > 0
                    batch = batch.select(torch.tensor(kept), trim)
                if t == 22 and spare:  # a row of a shorter history joins by slot
                    alone.append(m(ids[rows : rows + 1, :5], use_cache=True).cache)
                    where = [batch.layers[0].ssm.data_ptr(), batch.layers[1].k.data_ptr()]
                    assert batch.join(clone_cache(alone[-1])) and batch.spare_rows() == spare - 1
                    assert [batch.layers[0].ssm.data_ptr(), batch.layers[1].k.data_ptr()] == where
                    assert batch.layers[1].pad.tolist() == [0] * rows + [batch.layers[1].length - 5]
                    kept.append(rows)
                states = batch.layers[0].ssm
                tok = ids[kept, t : t + 1]
                fast = plan(tok, batch).logits
                if spare:  # written in place: the buffers' free rows stay the batch's
                    assert batch.layers[0].ssm is states and batch.spare_rows() > 0
                for j, i in enumerate(kept):
                    ref = eager(tok[j : j + 1], alone[i]).logits
                    assert (fast[j : j + 1] - ref).abs().max().item() <= ATOL


@torch.no_grad()
def test_several_rows_hold_bfloat16_to_its_rounding():
    m = _model({}).to(torch.bfloat16)
    plan = DecodePlan(m, compiled=True)
    plan.compiled.one_row = False  # several rows only
    ids = _ids(12, seed=9, rows=3)
    out = m(ids[:, :8], use_cache=True)
    for t in range(8, 12):  # each step from the same state: rounding differences do not accumulate
        tok = ids[:, t : t + 1]
        assert plan.compiled.runs(m.model.embeddings(tok.view(-1)), out.cache)
        fast, ref = plan(tok, clone_cache(out.cache)), DecodePlan(m)(tok, clone_cache(out.cache))
        assert fast.logits.dtype == torch.bfloat16
        assert (fast.logits.float() - ref.logits.float()).abs().max().item() <= 2e-2
        out = m(tok, cache=out.cache)


@torch.no_grad()
def test_warm_says_so_when_nothing_can_run_compiled():
    """A plan whose steps the compiled step cannot read (here a hooked projection; in serving, a quantized
    checkpoint) is not timed against itself: warm keeps the eager plan and says why."""
    m = _model({})
    handle = m.model.layers[0].mixer.out_proj.register_forward_hook(lambda *a: None)
    try:
        plan = DecodePlan(m, compiled=True)
        plan.warm(rounds=1, calls=1, rows=2)
        assert plan.compiled is None and plan.step_ms is None and plan.compile_error is None
        assert "cannot run here" in plan.compile_summary()
    finally:
        handle.remove()


def test_expert_order_is_a_stable_sort_by_expert():
    """The in-graph ordering of (row, expert) assignments against ``argsort(stable=True)``, its inverse and the
    grouped GEMM's cumulative offsets, on ties, unused experts and a single expert."""
    from model.decode.step_functions import expert_order

    g = torch.Generator().manual_seed(5)
    for flat, experts in (
        (torch.randint(0, 8, (32,), generator=g), 8),
        (torch.tensor([3, 3, 0, 3, 1, 0]), 6),
        (torch.zeros(5, dtype=torch.long), 1),
    ):
        order, back, offs = expert_order(flat, experts)
        assert torch.equal(order, flat.argsort(stable=True))
        assert torch.equal(back[order], torch.arange(flat.shape[0]))
        counts = torch.bincount(flat, minlength=experts)
        assert torch.equal(offs, counts.cumsum(0).to(torch.int32))
