"""Run a DAG of stages with resumable, input-keyed outputs and one MLflow run per execution.

Every stage writes into ``<runs_dir>/<run_name>/<stage>/``. Its *key* is a hash of
its validated config and of the keys of the stages it depends on; a stage whose
folder holds a ``_stage.json`` with the same key is done and is skipped, so a
re-run after a crash or a config change resumes at the first stage whose inputs
changed (``force_from`` re-runs a stage and everything after it). The marker is
written last and atomically: a half-written stage is never taken as done, and a
failing stage leaves the earlier stages' folders untouched.

Output folders are deterministic, so every stage's config — including the URIs
of its upstream outputs — is built and validated before the first stage starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from components.tracking import NullTracker, Tracker

MARKER = "_stage.json"


@dataclass
class StageSpec:
    """One stage: ``build(ctx)`` returns its validated config; ``run(cfg, tracker, ctx)`` its outputs."""

    name: str
    depends: list[str]
    build: Callable[[StageContext], BaseModel]
    run: Callable[[BaseModel, Tracker, StageContext], dict[str, Any]]
    description: str = ""


@dataclass
class StageContext:
    """What a stage adapter may look at: its folder, the pipeline config and upstream folders."""

    pipeline: Any
    run_dir: Path
    name: str

    def dir(self, stage: str | None = None) -> Path:
        return self.run_dir / (stage or self.name)

    def outputs(self, stage: str) -> dict[str, Any]:
        """Recorded outputs of a finished upstream stage (empty before it ran)."""
        marker = self.run_dir / stage / MARKER
        return json.loads(marker.read_text())["outputs"] if marker.exists() else {}


@dataclass
class StageResult:
    name: str
    status: str  # "ran", "cached", "failed"
    seconds: float
    outputs: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def config_key(cfg: BaseModel, upstream_keys: list[str]) -> str:
    payload = json.dumps({"config": cfg.model_dump(mode="json"), "upstream": upstream_keys}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def _write_marker(folder: Path, data: dict[str, Any]) -> None:
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, folder / MARKER)


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def topological(stages: list[StageSpec]) -> list[StageSpec]:
    """Stages in dependency order; unknown dependencies and cycles are errors."""
    by_name = {s.name: s for s in stages}
    for s in stages:
        for d in s.depends:
            if d not in by_name:
                raise ValueError(f"stage {s.name!r} depends on unknown stage {d!r}")
    order: list[StageSpec] = []
    state: dict[str, int] = {}

    def visit(s: StageSpec) -> None:
        if state.get(s.name) == 2:
            return
        if state.get(s.name) == 1:
            raise ValueError(f"dependency cycle through stage {s.name!r}")
        state[s.name] = 1
        for d in s.depends:
            visit(by_name[d])
        state[s.name] = 2
        order.append(s)

    for s in stages:
        visit(s)
    return order


class PipelineRunner:
    """Runs stages in order, skipping those whose key matches their recorded marker."""

    def __init__(self, stages: list[StageSpec], pipeline_config: Any, run_dir: Path) -> None:
        self.stages = topological(stages)
        self.config = pipeline_config
        self.run_dir = Path(run_dir)

    def build_configs(self) -> dict[str, BaseModel]:
        """Validate every stage's config up front; raise one error listing every problem."""
        configs: dict[str, BaseModel] = {}
        problems: list[str] = []
        for spec in self.stages:
            ctx = StageContext(self.config, self.run_dir, spec.name)
            try:
                configs[spec.name] = spec.build(ctx)
            except (ValueError, TypeError, FileNotFoundError) as err:
                problems.append(f"{spec.name}: {err}")
        if problems:
            raise ValueError("pipeline config is invalid:\n  " + "\n  ".join(problems))
        return configs

    def keys(self, configs: dict[str, BaseModel]) -> dict[str, str]:
        keys: dict[str, str] = {}
        for spec in self.stages:
            keys[spec.name] = config_key(configs[spec.name], [keys[d] for d in spec.depends])
        return keys

    def plan(self, force_from: str | None = None) -> list[tuple[str, str]]:
        """(stage, "cached" | "run") for every stage, without running anything."""
        configs = self.build_configs()
        keys = self.keys(configs)
        forced = self._forced(force_from)
        out = []
        dirty: set[str] = set()
        for spec in self.stages:
            marker = _read_marker(self.run_dir / spec.name)
            stale = (
                spec.name in forced
                or marker is None
                or marker.get("key") != keys[spec.name]
                or any(d in dirty for d in spec.depends)
            )
            if stale:
                dirty.add(spec.name)
            out.append((spec.name, "run" if stale else "cached"))
        return out

    def _forced(self, force_from: str | None) -> set[str]:
        if force_from is None:
            return set()
        names = [s.name for s in self.stages]
        if force_from not in names:
            raise ValueError(f"--from {force_from!r}: unknown stage; stages are {names}")
        return set(names[names.index(force_from) :])

    def check_only(self, only: list[str] | None, plan: dict[str, str]) -> None:
        """Refuse ``--only`` stages that do not exist or whose inputs are not done (``plan``: from :meth:`plan`)."""
        if only is None:
            return
        unknown = sorted(set(only) - set(plan))
        if unknown:
            raise ValueError(f"--only: unknown stages {unknown}; stages are {list(plan)}")
        for spec in self.stages:
            if spec.name in only:
                missing = [d for d in spec.depends if plan[d] == "run" and d not in only]
                if missing:
                    raise ValueError(
                        f"--only: stage {spec.name!r} needs {missing} done first (run them, or drop --only)"
                    )

    def run(
        self,
        tracker: Tracker | None = None,
        force_from: str | None = None,
        only: list[str] | None = None,
        log: Callable[[str], None] = print,
    ) -> list[StageResult]:
        tracker = tracker or NullTracker()
        configs = self.build_configs()
        keys = self.keys(configs)
        plan = dict(self.plan(force_from))
        self.check_only(only, plan)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        results: list[StageResult] = []
        total = len(self.stages)
        for i, spec in enumerate(self.stages, 1):
            if only is not None and spec.name not in only:
                continue
            folder = self.run_dir / spec.name
            if plan[spec.name] == "cached":
                marker = _read_marker(folder) or {}
                log(f"[{i}/{total}] {spec.name}: cached (key {keys[spec.name]})")
                results.append(StageResult(spec.name, "cached", 0.0, marker.get("outputs", {})))
                continue
            log(f"[{i}/{total}] {spec.name}: running — {spec.description}")
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            start = time.perf_counter()
            ctx = StageContext(self.config, self.run_dir, spec.name)
            try:
                with tracker.child(spec.name) as stage_tracker:
                    stage_tracker.set_tags({"stage": spec.name, "stage_key": keys[spec.name]})
                    outputs = spec.run(configs[spec.name], stage_tracker, ctx)
            except Exception as err:
                seconds = time.perf_counter() - start
                (folder / "_error.txt").write_text(traceback.format_exc())
                log(f"[{i}/{total}] {spec.name}: FAILED after {seconds:.1f}s: {type(err).__name__}: {err}")
                results.append(StageResult(spec.name, "failed", seconds, error=f"{type(err).__name__}: {err}"))
                raise StageFailed(spec.name, err, results) from err
            seconds = time.perf_counter() - start
            _write_marker(
                folder,
                {"key": keys[spec.name], "outputs": outputs, "seconds": seconds, "finished_at": time.time()},
            )
            log(f"[{i}/{total}] {spec.name}: done in {seconds:.1f}s")
            results.append(StageResult(spec.name, "ran", seconds, outputs))
        return results


class StageFailed(RuntimeError):
    """A stage raised; ``results`` holds what ran before it."""

    def __init__(self, stage: str, error: BaseException, results: list[StageResult]) -> None:
        super().__init__(f"stage {stage!r} failed: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error
        self.results = results
