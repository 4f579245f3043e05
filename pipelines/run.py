"""Run the whole pipeline on an embedded local Ray (the default) and print a per-budget summary."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from pipelines.config import PipelineConfig, load_pipeline_config
from pipelines.errors import machine_fault
from pipelines.preflight import Preflight
from pipelines.runner import PipelineRunner, StageFailed, run_folder_lock
from pipelines.stages import pipeline_stages


def _init_ray(cfg: PipelineConfig) -> None:
    import ray

    from components.console import plain_forwarded_lines, worker_runtime_env

    plain_forwarded_lines()  # a log file gets no colour codes around the workers' lines
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, runtime_env=worker_runtime_env(local=False))
        else:
            # The dashboard serves Ray's State API, which Ray Train's placement-group cleaner polls: without
            # it every poll logs a warning. It also shows the run's tasks and actors at http://127.0.0.1:8265, for
            # a little more start-up time.
            ray.init(
                num_cpus=max(2, os.cpu_count() or 2),
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                log_to_driver=True,
                runtime_env=worker_runtime_env(local=True),
            )


RUN_DIR_TAG = "run_dir_id"
"""Tag naming a pipeline execution's run folder by hash, so interrupted executions of it can be found."""


def run_dir_id(run_dir: str | Path) -> str:
    """A short hash of the absolute run folder (a plain token an MLflow filter can quote)."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def pipeline_tags(cfg: PipelineConfig, config_file: str | Path | None) -> dict[str, str]:
    """Tags of a pipeline execution's MLflow parent run, whoever runs it (``star-elastic run`` or a Kubeflow
    step): what produced it (git commit, uncommitted changes, hash of the validated config), the run folder,
    and the config file when the config came from one."""
    from components.tracking import source_tags

    tags = {
        **source_tags(cfg.model_dump(mode="json", by_alias=True)),
        "run_dir": str(cfg.run_dir),
        RUN_DIR_TAG: run_dir_id(cfg.run_dir),
    }
    if config_file is not None:
        tags["config_file"] = str(config_file)
    return tags


def summary_rows(outputs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per budget from the export / evaluate / quantize outputs (whatever exists)."""
    export = outputs.get("export", {})
    evaluate = outputs.get("evaluate", {})
    quantize = outputs.get("quantize", {})
    rows = []
    for b in export.get("budgets", []):
        name = b["name"]
        row = {
            "budget": name,
            "total_params": b.get("total_params"),
            "active_params": b.get("active_params"),
            "accuracy": evaluate.get("accuracy", {}).get(name),
            "latency_s": evaluate.get("latency_s", {}).get(name),
        }
        for fmt, rec in quantize.get("recovery", {}).items():
            row[f"recovery_{fmt}"] = rec.get(name)
        rows.append(row)
    return rows


def size_line(outputs: dict[str, dict[str, Any]]) -> str:
    """Bytes on disk per format (every budget lives in each one file)."""
    sizes = outputs.get("quantize", {}).get("sizes", [])
    if not sizes:
        return ""
    parts = [f"{r['name']} {r['bytes'] / 1e6:.2f} MB" for r in sizes]
    return "checkpoint size, all budgets in one file: " + ", ".join(parts)


def check_uris(cfg: PipelineConfig) -> None:
    """Fail before any stage starts when a configured URI cannot be reached."""
    from components.storage import check_reachable, is_s3, materialize

    problems = []
    if cfg.storage_uri:
        try:
            check_reachable(cfg.storage_uri)
        except ValueError as err:
            problems.append(f"storage_uri: {err}")
    if cfg.parent.uri and not is_s3(cfg.parent.uri):
        try:
            materialize(cfg.parent.uri)
        except FileNotFoundError as err:
            problems.append(f"parent.uri: {err}")
    elif cfg.parent.uri:
        try:
            check_reachable(cfg.parent.uri)
        except ValueError as err:
            problems.append(f"parent.uri: {err}")
    if problems:
        raise ValueError("unreachable URIs:\n  " + "\n  ".join(problems))


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no budgets yet)"
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    body = ["  ".join(x[i].ljust(widths[i]) for i in range(len(cols))) for x in cells]
    return "\n".join([line, "-" * len(line), *body])


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, int) and v > 10_000:
        return f"{v:,}"
    return str(v)


