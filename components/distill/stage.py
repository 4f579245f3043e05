"""The distill and export stages: Ray Train on the workers, the student written out on the driver.

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
   hashed in ``manifest.json``. Phase 2's ``init_from`` is exactly such a folder.

``run_export(distill_output_dir, out_dir)`` reads that folder, rebuilds the router, takes every
budget's argmax architecture and writes the ONE nested checkpoint with
:func:`~model.elastic.export.export_nested`.

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
from components.tracking import NullTracker, Tracker
from model.config import HybridConfig
from model.elastic.budgets import BudgetSet
from model.elastic.params import count_params
from model.elastic.router import BudgetRouter, RouterConfig
from model.elastic.space import ElasticSpace
from model.hybrid import HybridLM

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

    storage_path, filesystem = ckpt.storage_target(config.resolved_storage_path())
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
            # twice (the print itself, then a log record of it); and its INFO lines repeat on every rank.
            worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
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

    The student is consolidated from the ranks' shards tensor by tensor (:func:`ckpt.consolidate`) into a
    nemotron_h ``model.safetensors`` in the training dtype; no model is built.
    """
    from model.checkpoint import CONFIG_NAME, WEIGHTS_NAME, atomic_folder, write_manifest
    from model.elastic.export import tokenizer_files

    state = ckpt.read_state(checkpoint_dir)
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    tmp, commit = atomic_folder(Path(config.output_dir))
    try:
        ckpt.consolidate(checkpoint_dir, tmp / WEIGHTS_NAME, tmp / ckpt.ROUTER_FILE, dtype)
        model_config.to_json_file(tmp / CONFIG_NAME)
        summary = _summary(config, model_config, state, tmp / ckpt.ROUTER_FILE)
        (tmp / DISTILL_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        (tmp / HISTORY_FILE).write_text(json.dumps(state.history, indent=1) + "\n")
        for name, src in tokenizer_files(teacher_dir).items():
            shutil.copyfile(src, tmp / name)
        write_manifest(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit(), summary, state


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


def run_distill(config: DistillConfig, tracker: Tracker | None = None) -> DistillOutputs:
    """Run one distillation phase on Ray Train; see the module docstring."""
    from components.storage import materialize

    tracker = tracker or NullTracker()
    model_config = preflight(config)  # raises before any worker starts
    config = with_run_name(with_router_schedule(_with_tracking(config, tracker)))  # phase 2 continues the anneal
    started = time.perf_counter()
    result = build_trainer(config).fit()
    if result.checkpoint is None:
        raise RuntimeError(f"distill phase {config.phase}: the run finished without a checkpoint ({result.path})")
    needs = lambda relative: ckpt.consolidation_needs(relative, config.zero_stage)  # noqa: E731
    with ckpt.fetch(result.checkpoint, needs) as folder:
        out, summary, state = write_output(Path(folder), config, model_config, materialize(config.teacher_uri))
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
    )


# ---------------------------------------------------------------------- export
def run_export(
    distill_output_dir: str | Path,
    out_dir: str | Path,
    allow_off_target: bool = False,
    tolerance: float = 0.05,
    tracker: Tracker | None = None,
    select: str = "argmax",
) -> Path:
    """Write the ONE nested checkpoint from a distillation output folder (router argmax per budget,
    or with ``select="feasible"`` the on-target architecture nearest the argmax).

    Raises ``ValueError`` (from :func:`~model.elastic.export.export_nested`) naming every budget
    whose argmax architecture misses its target by more than ``tolerance``, unless
    ``allow_off_target``.
    """
    from model.elastic.export import export_nested, tokenizer_files

    src = Path(distill_output_dir)
    meta_path = src / DISTILL_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{src}: no {DISTILL_FILE}; not a distillation output folder")
    meta = json.loads(meta_path.read_text())
    model = HybridLM.from_pretrained(src)
    space = ElasticSpace.model_validate(meta["space"])
    budgets = BudgetSet.model_validate({"budgets": meta["budgets"]})
    router_config = RouterConfig.model_validate(meta["router"])
    router = router_from(model.config, space, budgets, router_config, src / ckpt.ROUTER_FILE)
    out = export_nested(
        model,
        router,
        budgets,
        space,
        out_dir,
        depth_order=meta.get("depth_order"),
        extra_files=tokenizer_files(src),
        allow_off_target=allow_off_target,
        tolerance=tolerance,
        select=select,
    )
    (tracker or NullTracker()).log_dict(json.loads((out / "config.json").read_text())["elastic"], "elastic.json")
    return out
