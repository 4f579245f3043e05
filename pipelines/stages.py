"""The stages of the pipeline: adapters from the pipeline config to each component's config and function.

Each adapter's ``build`` returns the stage's validated config: the stage's function of
:mod:`pipelines.sections` (the one place a section is resolved, inheritance included) given the
deterministic folders of upstream stages; ``run`` calls the component and returns JSON-able
outputs (URIs and metrics) recorded in the stage marker.

The driver holds no model. Export, evaluate, quantize and register run their component as a Ray
task with the resources of their section's ``resources`` (:mod:`components.stage_task`); their
outputs record where the task ran (``task``). The parent stage checks a given checkpoint from its
file headers, and the rank and distillation stages run their model work in Ray tasks and Ray
Train workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from components.stage_task import run_task
from components.tracking import MlflowTracker, Tracker
from pipelines import sections
from pipelines.config import ExportStageConfig, PipelineConfig
from pipelines.runner import StageContext, StageSpec
from pipelines.sections import inherited


# ---------------------------------------------------------------------- parent
class ParentStageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uri: str | None = Field(None, description="Existing parent checkpoint; None: train the demo parent.")
    train: dict[str, Any] = Field(default_factory=dict, description="ParentTrainConfig fields when training.")


def _parent_dir(ctx: StageContext) -> Path:
    return ctx.dir("parent") / "checkpoint"


def build_parent(ctx: StageContext) -> BaseModel:
    cfg: PipelineConfig = ctx.pipeline
    if cfg.parent.uri:
        return ParentStageConfig(uri=cfg.parent.uri)
    section = cfg.parent.train.model_dump(exclude_unset=True)
    train = sections.parent_train_config(section, inherited(cfg), output_dir=str(_parent_dir(ctx)))
    return ParentStageConfig(train=train.model_dump())


def check_parent(folder: Path) -> int:
    """Check a parent checkpoint from its file headers; returns its parameter count. No weight is loaded.

    What the loader accepts passes (either key prefix, stacked or per-expert experts, tied embeddings,
    ``mtp.*`` skipped); a file altered since its ``manifest.json`` or a missing, unexpected or
    mis-shaped tensor raises :class:`~model.checkpoint.CheckpointError` naming them, before any stage
    that needs the weights starts.
    """
    from model.checkpoint import inspect_checkpoint
    from model.hybrid import HybridLM

    return HybridLM.check_checkpoint(inspect_checkpoint(folder))


def run_parent(cfg: ParentStageConfig, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    from components.parent import ParentTrainConfig, train_parent
    from components.storage import materialize

    if cfg.uri:
        local = materialize(cfg.uri)
        num_parameters = check_parent(Path(local))  # fails early, naming tensors, if the checkpoint is bad
        tracker.log_params({"parent_uri": cfg.uri, "num_parameters": num_parameters})
        return {"checkpoint_uri": str(Path(local).resolve()), "trained": False}
    metrics = train_parent(ParentTrainConfig(**cfg.train), tracker)
    return {"checkpoint_uri": str(_parent_dir(ctx).resolve()), "trained": True, "metrics": metrics}


def parent_uri(ctx: StageContext) -> str:
    """The parent checkpoint folder as seen by downstream stages (known before the parent stage runs)."""
    cfg: PipelineConfig = ctx.pipeline
    if cfg.parent.uri:
        from components.storage import is_s3

        return cfg.parent.uri if is_s3(cfg.parent.uri) else str(Path(cfg.parent.uri).resolve())
    return str(_parent_dir(ctx).resolve())


# ---------------------------------------------------------------------- rank
def build_rank(ctx: StageContext) -> BaseModel:
    section = ctx.pipeline.rank.model_dump(exclude_unset=True)
    return sections.rank_config(
        section, inherited(ctx.pipeline), parent_uri=parent_uri(ctx), output_dir=str(ctx.dir().resolve())
    )


def run_rank_stage(cfg: BaseModel, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    from components.rank import run_rank

    out = run_rank(cfg, tracker).model_dump()
    rankings = json.loads(Path(out["rankings_uri"]).read_text())
    depth = rankings.get("depth")
    out["depth_order"] = depth["removal_order"] if depth else None
    return out


def _depth_order(ctx: StageContext) -> list[int] | None:
    return ctx.outputs("rank").get("depth_order")


# ---------------------------------------------------------------------- distillation
CHECKPOINTS = "checkpoints"
"""Sub-folder of a distillation stage holding its Ray Train checkpoints (local storage): the runner keeps it
when an interrupted attempt with the same key runs again, so the phase resumes from its last checkpoint."""


def _student_dir(ctx: StageContext, stage: str) -> str:
    return str((ctx.dir(stage) / "student").resolve())


def _distill_config(ctx: StageContext, phase: int, section: BaseModel) -> BaseModel:
    cfg: PipelineConfig = ctx.pipeline
    base: dict[str, Any] = {
        "phase": phase,
        "teacher_uri": str((ctx.dir("rank") / "permuted").resolve()),
        "output_dir": _student_dir(ctx, ctx.name),
        "space": cfg.elastic.space,
        "budgets": [b.model_dump() for b in cfg.elastic.budgets],
        "experiment": cfg.experiment,
    }
    if phase == 2:
        base["init_from"] = _student_dir(ctx, "distill_phase1")
    if cfg.storage_uri:
        base["storage_path"] = f"{cfg.storage_uri.rstrip('/')}/{cfg.run_name}/ray/{ctx.name}"
    else:
        base["storage_path"] = str((ctx.dir() / CHECKPOINTS).resolve())
    return sections.distill_config(section.model_dump(exclude_unset=True), inherited(cfg), **base)


def build_distill1(ctx: StageContext) -> BaseModel:
    return _distill_config(ctx, 1, ctx.pipeline.distill_phase1)


def build_distill2(ctx: StageContext) -> BaseModel:
    return _distill_config(ctx, 2, ctx.pipeline.distill_phase2)


def run_distill_stage(cfg: BaseModel, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    from components.distill.stage import run_distill

    order = _depth_order(ctx)
    if order is not None and cfg.depth_order is None:
        cfg = cfg.model_copy(update={"depth_order": order})
    out = run_distill(cfg, tracker)
    return out.model_dump()


# ---------------------------------------------------------------------- export
def build_export(ctx: StageContext) -> BaseModel:
    return sections.export_config(
        ctx.pipeline.export.model_dump(exclude_unset=True),
        distill_dir=_student_dir(ctx, "distill_phase2"),
        output_dir=str((ctx.dir() / "nested").resolve()),
    )


def export_work(cfg: ExportStageConfig, publish_uri: str | None, tracker: Tracker) -> dict[str, Any]:
    """The export stage's task: the nested checkpoint streamed from the phase-2 output, its budgets logged,
    and (with a storage root) the folder published from the task's node."""
    from components.distill.export import run_export
    from components.storage import publish
    from model.elastic.export import read_elastic

    out = run_export(cfg.distill_dir, cfg.output_dir, cfg.allow_off_target, cfg.tolerance, tracker, cfg.select)
    budgets = [b.to_dict() for b in read_elastic(out).budgets]
    for b in budgets:
        tracker.log_metrics(
            {f"active_params/{b['name']}": b["active_params"], f"total_params/{b['name']}": b["total_params"]}
        )
    result: dict[str, Any] = {"checkpoint_uri": str(out), "budgets": budgets}
    if publish_uri:
        result["published_uri"] = publish(out, publish_uri)
    return result


