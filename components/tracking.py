"""Experiment tracking: an MLflow tracker and a do-nothing stand-in with the same methods.

Stages receive a :class:`Tracker`; they never reach for a global MLflow run. The
MLflow implementation talks through an ``MlflowClient`` bound to its store (tracking and
registry URI, never the process-wide ones) with explicit run ids, so a Ray worker can log into
the run its driver created (pass ``tracking_uri`` and ``run_id``), and nested stage runs hang
under one pipeline run. Which store: :mod:`components.settings` (an explicit URI wins over
``MLFLOW_TRACKING_URI``).

A tracker is a context manager: ``with tracker:`` ends its run FINISHED when the body returns and
FAILED (with an ``error`` tag) when it raises, KILLED on Ctrl-C or SIGTERM (which Ray's driver turns
into ``SystemExit``), so no failure leaves a run RUNNING. A run a local SQLite store tracks keeps its
artifacts beside the database (``<folder of mlflow.db>/mlartifacts``), never in ``./mlruns`` under
whatever folder the process happens to start in.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

_MAX_PARAM_LEN = 6000
ARTIFACTS_DIR = "mlartifacts"
"""Folder beside a local SQLite store that holds its runs' and models' artifacts."""


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dict -> ``{"a.b.c": "value"}`` with values as (truncated) strings."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name] = text[:_MAX_PARAM_LEN]
    return out


def default_artifact_location(tracking_uri: str) -> str | None:
    """``<folder of the database>/mlartifacts`` for a SQLite file store; None (the server decides) otherwise.

    ``sqlite:///runs/mlflow.db`` (relative to the working directory) -> ``<cwd>/runs/mlartifacts``;
    ``sqlite:////abs/mlflow.db`` -> ``/abs/mlartifacts``; in-memory SQLite and other stores -> None.
    """
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    path = tracking_uri[len(prefix) :].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return str(Path(path).resolve().parent / ARTIFACTS_DIR)


def end_status(error: BaseException | None) -> str:
    """The MLflow run status for a body that ended with ``error``: FINISHED, KILLED (Ctrl-C, SIGTERM) or FAILED."""
    if error is None:
        return "FINISHED"
    return "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED"


def git_commit(folder: str | Path | None = None) -> tuple[str, bool] | None:
    """(commit, uncommitted changes?) of the git checkout holding ``folder`` (default: this project); None if none."""
    where = str(folder or Path(__file__).resolve().parent)
    try:
        head = subprocess.run(
            ["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (e.g. an installed image)
        return None
    return head, bool(dirty)


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 of a config's canonical JSON (sorted keys): equal configs, equal hashes, whatever the YAML layout."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def source_tags(config: Mapping[str, Any]) -> dict[str, str]:
    """Run tags that say what produced a run: the git commit (MLflow's own tag too), whether the checkout
    had uncommitted changes, and the hash of the validated config."""
    tags = {"config_sha256": config_hash(config)}
    commit = git_commit()
    if commit is not None:
        tags.update(
            {"git_commit": commit[0], "mlflow.source.git.commit": commit[0], "git_dirty": str(commit[1]).lower()}
        )
    return tags


class Tracker:
    """The interface every stage logs through. This base class records nothing."""

    run_id: str | None = None
    tracking_uri: str | None = None
    registry_uri: str | None = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        """End the run unless it was ended already: FINISHED, or FAILED / KILLED with the error."""
        if not self.finished:
            self.finish(end_status(error), f"{type(error).__name__}: {error}" if error is not None else None)

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` was called."""
        return getattr(self, "_status", None) is not None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log (nested) params; nested keys are joined with dots."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log scalar metrics at ``step``; non-finite values are skipped."""

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or a folder."""

    def log_dict(self, data: Any, name: str) -> None:
        """Upload ``data`` as a JSON artifact called ``name``."""

    def log_figure(self, figure: Any, name: str) -> None:
        """Upload a matplotlib figure as a PNG called ``name``."""

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set string tags on the run."""

    def finish(self, status: str = "FINISHED", error: str | None = None) -> None:
        """Close the run (``FAILED`` with an ``error`` tag when a stage failed)."""
        self._status = status

    @contextmanager
    def child(self, name: str) -> Iterator[Tracker]:
        """A nested run for one stage; marked FAILED (KILLED on Ctrl-C / SIGTERM) with the error if the body raises."""
        yield NullTracker()


class NullTracker(Tracker):
    """Tracking turned off: every call is accepted and dropped."""


class MlflowTracker(Tracker):
    """Logs into one MLflow run (created on construction unless ``run_id`` is given).

    ``registry_uri``: where :mod:`components.register` registers the run's models (default: the tracking store).
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str = "star-elastic",
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        artifact_location: str | None = None,
        registry_uri: str | None = None,
    ) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.registry_uri = registry_uri or tracking_uri  # explicit: never a registry left set process-wide
        self.experiment = experiment
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=self.registry_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            location = artifact_location or default_artifact_location(tracking_uri)
            exp_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            exp_id = exp.experiment_id
        self.experiment_id = exp_id
        if run_id is None:
            tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
            run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
            run_id = run.info.run_id
        self.run_id = run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None and math.isfinite(float(v))
        ]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def log_dict(self, data: Any, name: str) -> None:
        self.client.log_dict(self.run_id, data, name)

    def log_figure(self, figure: Any, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, os.path.basename(name))
            figure.savefig(out, dpi=110, bbox_inches="tight")
            sub = os.path.dirname(name) or None
            self.client.log_artifact(self.run_id, out, sub)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))

    def finish(self, status: str = "FINISHED", error: str | None = None) -> None:
        if error:
            self.client.set_tag(self.run_id, "error", error[:5000])
        self.client.set_terminated(self.run_id, status=status)
        self._status = status

    @contextmanager
    def child(self, name: str) -> Iterator[Tracker]:
        sub = MlflowTracker(
            self.tracking_uri, self.experiment, run_name=name, parent_run_id=self.run_id, registry_uri=self.registry_uri
        )
        with sub:
            yield sub

    def end_interrupted(self, tag: str, value: str) -> list[str]:
        """End FAILED every other RUNNING run of this experiment tagged ``tag = value`` (a plain token such as a
        hash), and their RUNNING nested runs, each tagged ``interrupted``; returns the ids of the tagged runs
        ended, newest first.

        Only for a caller that knows no live process still writes to those runs (the pipeline holds the
        lock of its run folder): a process killed with SIGKILL, or a preempted node, never ends its runs.
        """
        if "'" in value or "\\" in value:
            raise ValueError(f"end_interrupted: tag value {value!r} must not hold quotes or backslashes")
        found = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.{tag} = '{value}' and attributes.status = 'RUNNING'",
            order_by=["attributes.start_time DESC"],
        )
        ended = []
        for run in found:
            if run.info.run_id == self.run_id:
                continue
            children = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}' and attributes.status = 'RUNNING'",
            )
            for victim in [*children, run]:
                note = f"interrupted: its process ended without closing it; found by run {self.run_id}"
                self.client.set_tag(victim.info.run_id, "interrupted", note)
                self.client.set_terminated(victim.info.run_id, status="FAILED")
            ended.append(run.info.run_id)
        return ended


def make_tracker(tracking_uri: str | None, experiment: str, run_name: str | None = None) -> Tracker:
    """An :class:`MlflowTracker` in the store :func:`components.settings.mlflow_store` picks (``tracking_uri``,
    else ``MLFLOW_TRACKING_URI``), or a null one when neither names a store."""
    from components.settings import mlflow_store

    store = mlflow_store(tracking_uri)
    if store is None:
        return NullTracker()
    return MlflowTracker(store.tracking_uri, experiment, run_name=run_name, registry_uri=store.registry_uri)


def tracker_for_worker(
    tracking_uri: str | None, run_id: str | None, experiment: str, registry_uri: str | None = None
) -> Tracker:
    """Re-attach to the driver's run from a Ray worker (rank 0 logs; others pass ``None``)."""
    if not tracking_uri or not run_id:
        return NullTracker()
    return MlflowTracker(tracking_uri, experiment, run_id=run_id, registry_uri=registry_uri)
