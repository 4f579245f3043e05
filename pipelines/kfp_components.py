"""Run one stage of the pipeline by itself: what a Kubeflow step (or the RayJob it submits) executes.

:func:`run_stage_only` is the :class:`~pipelines.runner.PipelineRunner` of ``star-elastic run``
restricted to one stage, so its input-keyed marker decides whether it runs. With a storage root a
stage pulls its upstream folders first and publishes its own when done, marker last. Nothing heavy
is imported at module level.

Design notes: docs/kubernetes.md ("One stage per step").
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.runner import MARKER, PipelineRunner, StageContext, StageFailed, StageSpec, topological

DEFAULT_STAGES_MODULE = "pipelines.stages"
# MLflow tag naming the Kubeflow run a parent run belongs to.
RUN_KEY_TAG = "star_elastic.pipeline_run"


@dataclass
class StageRun:
    """The result of :func:`run_stage_only`: what happened and where the stage's folder lives."""

    stage: str
    status: str  # "ran" or "cached"
    uri: str
    outputs: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- stage lists and URIs
def load_stages(module: str = DEFAULT_STAGES_MODULE) -> list[StageSpec]:
    """``pipeline_stages()`` of a dotted module name or of a ``.py`` file (test-only stage lists)."""
    if module.endswith(".py"):
        path = Path(module).resolve()
        name = "star_elastic_stages_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot import stages from {path}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # dataclasses and pydantic look the module up while it executes
            spec.loader.exec_module(mod)
        mod = sys.modules[name]
    else:
        mod = importlib.import_module(module)
    if not hasattr(mod, "pipeline_stages"):
        raise ValueError(f"stages module {module!r} defines no pipeline_stages()")
    return list(mod.pipeline_stages())


def upstream_closure(stages: Sequence[StageSpec], stage: str) -> list[str]:
    """Every stage ``stage`` depends on, directly or not, in run order."""
    by_name = {s.name: s for s in stages}
    if stage not in by_name:
        raise ValueError(f"unknown stage {stage!r}; stages are {[s.name for s in stages]}")
    needed: set[str] = set()
    todo = list(by_name[stage].depends)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(by_name[name].depends)
    return [s.name for s in topological(stages) if s.name in needed]


def stage_uri(root: str | None, run_dir: Path, run_name: str, stage: str) -> str:
    """Where a stage's folder is published: ``<root>/<run_name>/<stage>``, or the local folder without a root."""
    if root:
        return f"{root.rstrip('/')}/{run_name}/{stage}"
    return str((run_dir / stage).resolve())