def run_export_stage(cfg: ExportStageConfig, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    storage = ctx.pipeline.storage_uri
    target = f"{storage.rstrip('/')}/{ctx.pipeline.run_name}/nested" if storage else None
    result, task = run_task(
        export_work, cfg, target, resources=cfg.resources, name="export", field="export.resources", tracker=tracker
    )
    return {**result, "task": task.model_dump()}


# ---------------------------------------------------------------------- evaluate
def _nested_dir(ctx: StageContext) -> str:
    return str((ctx.dir("export") / "nested").resolve())


def build_evaluate(ctx: StageContext) -> BaseModel:
    cfg: PipelineConfig = ctx.pipeline
    return sections.evaluate_config(
        cfg.evaluate.model_dump(exclude_unset=True),
        inherited(cfg),
        threads=cfg.threads,
        checkpoint_uri=_nested_dir(ctx),
        output_dir=str(ctx.dir().resolve()),
    )


def _per_budget(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """``{"acc/full": .9, "acc/full/L1": ...}`` -> ``{"full": .9}`` (top-level entries only)."""
    out = {}
    for k, v in metrics.items():
        parts = k.split("/")
        if len(parts) == 2 and parts[0] == prefix:
            out[parts[1]] = v
    return out


def run_evaluate_stage(cfg: BaseModel, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    from components.evaluate import run_evaluate

    out, task = run_task(
        run_evaluate, cfg, resources=cfg.resources, name="evaluate", field="evaluate.resources", tracker=tracker
    )
    return {
        **out.model_dump(),
        "accuracy": _per_budget(out.metrics, "acc"),
        "latency_s": _per_budget(out.metrics, "latency_s"),
        "task": task.model_dump(),
    }


# ---------------------------------------------------------------------- quantize
def build_quantize(ctx: StageContext) -> BaseModel:
    cfg: PipelineConfig = ctx.pipeline
    return sections.quantize_config(
        cfg.quantize.model_dump(exclude_unset=True),
        cfg.evaluate.model_dump(exclude_unset=True),
        inherited(cfg),
        checkpoint_uri=_nested_dir(ctx),
        output_dir=str(ctx.dir().resolve()),
    )


def run_quantize_stage(cfg: BaseModel, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    from components.quantize import run_quantize

    baseline = ctx.outputs("evaluate").get("accuracy", {})
    if baseline and not cfg.baseline_accuracy:
        cfg = cfg.model_copy(update={"baseline_accuracy": baseline})
    result, task = run_task(
        run_quantize, cfg, resources=cfg.resources, name="quantize", field="quantize.resources", tracker=tracker
    )
    out = result.model_dump()
    out["recovery"] = out.pop("recovery_by_format")
    out["task"] = task.model_dump()
    return out


# ---------------------------------------------------------------------- register
def build_register(ctx: StageContext) -> BaseModel:
    section = ctx.pipeline.registry.model_dump(exclude_unset=True)
    return sections.register_config(section, checkpoint_uri=_nested_dir(ctx))


def run_register_stage(cfg: BaseModel, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    from components.register import run_register

    accuracy = ctx.outputs("evaluate").get("accuracy", {})
    budgets = [{**b, "accuracy": accuracy.get(b["name"])} for b in ctx.outputs("export").get("budgets", [])]
    formats = {fmt: path for fmt, path in ctx.outputs("quantize").get("checkpoints", {}).items()}
    cfg = cfg.model_copy(update={"budgets": budgets, "formats": formats})
    if not isinstance(tracker, MlflowTracker):
        return run_register(cfg, tracker)  # tracking is off: nothing is logged, nothing loaded
    out, task = run_task(
        run_register, cfg, resources=cfg.resources, name="register", field="register.resources", tracker=tracker
    )
    return {**out, "task": task.model_dump()}


STAGES: list[StageSpec] = [
    StageSpec("parent", [], build_parent, run_parent, "the parent checkpoint (train the demo parent if none given)"),
    StageSpec("rank", ["parent"], build_rank, run_rank_stage, "importance ranking (REAP for experts) and permutation"),
    StageSpec(
        "distill_phase1",
        ["rank"],
        build_distill1,
        run_distill_stage,
        "elastic distillation, short context",
        resumable=(CHECKPOINTS,),
    ),
    StageSpec(
        "distill_phase2",
        ["distill_phase1"],
        build_distill2,
        run_distill_stage,
        "elastic distillation, long",
        resumable=(CHECKPOINTS,),
    ),
    StageSpec("export", ["distill_phase2"], build_export, run_export_stage, "one nested checkpoint (router argmax)"),
    StageSpec("evaluate", ["export"], build_evaluate, run_evaluate_stage, "accuracy, latency, budget control"),
    StageSpec("quantize", ["export", "evaluate"], build_quantize, run_quantize_stage, "FP8 / NVFP4 nested checkpoints"),
    StageSpec(
        "register", ["export", "evaluate", "quantize"], build_register, run_register_stage, "MLflow version + gate"
    ),
]


def pipeline_stages() -> list[StageSpec]:
    """Every stage of the DAG, in order."""
    return list(STAGES)
