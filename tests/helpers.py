"""Builders several test modules share: a tiny pipeline config, a transformers NemotronH and a rank-stage parent
with non-trivial values, so that a slip (a wrong permutation, a dropped tensor) shows in the logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from model.config import HybridConfig
from model.hybrid import HybridLM
from tests.conftest import TINY


def write_tiny_pipeline_config(tmp_path: Path, **extra: Any) -> Path:
    """``tmp_path/config.yaml``: run ``tiny`` under ``tmp_path/runs``, one elastic axis and one budget, plus
    ``extra`` top-level keys."""
    data = {
        "run_name": "tiny",
        "runs_dir": str(tmp_path / "runs"),
        "elastic": {"space": {"hidden": [64, 32]}, "budgets": [{"name": "full", "active": 1.0}]},
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def perturbed_hf_model(hf_config: dict[str, Any], seed: int = 0):
    """A transformers ``NemotronHForCausalLM`` of ``hf_config`` in eval mode, with non-trivial values for what
    its default init leaves constant (norm weights, D, dt_bias, the conv bias, the router's correction bias)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    hf = NemotronHForCausalLM(NemotronHConfig(**hf_config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias", "conv1d.bias")):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return hf


def save_tiny_parent(root: Path, seed: int = 0) -> Path:
    """A random ``TINY`` parent (every layer kind) with the demo character tokenizer beside it, saved to
    ``root/parent``. Returns the checkpoint folder."""
    from components.data import TextTokenizer, build_demo_tokenizer

    tok = TextTokenizer(build_demo_tokenizer())
    tok_dir = tok.save(root / "tok")
    model = HybridLM(HybridConfig(**{**TINY, "vocab_size": tok.vocab_size})).init_weights(seed)
    return model.save_pretrained(root / "parent", extra_files={p.name: p for p in tok_dir.iterdir()})


def save_rank_parent(out_dir: Path, vocab_size: int, extra_files: dict[str, Path]) -> Path:
    """A random ``TINY`` parent (6 experts, ``vocab_size`` tokens) saved to ``out_dir`` with ``extra_files``
    (the tokenizer's) beside it; its norms and router bias are perturbed so a permutation slip would show in
    the logits. Returns the checkpoint folder."""
    model = HybridLM(HybridConfig(**{**TINY, "vocab_size": vocab_size, "n_routed_experts": 6})).init_weights(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        for block in model.model.layers:
            if block.kind == "moe":
                block.mixer.gate.e_score_correction_bias.normal_(0, 0.2)
    return model.save_pretrained(out_dir, extra_files=extra_files)
