"""The distill stage: Ray Train on the workers, the student written out on the driver.

``run_distill(config, tracker)`` runs one phase:

1. :func:`~components.distill.config.preflight` on the driver: phase 2's ``init_from`` exists,
   the teacher's config reads, the space fits, every budget is reachable. Nothing starts before.
2. A ``TorchTrainer`` with ``num_workers`` workers runs :func:`~components.distill.worker.
   train_loop_per_worker`; ``FailureConfig(max_failures)`` restarts the worker group from the
   latest checkpoint (the worker resumes from ``ray.train.get_checkpoint()``), and the two newest
   checkpoints are kept in ``storage_path`` (local or ``s3://``). The run name is keyed by the
   training fields and the input weights' manifests, so re-running the same phase after a driver
   crash resumes from its last checkpoint, while changed settings or inputs start a fresh run.
3. The final checkpoint becomes ``output_dir``: the student as a ``nemotron_h`` checkpoint (consolidated
   from the ranks' shards tensor by tensor, in the training dtype: bf16 training writes bf16), plus
   ``router.safetensors``, ``distill.json`` (space, budgets, router config, argmax architectures
   and their parameter counts), ``history.json`` (the logged rows) and the tokenizer files, all
   hashed in ``manifest.json``. Phase 2's ``init_from`` is exactly such a folder. The consolidation
   runs as a Ray task with the resources of ``consolidation`` (:mod:`components.stage_task`): the
   files it reads (on ``s3://`` storage, every rank's optimizer shard at ZeRO-3: ~12 bytes per
   parameter, checked against the free disk of ``consolidation_dir`` first) are fetched on the
   task's node, never on the driver.

The export stage, which reads that folder, is :mod:`components.distill.export`.

Ray Train V2 (the default in Ray >= 2.50) is used as is: it runs a 2-worker job on 2 CPUs (the
V1 trainer reserves a CPU for its own actor and waits forever for a third one).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field
from safetensors.torch import load_file

from components.distill import ckpt
from components.distill.config import (
    DistillConfig,
    preflight,
    to_worker_dict,
    with_router_schedule,
    with_run_name,
)
from components.settings import from_environment
from components.stage_task import run_task
from components.tracking import NullTracker, Tracker
from model.config import HybridConfig
from model.elastic.budgets import BudgetSet
from model.elastic.params import count_params
from model.elastic.router import BudgetRouter, RouterConfig
from model.elastic.space import ElasticSpace

DISTILL_FILE = "distill.json"
HISTORY_FILE = "history.json"


class DistillOutputs(BaseModel):
    """What one distillation phase produced."""

    checkpoint_uri: str = Field(
        description="Local folder: student weights (nemotron_h), router.safetensors, tokenizer, distill.json."
    )
    metrics: dict[str, float] = Field(default_factory=dict, description="Final figures of the run.")
    architectures: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per budget: the router's argmax architecture at the end."
    )
    ray_checkpoint: str | None = Field(None, description="Where Ray Train stored the final checkpoint.")
    consolidation_task: dict[str, Any] | None = Field(
        None, description="Where and how long the consolidation task ran (components.stage_task.TaskInfo fields)."
    )


# ---------------------------------------------------------------------- driver side
def _with_tracking(config: DistillConfig, tracker: Tracker) -> DistillConfig:
    """Point rank 0 at the stage tracker's MLflow run unless the config names one."""
    if config.tracking_uri or not (tracker.tracking_uri and tracker.run_id):
        return config
    experiment = getattr(tracker, "experiment", config.experiment)
    return config.model_copy(
        update={"tracking_uri": tracker.tracking_uri, "run_id": tracker.run_id, "experiment": experiment}
    )


