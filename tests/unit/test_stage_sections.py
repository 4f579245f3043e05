"""A subcommand that runs one stage by itself builds that stage's config as the pipeline does.

``star-elastic rank --config pipelines/configs/chat-example.yaml`` must calibrate on the rows the
pipeline's rank stage calibrates on (the config's chat / text mixture, inherited from the top level),
and ``parent train`` must inherit the top-level data and markers as the parent stage does. The
commands run for real through :func:`pipelines.cli.main` up to the stage function, which is replaced
by one that records the config it is given.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from components.data import DataConfig, FilesSource, TextTokenizer
from components.rank import CalibrationConfig, RankConfig, RankOutputs, _exclude, calibration_batch
from pipelines.cli import main
from pipelines.config import load_pipeline_config
from pipelines.example_assets import make_chat_example
from pipelines.runner import PipelineRunner
from pipelines.stages import pipeline_stages

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "pipelines" / "configs" / "chat-example.yaml"
FEWER = "calibration.num_samples=48"
"""Three calibration batches instead of eight, set on both paths (the subcommand's ``--set`` is on its section)."""


@pytest.fixture(scope="module")
def chat_assets(tmp_path_factory) -> Path:
    """A folder holding ``runs/chat-example/assets`` as ``star-elastic example chat`` writes it (fewer rows)."""
    root = tmp_path_factory.mktemp("chat")
    make_chat_example(root / "runs" / "chat-example" / "assets", n_chat=600, n_text=200, n_eval_per_level=5)
    return root


def _recording(monkeypatch: pytest.MonkeyPatch, module: str, name: str, result: Any) -> list[Any]:
    """Replace ``module.name`` (a stage function the subcommand calls) by one recording its config."""
    seen: list[Any] = []

    def record(cfg: Any, tracker: Any) -> Any:
        seen.append(cfg)
        return result

    monkeypatch.setattr(f"{module}.{name}", record)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the subcommand's tracker: off
    return seen


def _rows_digest(cal: CalibrationConfig, tok: TextTokenizer) -> tuple[str, int]:
    """(sha256 of every calibration batch's input ids, number of batches), as the calibration tasks build them."""
    digest, exclude = hashlib.sha256(), _exclude(cal)
    for index in range(cal.num_batches):
        ids = calibration_batch(cal, tok, index, exclude)  # (batch_size, seq_len)
        digest.update(ids.to(torch.int64).numpy().tobytes())
    return digest.hexdigest(), cal.num_batches


def test_rank_subcommand_calibrates_on_the_rows_of_the_pipelines_rank_stage(chat_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(chat_assets)  # the config names its assets relative to the working folder
    outputs = RankOutputs(permuted_uri="-", rankings_uri="-", plot_uri="-", metrics={})
    seen = _recording(monkeypatch, "components.rank", "run_rank", outputs)
    args = ["rank", "--config", str(CHAT), "--parent", str(tmp_path / "parent"), "--out", str(tmp_path / "out")]
    assert main([*args, "--set", FEWER]) == 0
    (cli,) = seen

    pipeline = load_pipeline_config(CHAT, [f"rank.{FEWER}"])
    stage = PipelineRunner(pipeline_stages(), pipeline, pipeline.run_dir).build_configs()["rank"]
    assert cli.calibration == stage.calibration
    sources = cli.calibration.data.sources
    assert [type(s) for s in sources] == [FilesSource, FilesSource] and cli.calibration.data.pack  # the mixture

    tok = TextTokenizer.load(chat_assets / "runs" / "chat-example" / "assets" / "tokenizer", stage.calibration.markers)
    rows = _rows_digest(cli.calibration, tok)
    assert rows == _rows_digest(stage.calibration, tok) and rows[1] == 3
    # the section alone (no inheritance) would calibrate on the built-in generator: other rows
    alone = RankConfig(parent_uri="-", output_dir="-", **pipeline.rank.model_dump(exclude_unset=True))
    assert _rows_digest(alone.calibration, tok) != rows


def test_rank_subcommand_names_a_bad_top_level_data_at_its_yaml_path(tmp_path, monkeypatch, capsys):
    seen = _recording(monkeypatch, "components.rank", "run_rank", None)
    config = yaml.safe_load(CHAT.read_text())
    config["data"]["sources"][0]["weight"] = -1
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["rank", "--config", str(path), "--parent", "p", "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("data.sources[0]") and "weight" in line
    assert seen == []


def test_parent_train_subcommand_inherits_the_top_level_data_and_markers(tmp_path, monkeypatch):
    seen = _recording(monkeypatch, "components.parent", "train_parent", {})
    config = yaml.safe_load(CHAT.read_text())
    del config["parent"]["train"]["data"]  # the section names no data: the top level's applies
    config["markers"] = {"think_open": "<reason>", "think_close": "</reason>"}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "parent"
    assert main(["parent", "train", "--config", str(path), "--out", str(out), "--steps", "7"]) == 0
    (cli,) = seen

    pipeline = load_pipeline_config(path, ["parent.train.steps=7"])
    stage = PipelineRunner(pipeline_stages(), pipeline, pipeline.run_dir).build_configs()["parent"]
    assert cli.model_dump(exclude={"output_dir"}) == {k: v for k, v in stage.train.items() if k != "output_dir"}
    assert cli.output_dir == str(out) and cli.steps == 7
    assert cli.data == DataConfig.model_validate(config["data"]) and cli.markers.think_open == "<reason>"


def test_each_stage_config_is_resolved_once_from_preflight_to_the_runner(tmp_path, monkeypatch):
    from dataclasses import replace

    from pydantic import ValidationError

    from pipelines.preflight import check_pipeline

    monkeypatch.chdir(REPO)  # the demo config names the shipped parent relative to the repository
    builds: list[str] = []

    def counted(spec):
        def build(ctx):
            builds.append(spec.name)
            return spec.build(ctx)

        return replace(spec, build=build)

    stages = [counted(s) for s in pipeline_stages()]
    checked = check_pipeline(REPO / "pipelines" / "configs" / "demo.yaml", [f"runs_dir={tmp_path}"], stages=stages)
    assert checked.problems == [] and checked.config is not None
    runner = PipelineRunner(stages, checked.config, checked.config.run_dir, checked.stage_configs)
    runner.plan()
    configs = runner.build_configs()
    assert sorted(builds) == sorted(s.name for s in stages)  # once each, by preflight
    assert all(configs[name] is checked.stage_configs[name] for name in configs)
    with pytest.raises(ValidationError, match="frozen"):
        configs["rank"].depth = True  # type: ignore[misc]  # a resolved config is only read

    builds.clear()
    fresh = PipelineRunner(stages, checked.config, checked.config.run_dir)
    fresh.plan()
    fresh.keys(fresh.build_configs())
    assert sorted(builds) == sorted(s.name for s in stages)  # a runner on its own builds once too
