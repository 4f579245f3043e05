"""One command line: everything a user runs goes through ``star-elastic``.

Each former ``python -m`` entry point (``pipelines.kfp_pipeline``, ``pipelines.kfp_components``,
``components.kuberay``) is gone, and what it did works through a ``star-elastic`` subcommand with
the same options. The tiny two-stage list of ``test_kfp_compile`` (loaded by path) stands in for the
project's stages where a stage is run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import tomllib
from pathlib import Path

import pytest
import yaml

from pipelines.cli import build_parser, main
from tests.helpers import write_tiny_pipeline_config

REPO = Path(__file__).resolve().parents[2]
TINY_STAGES = str(REPO / "tests" / "unit" / "test_kfp_compile.py")


def test_the_console_script_is_the_only_entry_point() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"star-elastic": "pipelines.cli:main"}
    assert importlib.util.find_spec("components.kuberay") is None  # manifests are not a pipeline stage
    for name in ("pipelines.kfp_pipeline", "pipelines.kfp_components", "pipelines.kuberay.render"):
        module = importlib.import_module(name)
        assert not hasattr(module, "main") and "__main__" not in inspect.getsource(module), name
    commands = build_parser()._subparsers._group_actions[0].choices  # argparse keeps the subcommands there
    kfp = commands["kfp"]._subparsers._group_actions[0].choices
    kuberay = commands["kuberay"]._subparsers._group_actions[0].choices
    assert sorted(kfp) == ["compile", "rbac", "run-stage"]
    assert sorted(kuberay) == ["rayservice", "render"]


def test_kfp_compile_takes_every_option_of_the_former_module(tmp_path: Path) -> None:
    """Was ``python -m pipelines.kfp_pipeline CONFIG --out P --cluster real --registry R --namespace N``."""
    out = tmp_path / "real-pipeline.yaml"
    config = REPO / "pipelines" / "configs" / "demo.yaml"
    args = ["kfp", "compile", str(config), "--out", str(out), "--cluster", "real"]
    assert main([*args, "--registry", "ghcr.io/acme", "--namespace", "ml"]) == 0
    spec = yaml.safe_load(out.read_text())
    cluster = json.loads(spec["root"]["inputDefinitions"]["parameters"]["cluster"]["defaultValue"])
    assert cluster["namespace"] == "ml" and cluster["image"].startswith("ghcr.io/acme/star-elastic:")
    assert cluster["image"].endswith("-cuda") and cluster["autoscaling"] is True  # the real cluster
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == {cluster["image"]}


def test_kfp_run_stage_runs_a_stage_as_the_former_module_did(tmp_path: Path, capsys) -> None:
    """Was ``python -m pipelines.kfp_components STAGE --config ... --storage-uri ... --upstream ...``."""
    store = tmp_path / "store"
    config = write_tiny_pipeline_config(tmp_path)
    common = ["--stages-module", TINY_STAGES, "--no-tracking", "--storage-uri", str(store)]
    assert main(["kfp", "run-stage", "first", "--config", str(config), *common]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first == {"stage": "first", "status": "ran", "uri": f"{store}/tiny/first"}
    # --set overrides the config as for `run`; the stage runs under the overridden run name.
    renamed = ["--set", "run_name=other", "--upstream", f"{store}/other/first"]
    assert main(["kfp", "run-stage", "second", "--config", str(config), *common, *renamed]) == 2
    assert "no finished output" in capsys.readouterr().err
    args = ["kfp", "run-stage", "second", "--config", str(config), *common, "--upstream", first["uri"]]
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["uri"] == f"{store}/tiny/second"
    assert (store / "tiny" / "second" / "out.txt").read_text() == "first;second;"


def test_kfp_run_stage_reads_an_inline_config_in_its_workdir(tmp_path: Path, capsys, monkeypatch) -> None:
    """How a RayJob runs it: the config inline as base64, relative paths resolved in ``--workdir``."""
    import base64

    text = yaml.safe_dump(
        {
            "run_name": "inline",
            "runs_dir": "runs",
            "elastic": {"space": {"hidden": [64, 32]}, "budgets": [{"name": "full", "active": 1.0}]},
        }
    )
    workdir = tmp_path / "app"
    workdir.mkdir()
    monkeypatch.chdir(tmp_path)  # the command changes to --workdir; monkeypatch restores the folder after
    b64 = base64.b64encode(text.encode()).decode()
    args = ["kfp", "run-stage", "first", "--config-b64", b64, "--workdir", str(workdir)]
    assert main([*args, "--stages-module", TINY_STAGES, "--no-tracking"]) == 0
    uri = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["uri"]
    assert uri == str((workdir / "runs" / "inline" / "first").resolve())


def test_kfp_rbac_prints_the_role_and_binding(capsys) -> None:
    from pipelines.kfp_pipeline import rbac_yaml

    assert main(["kfp", "rbac"]) == 0
    assert capsys.readouterr().out == rbac_yaml()
    args = ["--namespace", "ml", "--service-account", "default-editor", "--service-account-namespace", "team"]
    assert main(["kfp", "rbac", *args]) == 0
    role, binding = yaml.safe_load_all(capsys.readouterr().out)
    assert role["metadata"]["namespace"] == "ml"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "default-editor", "namespace": "team"}]


@pytest.mark.parametrize("args", [["--check", "infra/k8s"], ["--check"]])
def test_kuberay_render_checks_the_committed_manifests(args: list[str], monkeypatch) -> None:
    """Was ``python -m components.kuberay [OUT_DIR] --check``; writing is covered in ``test_manifests``."""
    monkeypatch.chdir(REPO)
    assert main(["kuberay", "render", *args]) == 0


def test_parent_train_refuses_a_bad_section_in_one_line_at_its_yaml_path(tmp_path: Path, capsys) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump({"parent": {"train": {"stepz": 3, "lr": -1}}, "elastic": {}}))
    assert main(["parent", "train", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "parent.train.lr: Input should be greater than 0, got -1",
        "parent.train.stepz: unknown key; did you mean 'steps'?",
    ]
    assert not (tmp_path / "out").exists()
