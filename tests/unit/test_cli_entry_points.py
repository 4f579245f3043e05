"""One command line: everything a user runs goes through ``star-elastic``.

The distribution installs that one command, its subcommands do the work (compile the Kubeflow pipeline,
run one stage as a step, print the RBAC, render the manifests, plan), and no module of the package does
anything when run as a script. The tiny two-stage list of ``test_kfp_compile`` (loaded by path) stands in
for the project's stages where a stage is run.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from pipelines.cli import main
from tests.helpers import write_tiny_pipeline_config

REPO = Path(__file__).resolve().parents[2]
TINY_STAGES = str(REPO / "tests" / "unit" / "test_kfp_compile.py")


def _subcommands(entry, argv: list[str], capsys) -> set[str]:
    """The subcommands ``entry`` offers after ``argv``, read from its ``--help`` as a user reads them."""
    with pytest.raises(SystemExit) as done:
        entry([*argv, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    return set(re.search(r"\{([^}]+)\}", usage).group(1).split(","))


def test_the_console_script_is_the_one_command_and_offers_every_subcommand(capsys) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert list(scripts) == ["star-elastic"]
    module, _, attr = scripts["star-elastic"].partition(":")
    entry = getattr(importlib.import_module(module), attr)
    assert entry is main
    assert {"run", "rank", "parent", "serve", "extract", "plan", "kfp", "kuberay"} <= _subcommands(entry, [], capsys)
    assert _subcommands(entry, ["kfp"], capsys) == {"compile", "rbac", "run-stage"}
    assert _subcommands(entry, ["kuberay"], capsys) == {"rayservice", "render"}


# Runs every module of pipelines/ and components/ as ``python -m`` would (``__name__ == "__main__"``, asked
# for --help) in a fresh interpreter, and prints the ones that answered: exited or wrote to stdout.
_RUN_AS_SCRIPTS = """
import contextlib, io, json, runpy, sys, warnings
answered = {}
for name in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runpy.run_module(name, run_name="__main__")
    except SystemExit as exit_:
        answered[name] = f"exit {exit_.code}"
    if out.getvalue():
        answered[name] = answered.get(name, "") + " printed " + out.getvalue()[:60]
sys.__stdout__.write(json.dumps(answered))
"""


def test_no_module_but_the_cli_does_anything_as_a_script() -> None:
    modules = [
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for folder in ("pipelines", "components")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.name != "__init__.py"
    ]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_AS_SCRIPTS, *modules], cwd=REPO, capture_output=True, text=True, check=True
    )
    answered = json.loads(done.stdout)
    assert answered.pop("pipelines.cli").startswith("exit 0 printed usage: star-elastic")  # `python -m` of the CLI
    assert answered == {}, "modules that act as a second entry point (use a star-elastic subcommand)"


def test_kfp_compile_writes_the_pipeline_for_the_cluster_asked_for(tmp_path: Path) -> None:
    """``--cluster real --registry R --namespace N``: every step runs the real cluster's CUDA image from ``R``,
    in namespace ``N``, with autoscaling."""
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


def test_kfp_run_stage_runs_one_stage_from_its_upstream_uris(tmp_path: Path, capsys) -> None:
    """What a step runs: one stage alone, its inputs from ``--upstream`` URIs, its folder published under
    ``--storage-uri``, its URI printed; an upstream with no finished output is exit status 2."""
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
    """``--check`` compares a fresh rendering with the committed files; writing is covered in ``test_manifests``."""
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
