"""Measured decode kernels (:mod:`model.decode.kernels`): every candidate against ``F.linear``, the plan with
every kind of copy against the reference forward, stale copies never read, the memory bound, the cache file.

Which kernel wins is measured and differs by machine, so the tests that need a given kernel fill a table
with the choice they need (:class:`KernelTable` entries) instead of measuring.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.config import HybridConfig
from model.decode import DecodePlan
from model.decode.kernels import (
    CANDIDATES,
    PREPARED,
    KernelTable,
    machine_key,
    make_copy,
    prepare_decode_linears,
    projections,
    release_decode_linears,
    run_copy,
)
from model.decode.ops import linear
from model.hybrid import HybridLM
from tests.conftest import TINY


class ForcedTable(KernelTable):
    """Every shape's measured times say ``kind`` is fastest (2x the weight's speed)."""

    def __init__(self, kind: str) -> None:
        super().__init__(None)
        self.kind = kind

    def times_for(self, out, inn, dtype, device, source) -> dict[str, float]:
        return {k: (1.0 if k == self.kind else 2.0) for k in CANDIDATES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["transposed", "onednn"])
@pytest.mark.parametrize("source_order", ["out_in", "in_out"])
def test_every_candidate_computes_the_linear(dtype, kind, source_order):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(dtype)
    if source_order == "in_out":
        w = w.t().contiguous().t()
    bias = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(3, 40, generator=g).to(dtype)
    res32 = torch.randn(3, 48, generator=g)
    copy = make_copy(kind, w)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding

    def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
        return bool(((out.float() - ref).abs() <= rtol * (1 + ref.abs())).all())

    mm = F.linear(x.float(), w.float())
    assert close(run_copy(kind, x, copy, bias, None), F.linear(x.float(), w.float(), bias.float()))
    assert close(run_copy(kind, x, copy, None, res32), mm + res32)
    res = res32.to(dtype)
    assert close(run_copy(kind, x, copy, None, res), mm + res.float())
    if kind == "transposed":
        assert copy.stride(-1) != w.stride(-1)  # the other memory order
        assert torch.equal(copy, w)


def _model(dtype: torch.dtype = torch.float32) -> HybridLM:
    return HybridLM(HybridConfig(**TINY)).init_weights(0).eval().to(dtype)


@torch.no_grad()
def _decode(m: HybridLM, ids: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    cache = m(ids[:, :4], use_cache=True).cache
    return torch.cat([plan(ids[:, i : i + 1], cache).logits for i in range(4, ids.shape[1])], 1)


@torch.no_grad()
def _reference(m: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    cache = m(ids[:, :4], use_cache=True).cache
    return torch.cat([m(ids[:, i : i + 1], cache=cache, mask=None).logits for i in range(4, ids.shape[1])], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["transposed", "onednn"])
def test_plan_with_copies_equals_the_reference(dtype, kind, monkeypatch):
    m = _model(dtype)
    monkeypatch.setattr("model.decode.plan.prepare_decode_linears", lambda model, **kw: None)
    report = prepare_decode_linears(m, ForcedTable(kind))
    n = len(projections(m))
    assert report.kernels == {kind: n} and report.copied_bytes > 0
    assert all(PREPARED in lin.__dict__ for lin in projections(m))
    ids = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(1))
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert (_decode(m, ids, DecodePlan(m)).float() - _reference(m, ids).float()).abs().max() <= tol
    assert m.state_dict().keys() == _model(dtype).state_dict().keys()  # the module itself is unchanged
    assert release_decode_linears(m) == n


def test_a_weight_changed_in_place_is_never_read_through_its_stale_copy():
    m = _model()
    prepare_decode_linears(m, ForcedTable("onednn"))
    head = m.lm_head
    x = torch.randn(1, head.in_features)
    with torch.no_grad():
        head.weight.mul_(2.0)  # an in-place update after the copy was made
        out = linear(head, x)
    assert torch.allclose(out, F.linear(x, head.weight), atol=1e-5)
    assert PREPARED not in head.__dict__  # the stale copy was dropped
    prepare_decode_linears(m, ForcedTable("onednn"))
    with torch.no_grad():
        head.weight = nn.Parameter(torch.zeros_like(head.weight))  # replaced
        assert torch.count_nonzero(linear(head, x)) == 0


def test_copies_stay_within_the_memory_bound_largest_saving_first():
    m = _model()
    sizes = sorted(lin.weight.numel() * 4 for lin in projections(m))
    bound = sum(sizes[:3])
    report = prepare_decode_linears(m, ForcedTable("transposed"), max_copy_bytes=bound)
    assert 0 < report.copied_bytes <= bound
    assert report.skipped_for_memory > 0
    assert sum(report.kernels.values()) == len(projections(m))
    release_decode_linears(m)
    off = prepare_decode_linears(m, ForcedTable("transposed"), max_copy_bytes=0)
    assert off.copied_bytes == 0 and not any(PREPARED in lin.__dict__ for lin in projections(m))


def test_no_copy_when_the_weight_itself_is_fastest_or_the_gain_is_noise():
    m = _model()
    assert prepare_decode_linears(m, ForcedTable("weight")).copied_bytes == 0

    class Close(KernelTable):
        def times_for(self, out, inn, dtype, device, source):
            return {"weight": 1.0, "transposed": 0.95, "onednn": 0.97}

    assert prepare_decode_linears(m, Close(None)).copied_bytes == 0


def test_measurements_are_kept_per_machine_in_the_cache_file(tmp_path):
    path = tmp_path / "kernels.json"
    table = KernelTable(path)
    w = torch.randn(24, 16)
    first = table.times(w)
    assert set(first) == set(CANDIDATES) and all(t > 0 for t in first.values())
    saved = json.loads(path.read_text())
    assert list(saved) == [machine_key()] and len(saved[machine_key()]) == 1
    again = KernelTable(path)  # a new process: read, not measured again
    assert again.times(w) == first
    assert again.times(w.t().contiguous().t()) is not None  # another memory order is another entry
    assert len(json.loads(path.read_text())[machine_key()]) == 2


def test_a_burst_of_load_during_one_candidates_turn_does_not_decide_the_winner():
    """Candidates take turns and each keeps its median batch: ``fast`` is slowed 15x for its first calls (a
    burst of load elsewhere) and still measures faster than ``slow``."""
    import time

    from model.decode.kernels import _interleaved_median

    calls = {"fast": 0}

    def fast() -> None:
        calls["fast"] += 1
        time.sleep(0.003 if calls["fast"] < 8 else 0.0002)

    def slow() -> None:
        time.sleep(0.001)

    best = _interleaved_median({"fast": fast, "slow": slow}, min_s=0.004, rounds=7)
    assert best["fast"] < best["slow"]


@pytest.mark.parametrize("kind", ["transposed", "onednn"])
@torch.no_grad()
def test_a_budget_views_split_projections_run_one_gemm_on_their_runs_joined(kind, monkeypatch):
    """A budget keeping one of two Mamba heads per group views its projections as several runs of the
    parent's rows / columns (:mod:`model.decode.split_linear`); prepared, each is one GEMM on a joined copy,
    and the budget's steps equal its steps without copies. The parent's weights are untouched."""
    from model.decode.budget_view import budget_model
    from model.decode.split_linear import ColSplitLinear, RowSplitLinear
    from model.elastic import Architecture

    monkeypatch.setattr("model.decode.plan.prepare_decode_linears", lambda model, **kw: None)
    parent = _model()
    before = {k: v.clone() for k, v in parent.state_dict().items()}
    budget = budget_model(parent, Architecture(hidden=24, mamba_heads=2))
    split = [m for m in projections(budget) if type(m) in (RowSplitLinear, ColSplitLinear)]
    assert {type(m) for m in split} == {RowSplitLinear, ColSplitLinear}
    ids = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(2))
    reference = _decode(budget, ids, DecodePlan(budget))  # no copies: the runs one by one
    report = prepare_decode_linears(budget, ForcedTable(kind))
    assert report.kernels == {kind: len(projections(budget))}
    assert all(PREPARED in m.__dict__ for m in split)
    x, res = torch.randn(3, split[0].in_features), torch.randn(3, split[0].out_features)
    assert torch.allclose(linear(split[0], x, res), split[0](x) + res, atol=1e-5)
    assert (_decode(budget, ids, DecodePlan(budget)) - reference).abs().max() <= 1e-5
    with torch.no_grad():  # an in-place update of the parent: the split copies are stale and dropped
        parent.model.layers[0].mixer.in_proj.weight.mul_(2.0)
    row = next(m for m in split if type(m) is RowSplitLinear)
    x = torch.randn(1, row.in_features)
    assert torch.allclose(linear(row, x), row(x), atol=1e-5) and PREPARED not in row.__dict__
    parent.model.layers[0].mixer.in_proj.weight.div_(2.0)
    assert all(torch.equal(v, before[k]) for k, v in parent.state_dict().items())


@torch.no_grad()
def test_servings_copy_bound_holds_for_all_budgets_together(monkeypatch):
    """``prepare_decode(registry, bound)``: every budget's plan built, their copies within one bound for all
    budgets (the largest budget first); 0 leaves every budget on the one weight copy."""
    from components.serving.loading import prepare_decode
    from model.decode.budget_view import BudgetRegistry
    from model.elastic import Architecture

    monkeypatch.setattr("model.decode.kernels.shared_table", lambda: ForcedTable("transposed"))
    archs = {"full": Architecture(), "small": Architecture(hidden=24, mamba_heads=2)}

    def copies(bound: int | None) -> dict[str, int]:
        registry = BudgetRegistry(_model(), archs)
        prepare_decode(registry, bound)
        return {n: registry.get(n).decode_plan().kernels.copied_bytes for n in registry.names}

    unbounded = copies(None)
    assert all(b > 0 for b in unbounded.values())
    assert copies(0) == {"full": 0, "small": 0}
    bound = unbounded["full"] + unbounded["small"] // 2
    bounded = copies(bound)
    assert bounded["full"] == unbounded["full"] and 0 < bounded["small"] < unbounded["small"]
    assert sum(bounded.values()) <= bound
