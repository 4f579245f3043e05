"""Where ``models:/`` URIs resolve: the URI forms, and the default store that is never created."""

from __future__ import annotations

import pytest

from components.model_uri import parse_models_uri, registry_tracking_uri


def test_models_uri_forms():
    assert parse_models_uri("models:/star-elastic@champion") == ("star-elastic", "champion", None)
    assert parse_models_uri("models:/star-elastic@champion-fp8") == ("star-elastic", "champion-fp8", None)
    assert parse_models_uri("models:/star-elastic/7") == ("star-elastic", None, "7")
    assert parse_models_uri("models:/star-elastic/latest") == ("star-elastic", None, "latest")
    for bad in ("models:/", "models:/x", "models:/x/", "models:/@a", "models:/x@", "models:/x/y/z", "runs:/r/model"):
        with pytest.raises(ValueError, match="not a models:/NAME@ALIAS or models:/NAME/VERSION URI"):
            parse_models_uri(bad)


def test_explicit_uri_and_environment_win(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert registry_tracking_uri("http://other:5000", tmp_path) == "http://other:5000"
    assert registry_tracking_uri(None, tmp_path) == "http://mlflow:5000"


def test_default_is_the_pipelines_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mlflow.db").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert registry_tracking_uri() == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"


def test_a_missing_default_store_is_an_error_and_is_not_created(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FileNotFoundError, match="MLFLOW_TRACKING_URI is unset and the pipeline's store .*runs/mlflow.db"
    ):
        registry_tracking_uri()
    assert list(tmp_path.iterdir()) == []


def test_serve_with_no_store_fails_in_one_line_before_ray(tmp_path, monkeypatch, capsys):
    from pipelines.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "models:/star-elastic-demo@champion"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("star-elastic: error: no MLflow tracking store for models:/ URIs")
    assert list(tmp_path.iterdir()) == []  # no stray ./mlflow.db


def test_serve_finds_the_model_in_the_pipelines_store(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    from pipelines.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    client = MlflowClient(store, registry_uri=store)  # never a registry another test left set process-wide
    client.create_registered_model("star-elastic-demo")
    capsys.readouterr()  # MLflow's own lines from creating the store
    assert main(["serve", "models:/star-elastic-demo@champion"]) == 2
    assert main(["serve", "models:/other@champion"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "star-elastic: error: models:/star-elastic-demo@champion: registered model 'star-elastic-demo' has no alias "
        "'champion' (aliases: none); the promotion gate may have rejected every version (see each version's "
        "'promotion' tag)",
        f"star-elastic: error: models:/other@champion: no registered model 'other' at sqlite:///{tmp_path}/runs/"
        "mlflow.db; it has ['star-elastic-demo']",
    ]