def run_pipeline(
    config_path: str,
    overrides: list[str] | None = None,
    force_from: str | None = None,
    dry_run: bool = False,
    only: list[str] | None = None,
    checked: Preflight | None = None,
) -> int:
    """Run the pipeline of ``config_path`` (with ``overrides``); ``checked``: what preflight found for that same
    config and these stages, whose stage configs are then used as they are (none is built again)."""
    from components.console import quiet_libraries
    from components.progress import line_buffered_console

    quiet_libraries()  # this process's share of the library noise; Ray's workers run it at their start
    line_buffered_console()
    if checked is not None and checked.config is not None:
        cfg, configs = checked.config, checked.stage_configs
    else:
        cfg, configs = load_pipeline_config(config_path, overrides), None
    runner = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir, configs)
    plan = runner.plan(force_from)
    print(f"pipeline {cfg.run_name}: " + ", ".join(f"{name} ({what})" for name, what in plan))
    runner.check_only(only, dict(plan))
    check_uris(cfg)
    if dry_run:
        return 0
    try:
        import torch

        torch.set_num_threads(cfg.threads)
    except ImportError:  # pragma: no cover
        pass
    with run_folder_lock(cfg.run_dir):
        return _run_locked(cfg, runner, config_path, force_from, only)


def _run_locked(
    cfg: PipelineConfig, runner: PipelineRunner, config_path: str, force_from: str | None, only: list[str] | None
) -> int:
    """The pipeline's execution while this process holds the run folder's lock."""
    from components.tracking import MlflowTracker

    store = cfg.mlflow_store()
    tracking_uri = store.tracking_uri
    run_name = f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracker = MlflowTracker(tracking_uri, cfg.experiment, run_name=run_name, registry_uri=store.registry_uri)
    # Whatever ends the run early (Ray failing to start, a bad --only, Ctrl-C, SIGTERM, which Ray's driver
    # turns into SystemExit) ends the MLflow run FAILED or KILLED with the error, never leaves it RUNNING.
    # A SIGKILL or a lost node cannot: the next execution in the same folder (which holds its lock, so no live
    # process writes to them) ends those runs FAILED and names the newest in its own tags.
    with tracker:
        interrupted = tracker.end_interrupted(RUN_DIR_TAG, run_dir_id(cfg.run_dir))
        if interrupted:
            print(f"MLflow: ended {len(interrupted)} interrupted run(s) of this run folder FAILED: {interrupted}")
            tracker.set_tags({"resumes_run_id": interrupted[0]})
        tracker.set_tags(pipeline_tags(cfg, config_path))
        tracker.log_params({"pipeline": cfg.model_dump(mode="json", by_alias=True)})
        tracker.log_artifact(config_path, "config")
        _init_ray(cfg)
        start = time.perf_counter()
        try:
            results = runner.run(tracker, force_from=force_from, only=only)
        except StageFailed as err:
            tracker.finish("FAILED", str(err))
            fault = machine_fault(err)
            what = f"stage {err.stage!r} failed: {fault}" if fault else str(err)
            print(f"\n{what}\nEarlier stages' outputs are kept under {cfg.run_dir}; fix and re-run to resume.")
            return 1
        outputs = {r.name: r.outputs for r in results}
        rows = summary_rows(outputs)
        table = format_table(rows)
        (cfg.run_dir / "summary.json").write_text(json.dumps({"rows": rows, "stages": outputs}, indent=2, default=str))
        tracker.log_artifact(cfg.run_dir / "summary.json")
        tracker.log_metrics({"pipeline_seconds": time.perf_counter() - start})
    print("\n" + table)
    if size_line(outputs):
        print(size_line(outputs))
    print(f"\nfinished in {time.perf_counter() - start:.0f}s; outputs under {Path(cfg.run_dir).resolve()}")
    print(f"MLflow: run {tracker.run_id} in experiment '{cfg.experiment}' at {tracking_uri}  (make ui)")
    return 0
