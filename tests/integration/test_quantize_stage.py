"""The quantize stage end to end on a tiny nested checkpoint: checkpoints, recovery and size tables, tracking."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from components.data.tokenizer import TextTokenizer, build_demo_tokenizer
from components.quantize import QuantizeConfig, run_quantize
from components.tracking import NullTracker
from model.elastic import hard_mask
from model.elastic.export import read_elastic
from model.hybrid import HybridLM
from model.quant import extract_quantized_budget, load_quantized_model
from tests.unit.test_quant_checkpoint import build_nested


class RecordingTracker(NullTracker):
    """Keeps what the stage logs."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}
        self.artifacts: list[str] = []

    def log_params(self, params):
        self.params.update(params)

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(Path(path).name)


@pytest.fixture
def nested(tmp_path) -> Path:
    """A tiny nested checkpoint with the project's tokenizer beside it (so calibration uses real problems)."""
    tok = TextTokenizer(build_demo_tokenizer())
    tok_dir = tok.save(tmp_path / "tok")
    files = {p.name: p for p in tok_dir.iterdir()}
    return build_nested(tmp_path / "nested", vocab_size=tok.vocab_size, extra_files=files)


def agreement_evaluator(reference_dir: Path):
    """A stub evaluator: per budget, how often the checkpoint's greedy next token matches the unquantized one."""
    info = read_elastic(reference_dir)
    reference = HybridLM.from_pretrained(reference_dir)
    ids = torch.randint(0, info.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(5))
    masks = {b.name: hard_mask(info.config, b.architecture, info.depth_order) for b in info.budgets}
    with torch.no_grad():
        expected = {name: reference(ids, mask=m).logits.argmax(-1) for name, m in masks.items()}
    calls: list[str] = []

    def evaluate(checkpoint_dir: str) -> dict[str, float]:
        calls.append(Path(checkpoint_dir).name)
        cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        model = load_quantized_model(checkpoint_dir) if "quantization_config" in cfg else reference
        with torch.no_grad():
            tokens = {n: model(ids, mask=m).logits.argmax(-1) for n, m in masks.items()}
        return {n: (t == expected[n]).float().mean().item() for n, t in tokens.items()}

    return evaluate, calls


def test_quantize_stage(nested, tmp_path):
    evaluate, calls = agreement_evaluator(nested)
    config = QuantizeConfig(
        checkpoint_uri=str(nested),
        output_dir=str(tmp_path / "quantize"),
        calibration={"num_batches": 2, "batch_size": 2, "seq_len": 64},
    )
    tracker = RecordingTracker()
    out = run_quantize(config, tracker, evaluate_fn=evaluate)

    # one quantized nested checkpoint per format, every budget extractable from it
    assert set(out.checkpoints) == {"fp8", "nvfp4", "nvfp4_w4a4"}
    algos = {"fp8": "FP8", "nvfp4": "W4A16_NVFP4", "nvfp4_w4a4": "NVFP4"}  # ModelOpt's names
    for fmt, path in out.checkpoints.items():
        qc = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
        assert qc["quant_algo"] == algos[fmt]
        hf = json.loads((Path(path) / "hf_quant_config.json").read_text())
        assert hf["quantization"]["quant_algo"] == algos[fmt]
        assert (Path(path) / "tokenizer.json").is_file()
        with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as fh:  # dense parts in bf16
            assert fh.get_tensor("lm_head.weight").dtype == torch.bfloat16
        assert extract_quantized_budget(path, "small", tmp_path / f"{fmt}-small").is_dir()

    # recovery: the baseline was measured with the same evaluator (no baseline_accuracy given)
    assert calls == ["fp8", "nvfp4", "nvfp4_w4a4", "nested"]
    rows = {(r["format"], r["budget"]): r for r in out.recovery}
    assert set(rows) == {(f, b) for f in ("fp8", "nvfp4", "nvfp4_w4a4") for b in ("full", "mid", "small")}
    for r in rows.values():
        assert r["baseline"] == 1.0 and 0.0 <= r["quantized"] <= 1.0 and r["recovery"] == r["quantized"]
    assert rows["fp8", "full"]["recovery"] > 0.5
    assert out.recovery_by_format["nvfp4"]["mid"] == rows["nvfp4", "mid"]["recovery"]
    assert out.recovery_by_format["nvfp4_w4a4"]["full"] == rows["nvfp4_w4a4", "full"]["recovery"]

    # sizes: all budgets in one file; nvfp4 < fp8 < bf16 < fp32 source
    sizes = {r["name"]: r for r in out.sizes}
    assert sizes["nvfp4"]["bytes"] < sizes["fp8"]["bytes"] < sizes["bf16"]["bytes"] < sizes["source"]["bytes"]
    assert sizes["nvfp4"]["bytes"] < sizes["nvfp4_w4a4"]["bytes"] < sizes["fp8"]["bytes"]  # + activation scales
    # file bytes include the headers: one entry per routed expert weighs ~3% on this tiny model
    assert sizes["source"]["bits_per_param"] == pytest.approx(32, rel=0.05)
    assert sizes["bf16"]["ratio_to_bf16"] == 1.0

    # files and tracking
    saved = json.loads(Path(out.recovery_json).read_text())
    assert saved["rows"] == out.recovery and set(saved["baseline"]) == {"full", "mid", "small"}
    with open(out.sizes_csv, newline="") as fh:
        assert [r["name"] for r in csv.DictReader(fh)] == ["source", "bf16", "fp8", "nvfp4", "nvfp4_w4a4"]
    assert tracker.params["quantize"]["preset"] == "default"
    assert tracker.metrics["recovery/nvfp4/small"] == rows["nvfp4", "small"]["recovery"]
    assert tracker.metrics["bytes/fp8"] == sizes["fp8"]["bytes"]
    assert sorted(tracker.artifacts) == ["recovery.csv", "recovery.json", "sizes.csv", "sizes.json"]


