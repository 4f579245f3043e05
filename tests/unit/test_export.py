"""Nested checkpoint round trip: export -> read -> extract -> load (ours and transformers) -> same logits."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import HybridConfig
from model.elastic import Architecture, ElasticSpace, LayerOverride, count_params, hard_mask
from model.elastic.budgets import BudgetSet, UnknownBudgetError
from model.elastic.export import export_nested, extract_budget, load_budget_model, read_elastic
from model.elastic.router import BudgetRouter
from model.hybrid import HybridLM
from tests.conftest import TINY, TINY_SPACE

DEPTH_ORDER = [3, 5]  # drop the first MoE layer first, then the last one
SPACE = ElasticSpace(**TINY_SPACE, per_layer=True)
ARCHS = {
    "full": Architecture(),
    "mid": Architecture(hidden=24, moe_ffn=8, experts=3),
    "small": Architecture(
        hidden=16, mamba_heads=2, attn_heads=2, mlp_ffn=32, moe_ffn=8, shared_ffn=16, experts=3, depth=5
    ),
}


def _fraction(cfg: HybridConfig, arch: Architecture) -> float:
    return count_params(cfg, arch, DEPTH_ORDER).active / count_params(cfg).active


def _budgets(cfg: HybridConfig, archs: dict[str, Architecture]) -> BudgetSet:
    return BudgetSet.of({name: round(_fraction(cfg, a), 4) for name, a in archs.items()})


@pytest.fixture(scope="module")
def parent() -> HybridLM:
    cfg = HybridConfig(**TINY)
    model = HybridLM(cfg).init_weights(5).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial values for everything the init leaves constant
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias", "conv1d.bias")):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model


@pytest.fixture(scope="module")
def nested(parent, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nested")
    tok = tmp / "tokenizer.json"
    tok.write_text('{"version": "1.0"}')
    path = export_nested(
        parent, ARCHS, _budgets(parent.config, ARCHS), SPACE, tmp / "ckpt", DEPTH_ORDER, extra_files=[tok]
    )
    return path


def test_elastic_section_records_every_budget(parent, nested):
    raw = json.loads((nested / "config.json").read_text())
    section = raw["elastic"]
    assert [b["name"] for b in section["budgets"]] == ["full", "mid", "small"]
    assert section["depth_order"] == DEPTH_ORDER
    assert ElasticSpace.model_validate(section["space"]) == SPACE
    info = read_elastic(nested)
    assert info.names == ["full", "mid", "small"]
    assert info.parent_active_params == count_params(parent.config).active
    for b in info.budgets:
        count = count_params(parent.config, ARCHS[b.name], DEPTH_ORDER)
        assert b.architecture == ARCHS[b.name]
        assert (b.total_params, b.active_params) == (count.total, count.active)
        assert b.active_fraction == pytest.approx(_fraction(parent.config, ARCHS[b.name]))
        assert b.standalone and b.warning is None
    assert (nested / "tokenizer.json").exists()
    # the nested checkpoint is a plain nemotron_h checkpoint of the parent
    reloaded = HybridLM.from_pretrained(nested)
    ids = torch.randint(0, parent.config.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, parent(ids).logits)


@pytest.mark.parametrize("name", ["mid", "small"])
def test_extracted_budget_matches_masked_parent(parent, nested, tmp_path, name):
    from transformers import NemotronHForCausalLM

    out = extract_budget(nested, name, tmp_path / name)
    raw = json.loads((out / "config.json").read_text())
    assert "elastic" not in raw
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    ours = HybridLM.from_pretrained(out)
    hf = NemotronHForCausalLM.from_pretrained(out).eval()
    assert ours.num_parameters() == count_params(parent.config, ARCHS[name], DEPTH_ORDER).total
    ids = torch.randint(0, parent.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = parent(ids, mask=hard_mask(parent.config, ARCHS[name], DEPTH_ORDER)).logits
        got = ours(ids).logits
        got_hf = hf(ids).logits
    assert (got - ref).abs().max().item() <= 1e-4
    assert (got_hf - ref).abs().max().item() <= 1e-4
    in_memory = load_budget_model(nested, name)
    with torch.no_grad():
        assert (in_memory(ids).logits - ref).abs().max().item() <= 1e-4


def test_bad_budget_names_list_the_valid_ones(nested, tmp_path):
    with pytest.raises(UnknownBudgetError, match=r"'tiny'.*\['full', 'mid', 'small'\]"):
        extract_budget(nested, "tiny", tmp_path / "x")
    with pytest.raises(UnknownBudgetError, match=r"valid budgets \['full', 'mid', 'small'\]"):
        load_budget_model(nested, "tiny")
    assert not (tmp_path / "x").exists()


def test_off_target_budgets_rejected_unless_allowed(parent, tmp_path):
    budgets = BudgetSet.of({"full": 1.0, "mid": 0.95, "small": round(_fraction(parent.config, ARCHS["small"]), 4)})
    with pytest.raises(ValueError, match=r"budget 'mid': active fraction 0\.\d+ is \d+\.\d% off the target 0\.95"):
        export_nested(parent, ARCHS, budgets, SPACE, tmp_path / "bad", DEPTH_ORDER)
    assert not (tmp_path / "bad").exists()
    path = export_nested(parent, ARCHS, budgets, SPACE, tmp_path / "bad", DEPTH_ORDER, allow_off_target=True)
    info = read_elastic(path)
    assert info.budget("mid").warning is not None and "off the target" in info.budget("mid").warning
    assert info.budget("small").warning is None


def test_export_rejects_mismatched_architectures(parent, tmp_path):
    budgets = _budgets(parent.config, ARCHS)
    with pytest.raises(ValueError, match=r"missing \['small'\]"):
        export_nested(parent, {k: ARCHS[k] for k in ("full", "mid")}, budgets, SPACE, tmp_path / "a", DEPTH_ORDER)
    outside = {**ARCHS, "mid": Architecture(hidden=20)}
    with pytest.raises(ValueError, match="budget 'mid'"):
        export_nested(parent, outside, budgets, SPACE, tmp_path / "a", DEPTH_ORDER, allow_off_target=True)


def test_per_layer_budget_is_not_standalone(parent, tmp_path):
    archs = {"full": Architecture(), "pl": Architecture(hidden=24, layers={2: LayerOverride(mamba_heads=2)})}
    path = export_nested(parent, archs, _budgets(parent.config, archs), SPACE, tmp_path / "pl", DEPTH_ORDER)
    assert not read_elastic(path).budget("pl").standalone
    with pytest.raises(ValueError, match="cannot be written as a standalone checkpoint"):
        extract_budget(path, "pl", tmp_path / "pl_out")
    sub = load_budget_model(path, "pl")  # still usable in memory, block by block
    ids = torch.randint(0, parent.config.vocab_size, (1, 7))
    with torch.no_grad():
        ref = parent(ids, mask=hard_mask(parent.config, archs["pl"], DEPTH_ORDER)).logits
        assert (sub(ids).logits - ref).abs().max().item() <= 1e-4


def test_export_from_router(parent, tmp_path):
    budgets = BudgetSet.of({"full": 1.0, "small": 0.5})
    router = BudgetRouter(parent.config, SPACE, budgets)
    path = export_nested(parent, router, budgets, SPACE, tmp_path / "r", DEPTH_ORDER, allow_off_target=True)
    assert read_elastic(path).architectures == router.architectures()
    assert read_elastic(path).budget("full").active_fraction == pytest.approx(1.0)
    other = BudgetSet.of({"full": 1.0, "small": 0.6})
    with pytest.raises(ValueError, match="router was trained for budgets"):
        export_nested(parent, router, other, SPACE, tmp_path / "r2", DEPTH_ORDER)
    with pytest.raises(ValueError, match="not a nested elastic checkpoint"):
        parent.save_pretrained(tmp_path / "plain")
        read_elastic(tmp_path / "plain")


def _router_with_logits(parent: HybridLM, space: ElasticSpace, budgets: BudgetSet, table: dict) -> BudgetRouter:
    """A router whose raw logits for budget j on each axis are ``table[axis][j]`` (a saturated router)."""
    router = BudgetRouter(parent.config, space, budgets)
    n_b = len(budgets)
    with torch.no_grad():
        for axis, rows in table.items():
            out = router.heads[axis][2].weight  # (n_choices, hidden); hidden units 0..n_b-1 read the one-hot
            out.zero_()
            out[:, :n_b] = torch.tensor(rows, dtype=out.dtype).T
    return router


def test_feasible_selection_meets_the_target_nearest_the_argmax(parent, tmp_path):
    import itertools

    space = ElasticSpace(hidden=[32, 24, 16], mamba_heads=[4, 2], moe_ffn=[16, 8], experts=[4, 3])
    budgets = BudgetSet.of({"full": 1.0, "small": 0.6})
    table = {  # small saturated on (almost) the full architecture; hidden has the weakest preference
        "hidden": [[5.0, 0.0, 0.0], [0.5, 0.4, 0.0]],
        "mamba_heads": [[5.0, 0.0], [3.0, 0.0]],
        "moe_ffn": [[5.0, 0.0], [2.0, 0.0]],
        "experts": [[5.0, 0.0], [1.0, 0.0]],
    }
    router = _router_with_logits(parent, space, budgets, table)
    cfg = parent.config
    argmax = router.architectures(budgets)
    assert argmax["small"] == Architecture(hidden=32, mamba_heads=4, moe_ffn=16, experts=4)
    assert abs(count_params(cfg, argmax["small"]).active / count_params(cfg).active / 0.6 - 1) > 0.05

    chosen = router.architectures(budgets, select="feasible")
    assert chosen["full"] == argmax["full"] == Architecture(hidden=32, mamba_heads=4, moe_ffn=16, experts=4)
    small = chosen["small"]
    full_active = count_params(cfg).active

    def deviation(arch: Architecture) -> float:
        return abs(count_params(cfg, arch).active / (0.6 * full_active) - 1)

    def cost(arch: Architecture) -> float:
        d = arch.to_dict()
        return sum(max(table[a][1]) - table[a][1][space.choices(a).index(d[a])] for a in table)

    assert deviation(small) <= 0.05
    feasible = [
        Architecture(**dict(zip(table, combo, strict=True)))
        for combo in itertools.product(*(space.choices(a) for a in table))
    ]
    feasible = [a for a in feasible if deviation(a) <= 0.05]
    assert min(cost(a) for a in feasible) == pytest.approx(cost(small))

    path = export_nested(parent, router, budgets, space, tmp_path / "f", select="feasible")
    info = read_elastic(path)
    assert info.architectures == chosen
    assert info.budget("full").selection is None
    assert "argmax" in info.budget("small").selection and info.budget("small").warning is None

    tiny_target = BudgetSet.of({"full": 1.0, "small": 0.05})
    router2 = BudgetRouter(parent.config, space, tiny_target)
    with pytest.raises(ValueError, match="widen the candidate lists"):
        router2.architectures(tiny_target, select="feasible")
    with pytest.raises(ValueError, match="select must be"):
        router2.architectures(tiny_target, select="closest")
