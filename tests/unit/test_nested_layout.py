"""The nested (tier by tier) layout of the Mamba projections: same parent, same budgets, prefix storage."""

from __future__ import annotations

import pytest
import torch

from model import nested_layout
from model.budget_view import BudgetRegistry, budget_model, copied_bytes
from model.config import HybridConfig
from model.elastic import Architecture
from model.hybrid import HybridLM
from model.nested_layout import nest_mamba_projections, tiered_view
from model.tiered_linear import TieredCols, TieredRows
from tests.conftest import TINY

ATOL = 2e-5
FIELDS = {**TINY, "mamba_num_heads": 12, "n_groups": 2, "mamba_head_dim": 4}
BUDGETS = {
    "full": Architecture(),
    "mid": Architecture(hidden=24, mamba_heads=8, moe_ffn=8),
    "small": Architecture(hidden=16, mamba_heads=4, moe_ffn=8, experts=2),
}


@pytest.fixture(autouse=True)
def _nest_small_layers(monkeypatch):
    """These parents are tiny; nest them anyway (below NEST_MIN_BYTES a registry leaves them group-major)."""
    monkeypatch.setattr(nested_layout, "NEST_MIN_BYTES", 0)


def _parent(bias: bool) -> HybridLM:
    model = HybridLM(HybridConfig(**FIELDS, use_bias=bias)).init_weights(2).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-trivial values where the init leaves constants
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".D", "dt_bias", "conv1d.bias", "gate.weight", "proj.bias")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _decode(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits of a prefill and of ``steps`` single-token cached steps (the lean decode path)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits = [out.logits]
        for t in range(steps):
            out = model(ids[:, t : t + 1], cache=out.cache)
            logits.append(out.logits)
    return logits


@pytest.mark.parametrize("bias", [False, True])
def test_nested_registry_serves_the_same_budgets(bias):
    """A registry over a nested parent: the parent computes what it did, and every budget equals the same
    budget viewed from the plain parent, on prefill and on one-row and several-row decode steps."""
    plain, nested = _parent(bias), _parent(bias)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    before = _decode(nested, ids[:1], 4)
    reg = BudgetRegistry(nested, BUDGETS, nested=True)
    assert reg.nested
    mixers = [b.mixer for b in nested.model.layers if b.kind == "mamba"]
    assert all(type(m.in_proj) is TieredRows and type(m.out_proj) is TieredCols for m in mixers)
    for a, b in zip(before, _decode(nested, ids[:1], 4), strict=True):
        assert (a - b).abs().max().item() <= ATOL
    for name, arch in BUDGETS.items():
        want_model = budget_model(plain, arch)
        for rows in (1, 3):
            got, want = _decode(reg.get(name), ids[:rows], 4), _decode(want_model, ids[:rows], 4)
            for a, b in zip(got, want, strict=True):
                assert (a - b).abs().max().item() <= ATOL, (name, rows)


def test_budget_rows_are_one_prefix_of_the_storage():
    """The smallest budget reads a prefix in the mixer's own order (no gather); larger ones a prefix and one
    gather; the full budget shares the parent's orders; nothing but the orders and conv channels is copied."""
    parent = _parent(False)
    reg = BudgetRegistry(parent, BUDGETS, nested=True)
    src = next(b.mixer for b in parent.model.layers if b.kind == "mamba")
    storage = src.in_proj.weight_t
    for name in BUDGETS:
        mixer = next(b.mixer for b in reg.get(name).model.layers if b.kind == "mamba")
        w = mixer.in_proj.weight_t
        assert w.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        assert w.storage_offset() == 0 and w.stride() == storage.stride()  # rows [:h], columns [:n]: a prefix
        assert (mixer.in_proj.order is None) == (name == "small")
        assert (mixer.out_proj.order is None) == (name == "small")
    assert copied_bytes(reg.get("full"), parent) == 0
    weight_bytes = sum(p.numel() * p.element_size() for p in parent.parameters())
    assert all(v < 0.05 * weight_bytes for v in reg.copied_bytes().values())


def test_a_head_count_outside_the_layout_is_refused():
    """A budget whose heads per group are not a tier of the layout would need rows the prefix lacks."""
    parent = _parent(False)
    config = parent.config
    mixer = next(b.mixer for b in parent.model.layers if b.kind == "mamba")
    assert nest_mamba_projections(mixer, config, [2, 4])  # tiers of 2, 4 and 6 heads per group
    with pytest.raises(ValueError, match="not a tier of this nested layout"):
        tiered_view(mixer, config, 2 * 3, config.hidden_size)  # 3 per group
    with pytest.raises(ValueError, match="not a tier"):
        budget_model(parent, Architecture(mamba_heads=6))
    assert not nest_mamba_projections(_parent(False).model.layers[0].mixer, config, [6])  # one tier: unchanged


def test_small_layers_stay_group_major(monkeypatch):
    """Below NEST_MIN_BYTES of in_proj the registry leaves the parent as it is (overhead-bound decode)."""
    parent = _parent(False)
    in_bytes = parent.model.layers[0].mixer.in_proj.weight.numel() * 4
    monkeypatch.setattr(nested_layout, "NEST_MIN_BYTES", in_bytes + 1)
    reg = BudgetRegistry(parent, BUDGETS, nested=True)
    assert not reg.nested and type(parent.model.layers[0].mixer.in_proj) is torch.nn.Linear
    monkeypatch.setattr(nested_layout, "NEST_MIN_BYTES", in_bytes)
    assert BudgetRegistry(_parent(False), BUDGETS, nested=True).nested


def test_a_nested_parent_refuses_to_be_sliced_or_saved_as_a_plain_one(tmp_path):
    """Its Mamba projections have no nn.Linear weight: code reading one, or saving the model, fails instead of
    reading or writing permuted rows."""
    parent = _parent(False)
    BudgetRegistry(parent, BUDGETS, nested=True)
    mixer = next(b.mixer for b in parent.model.layers if b.kind == "mamba")
    with pytest.raises(AttributeError):
        _ = mixer.in_proj.weight
    with pytest.raises(TypeError, match="re-laid out for serving"):
        parent.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
