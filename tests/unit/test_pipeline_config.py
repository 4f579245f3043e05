"""Both shipped pipeline configs validate end to end; bad configs fail before any stage, naming fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import load_pipeline_config
from pipelines.run import check_uris
from pipelines.runner import PipelineRunner
from pipelines.stages import pipeline_stages

CONFIGS = Path(__file__).resolve().parents[2] / "pipelines" / "configs"


@pytest.mark.parametrize("name", ["demo.yaml", "real.yaml"])
def test_shipped_configs_build_every_stage(name, tmp_path):
    cfg = load_pipeline_config(CONFIGS / name, [f"runs_dir={tmp_path}"])
    runner = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir)
    configs = runner.build_configs()
    assert list(configs) == [
        "parent", "rank", "distill_phase1", "distill_phase2", "export", "evaluate", "quantize", "register",
    ]  # fmt: skip
    assert configs["distill_phase2"].phase == 2 and configs["distill_phase2"].init_from
    assert configs["distill_phase2"].seq_len > configs["distill_phase1"].seq_len


def test_every_problem_is_listed_by_field_path(tmp_path):
    with pytest.raises(ValueError) as err:
        load_pipeline_config(CONFIGS / "demo.yaml", ["bogus=1", "threads=zero", "parent.train.stepz=3"])
    msg = str(err.value)
    assert "bogus" in msg and "threads" in msg and "parent.train.stepz" in msg


def test_stage_section_errors_are_reported_before_running(tmp_path):
    # sections are typed with the stage config classes: a bad field fails when the config is read
    with pytest.raises(ValueError, match="(?s)distill_phase2.budget_probs: .*sum to 1"):
        load_pipeline_config(
            CONFIGS / "demo.yaml", [f"runs_dir={tmp_path}", "distill_phase2.budget_probs=[0.5, 0.6, 0.2]"]
        )
    # a cross-field check of the stage class fails when the stage configs are built, before any stage runs
    cfg = load_pipeline_config(
        CONFIGS / "demo.yaml", [f"runs_dir={tmp_path}", "distill_phase2.budget_probs=[0.5, 0.5]"]
    )
    with pytest.raises(ValueError, match="(?s)distill_phase2.*budget_probs has 2 entries"):
        PipelineRunner(pipeline_stages(), cfg, cfg.run_dir).build_configs()


def test_unreachable_parent_fails_fast(tmp_path):
    cfg = load_pipeline_config(CONFIGS / "demo.yaml", [f"parent.uri={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match="parent.uri"):
        check_uris(cfg)
