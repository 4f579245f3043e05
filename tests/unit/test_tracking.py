"""Run lifecycle and artifact placement of the MLflow tracker, against a real SQLite store."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from components.tracking import MlflowTracker, NullTracker, config_hash, default_artifact_location, source_tags


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SQLite tracking URI under ``<tmp>/runs`` shared by the module (creating a store takes seconds);
    the working directory is an empty ``<tmp>/cwd`` meanwhile."""
    root = tmp_path_factory.mktemp("tracking")
    (root / "runs").mkdir()
    (root / "cwd").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root / "cwd")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield f"sqlite:///{root / 'runs' / 'mlflow.db'}"


def _run(tracker: MlflowTracker, run_id: str | None = None):
    return tracker.client.get_run(run_id or tracker.run_id)


def test_default_artifact_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert default_artifact_location("sqlite:////data/ml/mlflow.db") == "/data/ml/mlartifacts"
    assert default_artifact_location("sqlite:///runs/mlflow.db") == str(tmp_path / "runs" / "mlartifacts")
    assert default_artifact_location("sqlite:///runs/mlflow.db?timeout=20") == str(tmp_path / "runs" / "mlartifacts")
    assert default_artifact_location("sqlite://") is None
    assert default_artifact_location("sqlite:///:memory:") is None
    assert default_artifact_location("http://127.0.0.1:5000") is None
    assert default_artifact_location("file:///tmp/mlruns") is None


def test_artifacts_land_beside_the_store_not_in_the_working_directory(store, tmp_path):
    note = tmp_path / "note.txt"
    note.write_text("hello")
    with MlflowTracker(store, "placement", run_name="p") as tracker:
        tracker.log_artifact(note, "notes")
    run = _run(tracker)
    runs = Path(store.removeprefix("sqlite:///")).parent
    assert run.info.artifact_uri.startswith(str(runs / "mlartifacts") + "/")
    assert (Path(run.info.artifact_uri) / "notes" / "note.txt").read_text() == "hello"
    assert list(Path.cwd().iterdir()) == []  # no ./mlruns, no ./mlflow.db


def test_context_ends_the_run_finished(store):
    with MlflowTracker(store, "life", run_name="ok") as tracker:
        tracker.log_metrics({"x": 1.0})
    run = _run(tracker)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags


def test_an_exception_ends_the_run_failed_with_the_error(store):
    with pytest.raises(RuntimeError), MlflowTracker(store, "life", run_name="bad") as tracker:
        raise RuntimeError("ray did not start")
    run = _run(tracker)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "RuntimeError: ray did not start"


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(15)])
def test_ctrl_c_and_sigterm_end_the_run_killed(store, error):
    with pytest.raises(type(error)), MlflowTracker(store, "life", run_name="killed") as tracker:
        raise error
    assert _run(tracker).info.status == "KILLED"


def test_an_explicit_finish_is_kept(store):
    with MlflowTracker(store, "life", run_name="stage-failed") as tracker:
        tracker.finish("FAILED", "stage 'rank' failed: ValueError: x")
    run = _run(tracker)
    assert run.info.status == "FAILED" and run.data.tags["error"] == "stage 'rank' failed: ValueError: x"


def test_a_failing_child_fails_itself_and_its_parent(store):
    parent = MlflowTracker(store, "life", run_name="parent")
    with pytest.raises(ValueError), parent, parent.child("rank") as child:
        child.log_metrics({"loss": 2.0})
        raise ValueError("no calibration data")
    kid = _run(parent, child.run_id)
    assert kid.info.status == "FAILED" and kid.data.tags["error"] == "ValueError: no calibration data"
    assert kid.data.tags["mlflow.parentRunId"] == parent.run_id
    assert _run(parent).info.status == "FAILED"


def test_null_tracker_is_a_context_too():
    with NullTracker() as tracker:
        pass
    assert tracker.finished


def test_source_tags():
    config = {"run_name": "demo", "elastic": {"budgets": [{"name": "full", "fraction": 1.0}]}}
    tags = source_tags(config)
    # sha256 of '{"elastic": {"budgets": [{"fraction": 1.0, "name": "full"}]}, "run_name": "demo"}'
    assert tags["config_sha256"] == "3ae2e214bdf7c3cce77716231b1b00d4163ba838d40121f29c4cac3719fc5bdc"
    assert config_hash({"b": 1, "a": [1, 2]}) == config_hash({"a": [1, 2], "b": 1})
    if "git_commit" in tags:  # a git checkout (an installed copy has none)
        assert re.fullmatch(r"[0-9a-f]{40}", tags["git_commit"])
        assert tags["mlflow.source.git.commit"] == tags["git_commit"]
        assert tags["git_dirty"] in ("true", "false")


@pytest.mark.parametrize("dry_run", [False, True])
def test_an_unknown_only_stage_fails_before_any_run_exists(tmp_path, monkeypatch, dry_run):
    from pipelines.run import run_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # the demo config names the shipped parent relative to the repository
    config = root / "pipelines" / "configs" / "demo.yaml"
    with pytest.raises(ValueError, match=r"--only: unknown stages \['nosuchstage'\]; stages are \['parent', "):
        run_pipeline(str(config), overrides=[f"runs_dir={tmp_path}"], dry_run=dry_run, only=["nosuchstage"])
    assert not (tmp_path / "mlflow.db").exists()  # no run was created, so none can be left RUNNING
