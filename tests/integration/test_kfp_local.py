"""The compiled Kubeflow pipeline, executed here by kfp's local runner with ``executor="local"``.

Each task runs in its own subprocess, as in a pod: the step component builds the config from the
config parameters (one per top-level key; the run overrides ``run_name``), runs its stage through
the pipeline runner and returns the stage's URI, which the downstream tasks receive as inputs. The
stage list is the three quick stages below (this file, loaded by path through the ``stages_module``
parameter); ``c`` depends on both ``a`` and ``b`` so that a task with two upstream inputs is
covered. MLflow is off (``tracking=False``): starting a SQLite store in every task would dominate
the run time, and tracking is the same code as ``star-elastic run``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from pipelines.runner import MARKER, StageSpec

pytestmark = pytest.mark.integration


class _Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    upstream: list[str]
    threads: int  # any config value: changing it changes every stage's key


def _builder(depends: list[str]):
    def build(ctx) -> BaseModel:
        return _Cfg(upstream=[str((ctx.dir(d) / "out.txt").resolve()) for d in depends], threads=ctx.pipeline.threads)

    return build


def _run(cfg: _Cfg, tracker, ctx) -> dict[str, Any]:
    text = "".join(Path(p).read_text() for p in cfg.upstream) + f"{ctx.name};"
    (ctx.dir() / "out.txt").write_text(text)
    return {"text": text}


def pipeline_stages() -> list[StageSpec]:
    graph = {"a": [], "b": ["a"], "c": ["a", "b"]}
    return [StageSpec(name, deps, _builder(deps), _run, f"test stage {name}") for name, deps in graph.items()]


@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")
def test_compiled_pipeline_runs_locally(tmp_path: Path) -> None:
    from kfp import components, local

    from pipelines.kfp_pipeline import compile_pipeline

    run_dir = tmp_path / "runs" / "kfp-local"
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_name": "compiled-name",  # the run below passes run_name: the parameter must win
                "runs_dir": str(tmp_path / "runs"),
                "elastic": {"space": {"hidden": [64, 32]}, "budgets": [{"name": "full", "fraction": 1.0}]},
            }
        )
    )
    package = compile_pipeline(config, tmp_path / "pipeline.yaml", stages_module=str(Path(__file__).resolve()))
    spec = yaml.safe_load(package.read_text())
    assert {t["taskInfo"]["name"] for t in spec["root"]["dag"]["tasks"].values()} == {"a", "b", "c"}
    assert spec["root"]["dag"]["tasks"]["c"]["dependentTasks"] == ["a", "b"]

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    pipeline = components.load_component_from_file(str(package))
    task = pipeline(executor="local", tracking=False, run_name="kfp-local")

    # The pipeline's output is the last stage's URI; every stage ran once, in order, and left its marker.
    assert task.output == str((run_dir / "c").resolve())
    for name in ("a", "b", "c"):
        assert json.loads((run_dir / name / MARKER).read_text())["outputs"]["text"].endswith(f"{name};")
    assert (run_dir / "c" / "out.txt").read_text() == "a;a;b;c;"
    assert json.loads((run_dir / "summary.json").read_text())["stages"]["c"]["text"] == "a;a;b;c;"
    # Each task's output parameter (what the downstream tasks received) is its stage's folder.
    outputs = {
        p.parent.name: json.loads(p.read_text())["parameterValues"]["Output"]
        for p in (tmp_path / "kfp").rglob("executor_output.json")
    }
    assert outputs == {name: str((run_dir / name).resolve()) for name in ("a", "b", "c")}


def test_stages_move_between_machines_through_s3(tmp_path: Path, s3_server: str) -> None:
    """What the RayJob executor relies on: each stage starts on an empty machine, pulls its upstream
    stages from the storage root and publishes its own folder there, marker last."""
    import shutil

    import boto3

    from pipelines.kfp_components import run_stage_only

    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_name": "s3",
                "runs_dir": str(tmp_path / "runs"),
                "storage_uri": "s3://test-bucket/kfp",
                "elastic": {"space": {"hidden": [64, 32]}, "budgets": [{"name": "full", "fraction": 1.0}]},
            }
        )
    )
    quiet = {"stages_module": str(Path(__file__).resolve()), "tracking": False, "log": lambda s: None}
    uris: dict[str, str] = {}
    for name, deps in {"a": [], "b": ["a"], "c": ["a", "b"]}.items():
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)  # a fresh cluster for every stage
        result = run_stage_only(config, name, upstream=[uris[d] for d in deps], **quiet)
        assert result.status == "ran"
        uris[name] = result.uri
    assert uris["c"] == "s3://test-bucket/kfp/s3/c"
    s3 = boto3.client("s3", endpoint_url=s3_server)
    body = s3.get_object(Bucket="test-bucket", Key="kfp/s3/c/out.txt")["Body"].read().decode()
    assert body == "a;a;b;c;"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="test-bucket", Prefix="kfp/s3/")["Contents"]}
    assert {f"kfp/s3/{n}/{MARKER}" for n in "abc"} <= keys
    # A retried step on a fresh machine finds its stage published and current: nothing runs again.
    shutil.rmtree(tmp_path / "runs")
    again = run_stage_only(config, "c", upstream=[uris["a"], uris["b"]], **quiet)
    assert again.status == "cached" and again.outputs["text"] == "a;a;b;c;"
    # A changed config re-runs every stage; republishing drops files an older run of the stage left.
    s3.put_object(Bucket="test-bucket", Key="kfp/s3/c/stale.bin", Body=b"old")
    for name, deps in {"a": [], "b": ["a"], "c": ["a", "b"]}.items():
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
        assert run_stage_only(config, name, ["threads=3"], upstream=[uris[d] for d in deps], **quiet).status == "ran"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="test-bucket", Prefix="kfp/s3/c/")["Contents"]}
    assert keys == {"kfp/s3/c/out.txt", f"kfp/s3/c/{MARKER}"}