def test_given_baseline_is_not_reevaluated(nested, tmp_path):
    evaluate, calls = agreement_evaluator(nested)
    config = QuantizeConfig(
        checkpoint_uri=str(nested),
        output_dir=str(tmp_path / "q"),
        formats=["nvfp4"],
        preset="conservative",
        baseline_accuracy={"full": 0.5, "mid": 0.5, "small": 0.25},
    )
    out = run_quantize(config, NullTracker(), evaluate_fn=evaluate)
    assert calls == ["nvfp4"]
    small = next(r for r in out.recovery if r["budget"] == "small")
    assert small["recovery"] == pytest.approx(small["quantized"] / 0.25)


def test_evaluate_section_goes_to_run_evaluate(nested, tmp_path, monkeypatch):
    """Without an evaluate_fn, the evaluate section becomes an EvalConfig per checkpoint."""
    import components.evaluate as ev

    seen: list[ev.EvalConfig] = []

    def fake_run_evaluate(cfg: ev.EvalConfig, tracker=None) -> ev.EvalOutputs:
        seen.append(cfg)
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"accuracy_per_budget": {"full": {"all": 0.75, "1": 0.5}}}))
        return ev.EvalOutputs(results_json=str(out / "results.json"), results_csv="", plot_png="", metrics={},
                              comparison={})  # fmt: skip

    monkeypatch.setattr(ev, "run_evaluate", fake_run_evaluate)
    config = QuantizeConfig(
        checkpoint_uri=str(nested),
        output_dir=str(tmp_path / "q"),
        formats=["nvfp4"],
        evaluate={"levels": [1], "n_per_level": 2, "think_caps": [None]},
    )
    out = run_quantize(config, NullTracker())
    assert [Path(c.checkpoint_uri).name for c in seen] == ["nvfp4", "nested"]
    assert seen[0].levels == [1] and Path(seen[0].output_dir).name == "eval-nvfp4"
    assert out.recovery == [{"format": "nvfp4", "budget": "full", "baseline": 0.75, "quantized": 0.75, "recovery": 1.0}]


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="extra"):
        QuantizeConfig(checkpoint_uri="x", fromats=["fp8"])
    with pytest.raises(ValueError):
        QuantizeConfig(checkpoint_uri="x", formats=["int4"])
