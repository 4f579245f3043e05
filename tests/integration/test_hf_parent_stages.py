"""Parents written by transformers' ``save_pretrained`` go through the stages and ``serve`` unchanged.

Each layout a team brings (fp32 single file, bf16 sharded with ``max_shard_size``, the layer pattern
spelled only as ``layers_block_type`` or only as ``hybrid_override_pattern``) is saved by transformers
itself next to a tokenizer with a chat template, then: the rank stage calibrates and permutes it on a
data section (real Ray tasks), the evaluate stage scores it on a JSONL set, and the serving preflight
and loader accept it and generate. ``test_hf_checkpoints`` checks the logits against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from components.data import TextTokenizer, build_demo_tokenizer
from tests.unit.test_hf_checkpoints import HF_TINY, PATTERN

pytestmark = pytest.mark.integration

LAYOUTS = {
    "fp32": {"dtype": torch.float32, "shard": None, "pattern": "both"},
    "bf16-sharded": {"dtype": torch.bfloat16, "shard": "20KB", "pattern": "both"},
    "layers_block_type-only": {"dtype": torch.float32, "shard": None, "pattern": "list"},
    "hybrid_override_pattern-only": {"dtype": torch.float32, "shard": "40KB", "pattern": "string"},
}


def _save_hf_parent(root: Path, layout: dict) -> Path:
    """A tiny NemotronH saved by transformers (demo tokenizer files beside it), in ``layout``."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    tok = TextTokenizer(build_demo_tokenizer())
    torch.manual_seed(0)
    hf = NemotronHForCausalLM(NemotronHConfig(**{**HF_TINY, "vocab_size": tok.vocab_size})).eval()
    hf = hf.to(layout["dtype"])
    kwargs = {"max_shard_size": layout["shard"]} if layout["shard"] else {}
    hf.save_pretrained(root, **kwargs)
    tok.save(root)
    raw = json.loads((root / "config.json").read_text())
    if layout["pattern"] == "list":
        raw.pop("hybrid_override_pattern", None)
    elif layout["pattern"] == "string":
        raw.pop("layers_block_type", None)
        raw["hybrid_override_pattern"] = PATTERN
    (root / "config.json").write_text(json.dumps(raw, indent=2))
    if layout["shard"]:
        assert (root / "model.safetensors.index.json").is_file() and len(list(root.glob("*.safetensors"))) >= 2
    return root


@pytest.fixture(scope="module", params=list(LAYOUTS))
def hf_parent(request, tmp_path_factory) -> Path:
    return _save_hf_parent(tmp_path_factory.mktemp(request.param), LAYOUTS[request.param])


def test_rank_stage_on_a_transformers_parent(hf_parent, ray_runtime, tmp_path):
    from components.data import DataConfig, GeneratorSource
    from components.rank import CalibrationConfig, RankConfig, run_rank
    from components.tracking import NullTracker
    from model.hybrid import HybridLM

    config = RankConfig(
        parent_uri=str(hf_parent),
        output_dir=str(tmp_path / "rank"),
        calibration=CalibrationConfig(
            num_samples=4, seq_len=32, batch_size=2, data=DataConfig(sources=[GeneratorSource(max_steps=2)], pack=True)
        ),
        num_tasks=1,
        progress=False,
    )
    out = run_rank(config, NullTracker())
    permuted = Path(out.permuted_uri)
    assert (permuted / "chat_template.jinja").is_file()
    parent, moved = HybridLM.from_pretrained(hf_parent).float(), HybridLM.from_pretrained(permuted).float()
    ids = torch.randint(0, HF_TINY["vocab_size"], (1, 12))
    with torch.no_grad():
        tolerance = 1e-4 if parent.lm_head.weight.dtype == torch.float32 else 5e-2
        assert (parent(ids).logits - moved(ids).logits).abs().max().item() < tolerance


def test_evaluate_stage_on_a_transformers_parent(hf_parent, tmp_path):
    from components.evaluate import EvalConfig, run_evaluate

    rows = [{"prompt": "Q:3+4\n", "answer": "7"}, {"messages": [{"role": "user", "content": "Q:2*3\n"}], "answer": 6}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvalConfig(
        checkpoint_uri=str(hf_parent),
        output_dir=str(tmp_path / "eval"),
        eval_sets=[{"path": str(tmp_path / "eval.jsonl")}],
        think_caps=[0, None],
        think_limit=8,
        max_answer_tokens=4,
        elastic_pairs=[],
        progress=False,
    )
    out = run_evaluate(cfg)
    assert "acc/full" in out.metrics and 0.0 <= out.metrics["acc/full"] <= 1.0


def test_serve_preflight_and_loader_accept_a_transformers_parent(hf_parent):
    from components.serving.config import ServingConfig
    from components.serving.loading import LoadedModel, check_checkpoint

    warnings = check_checkpoint(hf_parent)  # raises on any problem; transformers writes no manifest
    assert len(warnings) == 1 and "no manifest.json" in warnings[0]
    loaded = LoadedModel.load(hf_parent, ServingConfig(api_key_env=None))
    ids = loaded.tokenizer.prompt_ids([{"role": "user", "content": "Q:1+1\n"}])
    assert ids == loaded.tokenizer.encode("<bos>Q:1+1\n<think>")
