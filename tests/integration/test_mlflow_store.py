"""Which MLflow store a run uses when the YAML names one and ``MLFLOW_TRACKING_URI`` names another.

The documented rule (:mod:`components.settings`, README "Where settings come from"): the config's
``tracking_uri`` wins. The pipeline logs its run and its stage runs there, the register stage logs and
registers its model there, ``models:/`` resolves there, and the store the environment names is never
touched (its SQLite file is never even created). Real SQLite stores in temporary folders.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from components.model_uri import resolve_model_uri
from components.register import RegisterConfig, run_register
from components.tracking import MlflowTracker
from pipelines.cli import main
from pipelines.config import load_pipeline_config
from tests.integration.conftest import build_tiny_nested_checkpoint

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "pipelines" / "configs" / "demo.yaml"


@pytest.fixture
def two_stores(tmp_path, monkeypatch) -> tuple[str, Path, str, Path]:
    """(YAML store URI, its file, environment store URI, its file); the environment names the second."""
    (tmp_path / "yaml").mkdir()
    (tmp_path / "env").mkdir()
    yaml_db, env_db = tmp_path / "yaml" / "mlflow.db", tmp_path / "env" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{env_db}")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.chdir(REPO)  # the demo config names the shipped parent relative to the repository
    return f"sqlite:///{yaml_db}", yaml_db, f"sqlite:///{env_db}", env_db


def test_a_pipeline_run_logs_in_the_yaml_store(ray_runtime, two_stores, tmp_path):
    yaml_uri, yaml_db, env_uri, env_db = two_stores
    overrides = [f"runs_dir={tmp_path / 'runs'}", f"tracking_uri={yaml_uri}", "experiment=store-rule"]
    assert main(["run", str(DEMO), "--only", "parent", *(a for o in overrides for a in ("--set", o))]) == 0

    client = MlflowClient(yaml_uri, registry_uri=yaml_uri)
    runs = client.search_runs([client.get_experiment_by_name("store-rule").experiment_id])
    stages = {r.data.tags.get("stage") for r in runs}
    assert len(runs) == 2 and stages == {None, "parent"}  # the pipeline's run and its parent stage's run
    assert not env_db.exists()
    assert os.environ["MLFLOW_TRACKING_URI"] == env_uri  # nothing was written back to the environment


def test_the_register_stage_logs_and_registers_in_the_yaml_store(two_stores, tmp_path):
    yaml_uri, yaml_db, env_uri, env_db = two_stores
    cfg = load_pipeline_config(DEMO, [f"runs_dir={tmp_path / 'runs'}", f"tracking_uri={yaml_uri}"])
    store = cfg.mlflow_store()
    assert (store.tracking_uri, store.registry_uri, store.source) == (yaml_uri, yaml_uri, "config")

    nested = build_tiny_nested_checkpoint(tmp_path / "ckpt")
    budgets = [{"name": name, "accuracy": 0.5} for name in ("full", "medium", "small")]
    register = RegisterConfig(model_name="store-rule", checkpoint_uri=str(nested), budgets=budgets)
    pipeline = MlflowTracker(store.tracking_uri, cfg.experiment, run_name="pipeline", registry_uri=store.registry_uri)
    with pipeline, pipeline.child("register") as stage:  # as the runner hands the stage its tracker
        out = run_register(register, stage)
    assert out["registered"] and out["promoted"]

    client = MlflowClient(yaml_uri, registry_uri=yaml_uri)
    version = client.get_model_version_by_alias("store-rule", "champion")
    assert version.run_id == stage.run_id and client.get_run(stage.run_id).data.tags["model_version"] == "1"
    assert (resolve_model_uri("models:/store-rule@champion", yaml_uri, tmp_path / "dl") / "config.json").is_file()
    assert not env_db.exists()
    assert os.environ["MLFLOW_TRACKING_URI"] == env_uri  # the scoped process-wide URI was put back
    assert mlflow.get_tracking_uri() == env_uri and mlflow.get_registry_uri() == env_uri
