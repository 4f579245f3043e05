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