def build_trainer(config: DistillConfig):
    """The ``TorchTrainer`` of one phase (not started)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from components.distill.worker import train_loop_per_worker

    s3 = from_environment().s3
    storage_path, filesystem = ckpt.storage_target(config.resolved_storage_path(), s3)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=to_worker_dict(config),
        scaling_config=ScalingConfig(num_workers=config.num_workers, use_gpu=config.use_gpu),
        run_config=RunConfig(
            name=config.name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            failure_config=FailureConfig(max_failures=config.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            # Inside a Ray worker sys.stdout is Ray's wrapper, so Ray Train's print patch writes every print
            # twice (the print itself, then a log record of it); and its INFO lines repeat on every rank. The
            # workers upload checkpoints through pyarrow, whose S3 checksums are set by variables only.
            worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **s3.checksum_env()}},
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )


def router_from(
    model_config: HybridConfig, space: ElasticSpace, budgets: BudgetSet, router_config: RouterConfig, weights: Path
) -> BudgetRouter:
    """A router with the weights of ``router.safetensors``."""
    router = BudgetRouter(model_config, space, budgets, router_config)
    router.load_state_dict(load_file(str(weights)))
    return router.eval()


def write_output(
    checkpoint_dir: Path, config: DistillConfig, model_config: HybridConfig, teacher_dir: Path
) -> tuple[Path, dict[str, Any], ckpt.TrainState]:
    """Turn a Ray checkpoint folder into ``output_dir``; returns (folder, the distill.json summary, train state).

    The student is consolidated from the ranks' shards tensor by tensor (:func:`ckpt.consolidate`) into the
    published nemotron_h layout (:mod:`model.layout`) in the training dtype; no model is built.
    """
    from model.atomic import publish_folder
    from model.checkpoint import CONFIG_NAME, write_manifest
    from model.layout import tokenizer_files

    state = ckpt.read_state(checkpoint_dir)
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    with publish_folder(config.output_dir) as staging:
        ckpt.consolidate(checkpoint_dir, staging, staging / ckpt.ROUTER_FILE, dtype)
        model_config.to_json_file(staging / CONFIG_NAME)
        summary = _summary(config, model_config, state, staging / ckpt.ROUTER_FILE)
        (staging / DISTILL_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        (staging / HISTORY_FILE).write_text(json.dumps(state.history, indent=1) + "\n")
        for name, src in tokenizer_files(teacher_dir).items():
            shutil.copyfile(src, staging / name)
        write_manifest(staging)
    return Path(config.output_dir), summary, state


def _summary(
    config: DistillConfig, model_config: HybridConfig, state: ckpt.TrainState, router_file: Path
) -> dict[str, Any]:
    """The ``distill.json`` summary of a finished phase (argmax architectures of the trained router)."""
    budgets = config.budget_set
    router = router_from(model_config, config.space, budgets, config.router, router_file)
    archs = router.architectures()
    counts = {n: count_params(model_config, a, config.depth_order) for n, a in archs.items()}
    summary = {
        "phase": config.phase,
        "steps": config.steps,
        "seq_len": config.seq_len,
        "teacher_uri": config.teacher_uri,
        "init_from": config.init_from,
        "space": config.space.model_dump(mode="json"),
        "budgets": [b.model_dump() for b in budgets.budgets],
        "budget_probs": config.sampling_probs,
        "router": config.router.model_dump(mode="json"),
        "depth_order": config.depth_order,
        "architectures": {n: a.to_dict() for n, a in archs.items()},
        "params": {n: {"total": c.total, "active": c.active} for n, c in counts.items()},
        "tokens_seen": state.tokens_seen,
        "attempts": state.attempt + 1,
        "dtype": "bfloat16" if config.bf16 else "float32",
    }
    return summary


def consolidate_output(
    checkpoint: Any, config: DistillConfig, model_config: HybridConfig
) -> tuple[Path, dict[str, Any], ckpt.TrainState]:
    """Fetch the files consolidation reads from a Ray Train ``checkpoint`` (only those) and write ``output_dir``
    (:func:`write_output`). The body of the consolidation task: what it fetches lands on the task's node."""
    from components.storage import fetch_metadata

    needs = lambda relative: ckpt.consolidation_needs(relative, config.zero_stage)  # noqa: E731
    teacher_meta = fetch_metadata(config.teacher_uri)  # the tokenizer files that travel on, not the teacher weights
    setting = f"distill_phase{config.phase}.consolidation_dir"
    with ckpt.fetch(checkpoint, needs, config.consolidation_dir, setting) as folder:
        return write_output(Path(folder), config, model_config, teacher_meta)


def run_distill(config: DistillConfig, tracker: Tracker | None = None) -> DistillOutputs:
    """Run one distillation phase on Ray Train; see the module docstring."""
    tracker = tracker or NullTracker()
    model_config = preflight(config)  # raises before any worker starts
    config = with_run_name(with_router_schedule(_with_tracking(config, tracker)))  # phase 2 continues the anneal
    started = time.perf_counter()
    result = build_trainer(config).fit()
    if result.checkpoint is None:
        raise RuntimeError(f"distill phase {config.phase}: the run finished without a checkpoint ({result.path})")
    (out, summary, state), task = run_task(
        consolidate_output,
        result.checkpoint,
        config,
        model_config,
        resources=config.consolidation,
        name=f"distill_phase{config.phase}.consolidate",
        field=f"distill_phase{config.phase}.consolidation",
        pass_tracker=False,
    )
    last = state.history[-1] if state.history else {}
    metrics: dict[str, float] = {k: float(v) for k, v in last.items() if isinstance(v, int | float)}
    metrics.update(
        {
            "steps": float(state.next_step),
            "attempts": float(state.attempt + 1),
            "tokens_seen": float(state.tokens_seen),
            "train_seconds": state.train_seconds,
            "wall_seconds": time.perf_counter() - started,
        }
    )
    for name, count in summary["params"].items():
        metrics[f"final/{name}/active_params"] = float(count["active"])
        metrics[f"final/{name}/total_params"] = float(count["total"])
    tracker.log_metrics({k: v for k, v in metrics.items() if k.startswith("final/") or k == "wall_seconds"})
    tracker.log_dict(summary, f"distill_phase{config.phase}.json")
    return DistillOutputs(
        checkpoint_uri=str(out),
        metrics=metrics,
        architectures=summary["architectures"],
        ray_checkpoint=result.checkpoint.path,
        consolidation_task=task.model_dump(),
    )
