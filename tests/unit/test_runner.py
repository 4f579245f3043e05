"""The stage runner: input-keyed caching, resume after a failure, --from, config validation up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from pipelines.runner import MARKER, PipelineRunner, StageFailed, StageSpec


class Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: int
    upstream: str | None = None


def _stages(settings: dict, calls: list[str], fail: set[str] | None = None) -> list[StageSpec]:
    fail = fail or set()

    def make(name: str, depends: list[str]) -> StageSpec:
        def build(ctx):
            up = str(ctx.dir(depends[0]) / "out.txt") if depends else None
            return Cfg(upstream=up, **settings[name])

        def run(cfg, tracker, ctx):
            calls.append(name)
            if name in fail:
                raise RuntimeError(f"{name} broke")
            prev = Path(cfg.upstream).read_text() if cfg.upstream else ""
            (ctx.dir() / "out.txt").write_text(prev + f"{name}={cfg.value};")
            return {"out": str(ctx.dir() / "out.txt")}

        return StageSpec(name, depends, build, run, description=name)

    return [make("a", []), make("b", ["a"]), make("c", ["b"])]


def _settings(**over):
    base = {"a": {"value": 1}, "b": {"value": 2}, "c": {"value": 3}}
    base.update(over)
    return base


def test_runs_in_order_and_caches(tmp_path):
    calls: list[str] = []
    runner = PipelineRunner(_stages(_settings(), calls), None, tmp_path)
    runner.run(log=lambda s: None)
    assert calls == ["a", "b", "c"]
    assert (tmp_path / "c" / "out.txt").read_text() == "a=1;b=2;c=3;"
    calls.clear()
    results = PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(log=lambda s: None)
    assert calls == [] and [r.status for r in results] == ["cached"] * 3


def test_config_change_reruns_from_first_changed_stage(tmp_path):
    calls: list[str] = []
    PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(log=lambda s: None)
    calls.clear()
    PipelineRunner(_stages(_settings(b={"value": 7}), calls), None, tmp_path).run(log=lambda s: None)
    assert calls == ["b", "c"]
    assert (tmp_path / "c" / "out.txt").read_text() == "a=1;b=7;c=3;"


def test_failure_keeps_earlier_outputs_and_resume_continues(tmp_path):
    calls: list[str] = []
    with pytest.raises(StageFailed) as err:
        PipelineRunner(_stages(_settings(), calls, fail={"b"}), None, tmp_path).run(log=lambda s: None)
    assert err.value.stage == "b"
    assert (tmp_path / "a" / MARKER).exists()
    assert not (tmp_path / "b" / MARKER).exists()  # never taken as done
    assert "b broke" in (tmp_path / "b" / "_error.txt").read_text()
    calls.clear()
    PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(log=lambda s: None)
    assert calls == ["b", "c"]


def test_force_from(tmp_path):
    calls: list[str] = []
    PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(log=lambda s: None)
    calls.clear()
    PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(force_from="b", log=lambda s: None)
    assert calls == ["b", "c"]
    with pytest.raises(ValueError, match="unknown stage"):
        PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(force_from="zz", log=lambda s: None)


def test_half_written_marker_is_not_done(tmp_path):
    calls: list[str] = []
    PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(log=lambda s: None)
    (tmp_path / "b" / MARKER).write_text('{"key": ')  # torn write
    calls.clear()
    PipelineRunner(_stages(_settings(), calls), None, tmp_path).run(log=lambda s: None)
    assert calls == ["b", "c"]
    assert json.loads((tmp_path / "b" / MARKER).read_text())["outputs"]["out"].endswith("out.txt")


def test_every_invalid_stage_config_is_listed_before_anything_runs(tmp_path):
    calls: list[str] = []
    bad = _settings(a={"value": "x"}, c={"value": 3, "typo": 1})
    with pytest.raises(ValueError) as err:
        PipelineRunner(_stages(bad, calls), None, tmp_path).run(log=lambda s: None)
    msg = str(err.value)
    assert "a:" in msg and "c:" in msg and "typo" in msg
    assert calls == []


def _resumable_stage(calls: list[tuple[str, bool]], value: int, fail: bool) -> list[StageSpec]:
    """One stage ``t`` that writes ``state/progress`` (resumable) and ``scratch`` (not), and fails on ``fail``."""

    def build(ctx):
        return Cfg(value=value)

    def run(cfg, tracker, ctx):
        state = ctx.dir() / "state"
        calls.append(("t", (state / "progress").exists()))
        state.mkdir(exist_ok=True)
        (state / "progress").write_text("step 80")
        (ctx.dir() / "scratch").write_text("x")
        if fail:
            raise RuntimeError("killed")
        return {}

    return [StageSpec("t", [], build, run, description="t", resumable=("state",))]


def test_interrupted_resumable_stage_keeps_its_state_with_the_same_key(tmp_path):
    calls: list[tuple[str, bool]] = []
    with pytest.raises(StageFailed):
        PipelineRunner(_resumable_stage(calls, 1, fail=True), None, tmp_path).run(log=lambda s: None)
    (tmp_path / "t" / "stray").write_text("left by the killed attempt")
    lines: list[str] = []
    PipelineRunner(_resumable_stage(calls, 1, fail=False), None, tmp_path).run(log=lines.append)
    assert calls == [("t", False), ("t", True)]  # the second attempt found the first one's state
    assert "resuming the interrupted attempt (kept state)" in lines[0]
    assert not (tmp_path / "t" / "stray").exists()  # everything but the resumable state was cleared


def test_changed_key_or_force_starts_a_resumable_stage_afresh(tmp_path):
    calls: list[tuple[str, bool]] = []
    with pytest.raises(StageFailed):
        PipelineRunner(_resumable_stage(calls, 1, fail=True), None, tmp_path).run(log=lambda s: None)
    lines: list[str] = []
    with pytest.raises(StageFailed):
        PipelineRunner(_resumable_stage(calls, 2, fail=True), None, tmp_path).run(log=lines.append)
    assert calls[-1] == ("t", False) and "inputs changed since the interrupted attempt" in lines[0]
    PipelineRunner(_resumable_stage(calls, 2, fail=False), None, tmp_path).run(force_from="t", log=lines.append)
    assert calls[-1] == ("t", False) and "forced" in lines[-2]


def test_finished_stage_rerun_with_new_key_keeps_nothing(tmp_path):
    calls: list[tuple[str, bool]] = []
    PipelineRunner(_resumable_stage(calls, 1, fail=False), None, tmp_path).run(log=lambda s: None)
    PipelineRunner(_resumable_stage(calls, 2, fail=False), None, tmp_path).run(log=lambda s: None)
    assert calls == [("t", False), ("t", False)]


def test_a_second_pipeline_in_the_same_run_folder_is_refused_in_one_line(tmp_path, capsys):
    """The lock proves no live process still writes there; a second `run` on it is one line, exit 1."""
    from pipelines.cli import main
    from pipelines.runner import run_folder_lock
    from tests.helpers import write_tiny_pipeline_config

    config = write_tiny_pipeline_config(tmp_path)
    with run_folder_lock(tmp_path / "runs" / "tiny"):
        assert main(["run", str(config)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("star-elastic: error: another pipeline (pid ")
    assert str(tmp_path / "runs" / "tiny") in err