def _stage_of(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def check_upstream(stages: Sequence[StageSpec], stage: str, upstream: Iterable[str]) -> dict[str, str]:
    """Map the upstream URIs a step received to stage names; they must be exactly the stage's dependencies."""
    by_name = {s.name: s for s in stages}
    if stage not in by_name:
        raise ValueError(f"unknown stage {stage!r}; stages are {list(by_name)}")
    received = {_stage_of(uri): uri for uri in upstream}
    expected = set(by_name[stage].depends)
    if set(received) != expected:
        raise ValueError(
            f"stage {stage!r} received upstream {sorted(received)} but depends on {sorted(expected)}; "
            "the compiled pipeline is older than the stage list: recompile it"
        )
    return received


def sanitize_run_key(run_key: str) -> str:
    """Keep a run id usable as a label value and inside an MLflow filter (no quotes, at most 63 chars)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", run_key).strip("-._")[:63]


# ---------------------------------------------------------------------- storage sync
def _marker_at(uri: str) -> dict[str, Any] | None:
    from components.storage import is_s3, s3_client, split_s3

    if not is_s3(uri):
        path = Path(uri) / MARKER
        return json.loads(path.read_text()) if path.is_file() else None
    from botocore.exceptions import ClientError

    bucket, prefix = split_s3(uri)
    try:
        body = s3_client().get_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/{MARKER}")["Body"].read()
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None  # no finished output there (yet)
        raise
    return json.loads(body)


def _local_marker(folder: Path) -> dict[str, Any] | None:
    path = folder / MARKER
    return json.loads(path.read_text()) if path.is_file() else None


def pull_stage(uri: str, folder: Path) -> bool:
    """Make ``folder`` a copy of the finished stage at ``uri``; False when it already was one."""
    from components.storage import is_s3, s3_client, split_s3

    remote = _marker_at(uri)
    if remote is None:
        raise FileNotFoundError(f"upstream stage {folder.name!r} has no finished output at {uri}")
    if _local_marker(folder) == remote:
        return False
    tmp = folder.parent / f".{folder.name}.pull-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if is_s3(uri):
        bucket, prefix = split_s3(uri)
        base = prefix.rstrip("/") + "/"
        client = s3_client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith("/"):
                    continue  # a folder placeholder some S3 tools create
                dest = tmp / obj["Key"][len(base) :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, obj["Key"], str(dest))
    else:
        shutil.copytree(uri, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return True


def push_stage(folder: Path, uri: str) -> bool:
    """Publish a finished stage folder to ``uri`` (marker last); False when ``uri`` already holds it."""
    from components.storage import is_s3, publish, s3_client, split_s3

    local = _local_marker(folder)
    if local is None:
        raise FileNotFoundError(f"{folder} holds no finished stage")
    if _marker_at(uri) == local:
        return False
    if not is_s3(uri):
        publish(folder, uri)  # copies beside the target and renames: readers never see half a folder
        return True
    bucket, prefix = split_s3(uri)
    base = prefix.rstrip("/") + "/"
    client = s3_client()
    # The old marker goes first and the new one last, so a reader never takes a mixed folder as done.
    client.delete_object(Bucket=bucket, Key=base + MARKER)
    keys = set()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        key = base + path.relative_to(folder).as_posix()
        client.upload_file(str(path), bucket, key)
        keys.add(key)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            if obj["Key"] not in keys and obj["Key"] != base + MARKER:
                client.delete_object(Bucket=bucket, Key=obj["Key"])  # left over from an older run of the stage
    client.upload_file(str(folder / MARKER), bucket, base + MARKER)
    return True


# ---------------------------------------------------------------------- tracking
def find_pipeline_run(client: Any, experiment: str, run_key: str) -> str | None:
    """Id of the MLflow run tagged with ``run_key`` in ``experiment`` (``client``: an ``MlflowClient``)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    return runs[0].info.run_id if runs else None


def _pipeline_tracker(cfg: Any, config_path: Path, run_key: str | None, config_file: str | None) -> Any:
    """The MLflow parent run of this pipeline execution: the one tagged ``run_key``, else a new one."""
    from components.tracking import MlflowTracker
    from pipelines.run import pipeline_tags

    store = cfg.mlflow_store()
    uri, registry = store.tracking_uri, store.registry_uri
    if run_key:
        run_id = find_pipeline_run(store.client(), cfg.experiment, run_key)
        if run_id:
            return MlflowTracker(uri, cfg.experiment, run_id=run_id, registry_uri=registry)
    # Parallel first steps could both create one; the DAG has a single root, which runs alone.
    run_name = f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracker = MlflowTracker(uri, cfg.experiment, run_name=run_name, registry_uri=registry)
    tracker.set_tags(pipeline_tags(cfg, config_file) | ({RUN_KEY_TAG: run_key} if run_key else {}))
    tracker.log_params({"pipeline": cfg.model_dump(mode="json", by_alias=True)})
    tracker.log_artifact(config_path, "config")
    return tracker


# ---------------------------------------------------------------------- one stage, here
def run_stage_only(
    config_path: str | Path,
    stage: str,
    overrides: list[str] | None = None,
    *,
    stages_module: str = DEFAULT_STAGES_MODULE,
    storage_uri: str | None = None,
    run_key: str | None = None,
    tracking: bool = True,
    upstream: Sequence[str] | None = None,
    config_file: str | None = None,
    log: Callable[[str], None] = print,
) -> StageRun:
    """Run one stage of the pipeline in this process; every stage upstream of it must be finished.

    With a storage root (``storage_uri``, else the config's ``storage_uri``) the upstream stages'
    folders are pulled from ``<root>/<run_name>/<stage>`` first and this stage's folder is published
    there afterwards. ``upstream``: the URIs of the direct upstream stages, as a pipeline step received
    them (checked against the stage list; ``None`` skips the check). ``run_key`` groups the MLflow
    runs of one Kubeflow run under one parent run, which the DAG's last stage closes after writing
    ``summary.json``; without it the stage gets a parent run of its own. Raises
    :class:`~pipelines.runner.StageFailed` when the stage fails. ``config_file``: the file the config
    came from as the user named it, recorded as a tag of the parent run (None: a config given inline).
    """
    from components.storage import is_s3
    from components.tracking import NullTracker, Tracker
    from pipelines.config import load_pipeline_config
    from pipelines.run import _init_ray, format_table, summary_rows

    cfg = load_pipeline_config(config_path, overrides)
    stages = load_stages(stages_module)
    received = check_upstream(stages, stage, upstream) if upstream is not None else {}
    root = storage_uri or cfg.storage_uri
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    needed = upstream_closure(stages, stage)
    for name in needed:
        if not (root or name in received):
            continue  # no storage: upstream folders are already here, or the plan check below says so
        source = received.get(name) or stage_uri(root, run_dir, cfg.run_name, name)
        local = run_dir / name
        if (is_s3(source) or Path(source).resolve() != local.resolve()) and pull_stage(source, local):
            log(f"pulled {name} from {source}")
    runner = PipelineRunner(stages, cfg, run_dir)
    uri = stage_uri(root, run_dir, cfg.run_name, stage)
    if root:
        # A retried step on a fresh cluster: take the stage's own published folder if it is current.
        done = _marker_at(uri)
        if done and done.get("key") == runner.keys(runner.build_configs())[stage] and pull_stage(uri, run_dir / stage):
            log(f"pulled the finished {stage} from {uri}")
    plan = dict(runner.plan())
    missing = [name for name in needed if plan[name] != "cached"]
    if missing:
        raise ValueError(f"stage {stage!r} needs {missing} finished first (under {run_dir.resolve()})")
    try:
        import torch

        torch.set_num_threads(cfg.threads)
    except ImportError:  # pragma: no cover
        pass
    if os.environ.get("RAY_ADDRESS"):
        _init_ray(cfg)  # inside a RayJob: join its cluster; stages that need Ray otherwise start their own
    key = sanitize_run_key(run_key) if run_key else None
    tracker: Tracker = _pipeline_tracker(cfg, Path(config_path), key, config_file) if tracking else NullTracker()
    try:
        (result,) = runner.run(tracker, only=[stage], log=log)
    except StageFailed as err:
        tracker.finish("FAILED", str(err))
        raise
    if root and push_stage(run_dir / stage, uri):
        log(f"published {stage} to {uri}")
    last = stage == runner.stages[-1].name
    if last:
        outputs = {s.name: StageContext(cfg, run_dir, s.name).outputs(s.name) for s in runner.stages}
        rows = summary_rows(outputs)
        (run_dir / "summary.json").write_text(json.dumps({"rows": rows, "stages": outputs}, indent=2, default=str))
        tracker.log_artifact(run_dir / "summary.json")
        log("\n" + format_table(rows))
    if last or key is None:
        tracker.finish()
    return StageRun(stage, result.status, uri, result.outputs)
