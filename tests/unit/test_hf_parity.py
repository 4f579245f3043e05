"""Parity with transformers' NemotronHForCausalLM on a tiny config with every layer kind."""

from __future__ import annotations

import pytest
import torch

from model.config import HybridConfig
from model.hybrid import HybridLM
from tests.conftest import TINY
from tests.helpers import perturbed_hf_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("pattern", [TINY["pattern"], "E*M-MM*E"])
def test_hf_checkpoint_loads_with_equal_logits(tmp_path, pattern):
    cfg = HybridConfig(**{**TINY, "pattern": pattern})
    hf = perturbed_hf_model(cfg.to_hf_dict())
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = HybridLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, cfg.vocab_size, (2, 21))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("prefix", ["model", "backbone"])
def test_our_checkpoint_opens_in_transformers(tmp_path, layout, prefix):
    from transformers import NemotronHForCausalLM

    cfg = HybridConfig(**TINY)
    ours = HybridLM(cfg).init_weights(3).eval()
    for block in ours.model.layers:
        if block.kind == "moe":
            block.mixer.gate.e_score_correction_bias.normal_(0, 0.3)
    ours.save_pretrained(tmp_path / "ours", prefix=prefix, expert_layout=layout)
    hf = NemotronHForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max().item() <= 1e-4
