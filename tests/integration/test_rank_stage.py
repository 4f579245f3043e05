"""The rank stage end to end: real local Ray tasks, an MLflow tracker on SQLite, a tiny random parent."""

from __future__ import annotations

import json

import pytest
import torch

from components.data import DataConfig, GeneratorSource, TextTokenizer, build_demo_tokenizer
from components.rank import CalibrationConfig, RankConfig, run_rank
from components.tracking import MlflowTracker
from model.elastic.importance import Rankings
from model.hybrid import HybridLM
from tests.helpers import save_rank_parent

pytestmark = pytest.mark.integration


@pytest.fixture
def parent_dir(tmp_path):
    """A randomly initialised tiny parent with the demo tokenizer beside it (the layout the stage expects)."""
    tok = TextTokenizer(build_demo_tokenizer())
    tok_dir = tok.save(tmp_path / "tok")
    return save_rank_parent(tmp_path / "parent", tok.vocab_size, {p.name: p for p in tok_dir.iterdir()})


def test_rank_stage_end_to_end(ray_runtime, parent_dir, tmp_path):
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "rank-test", run_name="rank")
    config = RankConfig(
        parent_uri=str(parent_dir),
        output_dir=str(tmp_path / "rank"),
        calibration=CalibrationConfig(
            num_samples=16,
            seq_len=48,
            batch_size=4,
            data=DataConfig(sources=[GeneratorSource(max_steps=4)], pack=True),
            exclude_eval_per_level=5,
        ),
        depth=True,
        depth_batches=1,
        num_tasks=2,
    )
    out = run_rank(config, tracker)
    tracker.finish()

    # outputs exist and hold what they should
    with open(out.rankings_uri) as fh:
        rankings = Rankings.from_dict(json.load(fh))
    assert rankings.num_sequences == 16 and rankings.depth is not None
    with open(out.plot_uri, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "rankings.json"} <= {
        p.name for p in parent_dir.parent.glob("rank/permuted/*")
    }
    TextTokenizer.load(out.permuted_uri)  # the tokenizer travels with the checkpoint
    assert out.metrics["calibration_tokens"] == 16 * 48
    assert out.metrics["permute_max_abs_logit_diff"] <= 1e-5

    # the permuted checkpoint computes what the parent does, and something did move
    parent, permuted = HybridLM.from_pretrained(parent_dir), HybridLM.from_pretrained(out.permuted_uri)
    ids = torch.randint(0, parent.config.vocab_size, (2, 21))
    assert (permuted(ids).logits - parent(ids).logits).abs().max().item() <= 1e-5
    assert not torch.equal(permuted.model.embeddings.weight, parent.model.embeddings.weight)

    # the MLflow run has the whole config as params, the metrics and the artifacts
    run = tracker.client.get_run(tracker.run_id)
    assert run.data.params["num_tasks"] == "2"
    assert run.data.params["calibration.batch_size"] == "4"
    assert json.loads(run.data.params["axes"]) == config.axes
    assert run.data.metrics["calibration_tokens"] == 16 * 48
    artifacts = {a.path for a in tracker.client.list_artifacts(tracker.run_id)}
    assert {"rankings.json", "importance.png"} <= artifacts
    assert run.info.status == "FINISHED"


def test_rank_cli_takes_the_pipeline_rank_section_with_overrides(ray_runtime, parent_dir, tmp_path, capsys):
    """``star-elastic rank`` validates the same RankConfig as the pipeline stage; bad fields are named."""
    from pipelines.cli import main

    pipeline_yaml = tmp_path / "pipeline.yaml"
    pipeline_yaml.write_text(
        "run_name: x\nrank:\n  calibration: {num_samples: 8, seq_len: 32, batch_size: 4, exclude_eval_per_level: 2}\n"
        "  num_tasks: 1\n  axes: [hidden, experts]\n"
    )
    out_dir = tmp_path / "cli-rank"
    argv = ["rank", "--config", str(pipeline_yaml), "--parent", str(parent_dir), "--out", str(out_dir)]
    assert main([*argv, "--set", "expert_score=frequency", "--set", "progress=false"]) == 0
    out = capsys.readouterr().out  # Ray may forward a worker's earlier lines into this process's stdout first
    printed = json.loads(out[out.index("{\n") :])
    rankings = json.loads((out_dir / "rankings.json").read_text())
    assert printed["rankings_uri"] == str(out_dir / "rankings.json")
    assert rankings["num_sequences"] == 8
    assert HybridLM.from_pretrained(out_dir / "permuted").num_parameters() > 0

    assert main([*argv, "--set", "calibration.num_sampels=8"]) == 2
    assert "num_sampels" in capsys.readouterr().err
