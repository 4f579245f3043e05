"""The settings the environment gives: read in one module, one precedence rule for the MLflow store, never
written back to the environment."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import pytest

from components.settings import MlflowStore, S3Settings, cache_dir, from_environment, mlflow_store
from model.decode.kernels import default_cache_file
from pipelines.config import load_pipeline_config

DEMO = Path(__file__).resolve().parents[2] / "pipelines" / "configs" / "demo.yaml"


def test_the_environment_is_read_into_one_frozen_object():
    env = {
        "MLFLOW_TRACKING_URI": "http://env:5000",
        "STAR_ELASTIC_CACHE": "/data/cache",
        "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "eu-west-1",
        "AWS_MAX_ATTEMPTS": "7",
        "AWS_RETRY_MODE": "",  # empty: unset
    }
    settings = from_environment(env)
    assert settings.mlflow_tracking_uri == "http://env:5000" and settings.mlflow_registry_uri is None
    assert settings.cache_dir == Path("/data/cache")
    s3 = settings.s3
    assert (s3.endpoint_url, s3.access_key_id, s3.secret_access_key, s3.region) == (
        "http://minio:9000", "key", "secret", "eu-west-1",
    )  # fmt: skip
    assert (s3.max_attempts, s3.retry_mode) == (7, "standard")
    assert "secret" not in repr(settings)  # credentials never printed
    with pytest.raises(ValueError, match="frozen"):
        settings.cache_dir = Path("/elsewhere")  # type: ignore[misc]
    assert from_environment({"AWS_ENDPOINT_URL_S3": "http://s3", "AWS_ENDPOINT_URL": "http://x"}).s3.endpoint_url == (
        "http://s3"
    )
    with pytest.raises(ValueError, match="AWS_MAX_ATTEMPTS='many': expected a whole number"):
        from_environment({"AWS_MAX_ATTEMPTS": "many"})


def test_the_cache_folder_rule(monkeypatch):
    monkeypatch.setenv("STAR_ELASTIC_CACHE", "/from/env")
    assert cache_dir("/explicit") == Path("/explicit")
    assert cache_dir() == Path("/from/env")
    assert default_cache_file() == Path("/from/env/decode-kernels.json")  # the model layer's cache, same folder
    monkeypatch.setenv("STAR_ELASTIC_CACHE", "")  # empty: unset
    assert cache_dir() == Path.home() / ".cache" / "star-elastic"
    monkeypatch.delenv("STAR_ELASTIC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "star-elastic"
    assert default_cache_file().parent == cache_dir()


def test_an_explicit_store_wins_over_the_environment_which_wins_over_the_default():
    env = from_environment({"MLFLOW_TRACKING_URI": "http://env:5000", "MLFLOW_REGISTRY_URI": "http://reg:5000"})
    explicit = mlflow_store("sqlite:///yaml.db", default="sqlite:///default.db", settings=env)
    assert (explicit.tracking_uri, explicit.registry_uri, explicit.source) == (
        "sqlite:///yaml.db", "sqlite:///yaml.db", "config",
    )  # fmt: skip  # the environment's registry belongs to the environment's store
    fromenv = mlflow_store(None, default="sqlite:///default.db", settings=env)
    assert (fromenv.tracking_uri, fromenv.registry_uri, fromenv.source) == (
        "http://env:5000", "http://reg:5000", "environment",
    )  # fmt: skip
    default = mlflow_store(None, default="sqlite:///default.db", settings=from_environment({}))
    assert (default.tracking_uri, default.registry_uri, default.source) == (
        "sqlite:///default.db", "sqlite:///default.db", "default",
    )  # fmt: skip
    assert mlflow_store(None, settings=from_environment({})) is None  # no store anywhere: tracking off


def test_the_pipeline_config_follows_the_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    runs = f"runs_dir={tmp_path}"
    assert load_pipeline_config(DEMO, [runs, "tracking_uri=sqlite:///y.db"]).mlflow_store().tracking_uri == (
        "sqlite:///y.db"
    )
    assert load_pipeline_config(DEMO, [runs]).mlflow_store().tracking_uri == "http://env:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert load_pipeline_config(DEMO, [runs]).mlflow_store().tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.mark.parametrize("before", [None, "http://env:5000"])
def test_a_process_wide_store_is_scoped_and_the_environment_restored(before, monkeypatch):
    if before is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", before)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    outside = mlflow.get_tracking_uri()
    with MlflowStore.of("sqlite:///scoped.db").process_wide():
        assert mlflow.get_tracking_uri() == "sqlite:///scoped.db" == mlflow.get_registry_uri()
    assert os.environ.get("MLFLOW_TRACKING_URI") == before and "MLFLOW_REGISTRY_URI" not in os.environ
    assert mlflow.get_tracking_uri() == outside


def test_s3_clients_take_the_settings_and_write_nothing_to_the_environment(monkeypatch):
    from components.distill.ckpt import storage_target
    from components.storage import s3_client

    for name in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    s3 = S3Settings(endpoint_url="http://127.0.0.1:9", access_key_id="k", secret_access_key="s", region="eu-west-1")
    client = s3_client(s3)
    assert client.meta.endpoint_url == "http://127.0.0.1:9" and client.meta.region_name == "eu-west-1"
    assert client._request_signer._credentials.access_key == "k"
    path, fs = storage_target("s3://bucket/run/ray", s3)
    assert path == "bucket/run/ray" and fs is not None
    assert dict(os.environ) == before
    assert s3.checksum_env() == {
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }
    assert S3Settings().checksum_env() == {}  # real AWS needs nothing
    assert storage_target("s3://bucket/run/ray", S3Settings()) == ("s3://bucket/run/ray", None)
