"""Run a DAG of stages with resumable, input-keyed outputs and one MLflow run per execution.

Every stage writes into ``<runs_dir>/<run_name>/<stage>/``. Its *key* is a hash of
its validated config and of the keys of the stages it depends on; a stage whose
folder holds a ``_stage.json`` with the same key is done and is skipped, so a
re-run after a crash or a config change resumes at the first stage whose inputs
changed (``force_from`` re-runs a stage and everything after it). The marker is
written last and atomically: a half-written stage is never taken as done, and a
failing stage leaves the earlier stages' folders untouched.

A stage that starts records its key in ``_attempt.json`` (removed when it finishes). A stage that
can resume (its spec names the sub-folders holding its resumable state, e.g. the distillation's Ray
Train checkpoints) and finds an unfinished attempt with the same key keeps those sub-folders when it runs again, so a
pipeline killed mid-distillation continues from its last checkpoint; everything else in the folder
is cleared. A changed key (config or upstream changed) or ``force_from`` starts the stage afresh,
and the log says why.

Output folders are deterministic, so every stage's config — including the URIs
of its upstream outputs — is built and validated before the first stage starts,
once (:func:`resolve_configs`): preflight hands the configs it checked to the
runner, which plans, keys and runs with those same objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from components.progress import stage_heartbeat
from components.tracking import NullTracker, Tracker
from pipelines.errors import RunFolderBusy, machine_fault

MARKER = "_stage.json"
ATTEMPT = "_attempt.json"


@dataclass
class StageSpec:
    """One stage: ``build(ctx)`` returns its validated config; ``run(cfg, tracker, ctx)`` its outputs."""

    name: str
    depends: list[str]
    build: Callable[[StageContext], BaseModel]
    run: Callable[[BaseModel, Tracker, StageContext], dict[str, Any]]
    description: str = ""
    resumable: tuple[str, ...] = ()
    """Sub-paths of the stage folder holding state an interrupted attempt with the same key resumes from."""


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


def _write_marker(folder: Path, data: dict[str, Any], name: str = MARKER) -> None:
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, folder / name)


def _read_marker(folder: Path, name: str = MARKER) -> dict[str, Any] | None:
    try:
        return json.loads((folder / name).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def prepare_folder(spec: StageSpec, folder: Path, key: str, forced: bool) -> str:
    """Empty ``folder`` for a new attempt of ``spec`` with ``key``; returns the log line saying what was kept.

    An unfinished attempt (no marker of ``key``) with the same key keeps ``spec.resumable``; any other
    earlier content is removed. The attempt's key is then recorded before the stage runs.
    """
    attempt = _read_marker(folder, ATTEMPT)
    done = _read_marker(folder)
    keep: tuple[str, ...] = ()
    if attempt is None or done is not None and done.get("key") == attempt.get("key"):
        why = "starting"
    elif forced:
        why = "forced: the interrupted attempt's state is discarded"
    elif attempt.get("key") != key:
        why = f"inputs changed since the interrupted attempt (key {attempt.get('key')} -> {key}): starting afresh"
    elif not spec.resumable:
        why = "restarting the interrupted attempt (this stage does not resume)"
    else:
        keep = tuple(p for p in spec.resumable if (folder / p).exists())
        why = f"resuming the interrupted attempt (kept {', '.join(keep)})" if keep else "restarting: nothing to resume"
    if folder.is_dir():
        for child in folder.iterdir():
            if child.name not in keep:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    _write_marker(folder, {"key": key, "started_at": time.time(), "pid": os.getpid()}, ATTEMPT)
    return why


def resolve_configs(
    stages: Sequence[StageSpec], pipeline_config: Any, run_dir: Path
) -> tuple[dict[str, BaseModel], dict[str, Exception]]:
    """Every stage's config from its own ``build``, and the error of each stage whose config does not build
    (a ``ValueError``, pydantic's ``ValidationError`` included, ``TypeError`` or ``FileNotFoundError``)."""
    configs: dict[str, BaseModel] = {}
    errors: dict[str, Exception] = {}
    for spec in stages:
        try:
            configs[spec.name] = spec.build(StageContext(pipeline_config, Path(run_dir), spec.name))
        except (ValueError, TypeError, FileNotFoundError) as err:
            errors[spec.name] = err
    return configs, errors


def topological(stages: Sequence[StageSpec]) -> list[StageSpec]:
    """The run order of the stage DAG: each stage after its dependencies, otherwise in list order (a depth-first
    walk of the list). The one order every executor follows: this runner, and the Kubeflow pipeline's steps
    (:func:`pipelines.kfp_pipeline.pipeline_dag`). Unknown dependencies and cycles are errors."""
    by_name = {s.name: s for s in stages}
    for s in stages:
        unknown = [d for d in s.depends if d not in by_name]
        if unknown:
            raise ValueError(f"stage {s.name!r} depends on unknown stages {unknown}")
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
    """Runs stages in order, skipping those whose key matches their recorded marker.

    ``configs``: every stage's config as :func:`resolve_configs` built it for ``pipeline_config`` (preflight's);
    None: built on first use. Either way they are built once per runner.
    """

    def __init__(
        self,
        stages: list[StageSpec],
        pipeline_config: Any,
        run_dir: Path,
        configs: Mapping[str, BaseModel] | None = None,
    ) -> None:
        self.stages = topological(stages)
        self.config = pipeline_config
        self.run_dir = Path(run_dir)
        self._configs = dict(configs) if configs is not None else None

    def build_configs(self) -> dict[str, BaseModel]:
        """Every stage's validated config (built on the first call); one error listing every problem otherwise."""
        if self._configs is None:
            configs, errors = resolve_configs(self.stages, self.config, self.run_dir)
            if errors:
                problems = [f"{name}: {err}" for name, err in errors.items()]
                raise ValueError("pipeline config is invalid:\n  " + "\n  ".join(problems))
            self._configs = configs
        missing = [s.name for s in self.stages if s.name not in self._configs]
        if missing:
            raise ValueError(f"no config for stages {missing}")
        return dict(self._configs)

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
        forced = self._forced(force_from)
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
            why = prepare_folder(spec, folder, keys[spec.name], spec.name in forced)
            log(f"[{i}/{total}] {spec.name}: running — {spec.description} ({why})")
            start = time.perf_counter()
            ctx = StageContext(self.config, self.run_dir, spec.name)
            try:
                with tracker.child(spec.name) as stage_tracker:
                    stage_tracker.set_tags({"stage": spec.name, "stage_key": keys[spec.name]})
                    with stage_heartbeat(f"[{i}/{total}] {spec.name}", log):  # never quiet for long
                        outputs = spec.run(configs[spec.name], stage_tracker, ctx)
            except Exception as err:
                seconds = time.perf_counter() - start
                (folder / "_error.txt").write_text(traceback.format_exc())
                fault = machine_fault(err)  # a full disk or a refused permission: its one line, not a traceback
                what = fault or f"{type(err).__name__}: {err}"
                log(f"[{i}/{total}] {spec.name}: FAILED after {seconds:.1f}s: {what}")
                results.append(StageResult(spec.name, "failed", seconds, error=f"{type(err).__name__}: {err}"))
                raise StageFailed(spec.name, err, results) from err
            seconds = time.perf_counter() - start
            _write_marker(
                folder,
                {"key": keys[spec.name], "outputs": outputs, "seconds": seconds, "finished_at": time.time()},
            )
            (folder / ATTEMPT).unlink(missing_ok=True)  # finished: the folder holds outputs and its marker only
            log(f"[{i}/{total}] {spec.name}: done in {seconds:.1f}s")
            results.append(StageResult(spec.name, "ran", seconds, outputs))
        return results


LOCK = "_pipeline.lock"


@contextmanager
def run_folder_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` for one pipeline execution (``flock`` on ``_pipeline.lock``).

    The kernel drops the lock when its process dies, however it dies, so holding it proves that no live
    process on this machine (or on a shared volume whose file system honours ``flock``) still runs a
    pipeline here: what an earlier execution left RUNNING was interrupted. Raises :class:`RunFolderBusy`
    naming the holder's pid when the lock is taken.
    """
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise RunFolderBusy(
                f"another pipeline (pid {holder}) is running in {run_dir}; wait for it, stop it, or set another "
                "run_name / runs_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class StageFailed(RuntimeError):
    """A stage raised; ``results`` holds what ran before it."""

    def __init__(self, stage: str, error: BaseException, results: list[StageResult]) -> None:
        super().__init__(f"stage {stage!r} failed: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error
        self.results = results
