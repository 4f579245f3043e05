"""Experiment tracking: an MLflow tracker and a do-nothing stand-in with the same methods.

Stages receive a :class:`Tracker`; they never reach for a global MLflow run. The
MLflow implementation talks through ``MlflowClient`` with explicit run ids, so a
Ray worker can log into the run its driver created (pass ``tracking_uri`` and
``run_id``), and nested stage runs hang under one pipeline run.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_MAX_PARAM_LEN = 6000


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


class Tracker:
    """The interface every stage logs through. This base class records nothing."""

    run_id: str | None = None
    tracking_uri: str | None = None

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

    @contextmanager
    def child(self, name: str) -> Iterator[Tracker]:
        """A nested run for one stage; marked FAILED (with the error) if the body raises."""
        yield NullTracker()


class NullTracker(Tracker):
    """Tracking turned off: every call is accepted and dropped."""


class MlflowTracker(Tracker):
    """Logs into one MLflow run (created on construction unless ``run_id`` is given)."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str = "star-elastic",
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        artifact_location: str | None = None,
    ) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.client = MlflowClient(tracking_uri=tracking_uri)
        mlflow.set_tracking_uri(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            exp_id = self.client.create_experiment(experiment, artifact_location=artifact_location)
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

    @contextmanager
    def child(self, name: str) -> Iterator[Tracker]:
        sub = MlflowTracker(self.tracking_uri, self.experiment, run_name=name, parent_run_id=self.run_id)
        try:
            yield sub
        except BaseException as err:
            sub.finish("FAILED", f"{type(err).__name__}: {err}")
            raise
        sub.finish("FINISHED")


def make_tracker(tracking_uri: str | None, experiment: str, run_name: str | None = None) -> Tracker:
    """An :class:`MlflowTracker` when a tracking URI is set (argument or ``MLFLOW_TRACKING_URI``), else a null one."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return NullTracker()
    return MlflowTracker(uri, experiment, run_name=run_name)


def tracker_for_worker(tracking_uri: str | None, run_id: str | None, experiment: str) -> Tracker:
    """Re-attach to the driver's run from a Ray worker (rank 0 logs; others pass ``None``)."""
    if not tracking_uri or not run_id:
        return NullTracker()
    return MlflowTracker(tracking_uri, experiment, run_id=run_id)
