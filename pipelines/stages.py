"""The stages of the pipeline: adapters from the pipeline config to each component's config and function.

Each adapter's ``build`` returns the stage's validated config using the
deterministic folders of upstream stages; ``run`` calls the component and
returns JSON-able outputs (URIs and metrics) recorded in the stage marker.

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

from components.stage_task import TaskResources, run_task
from components.tracking import MlflowTracker, Tracker
from pipelines.config import ExportStageConfig, PipelineConfig
from pipelines.runner import StageContext, StageSpec


def _merge(base: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """``section`` over ``base`` (one level deep for nested dicts)."""
    out = dict(base)
    for k, v in section.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _inherit(cfg: PipelineConfig, section: dict[str, Any], *, calibration: bool = False) -> dict[str, Any]:
    """``section`` with the pipeline's top-level ``data`` and ``markers`` filled in where it sets neither.

    A calibration (rank, quantize) packs the rows: padding would dilute its statistics.
    """
    out = dict(section)
    if cfg.data is not None and "data" not in out:
        data = cfg.data.model_copy(update={"pack": True}) if calibration else cfg.data
        out["data"] = data.model_dump(mode="json")
    if cfg.markers is not None and "markers" not in out:
        out["markers"] = cfg.markers.model_dump()
    return out


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
    from components.parent import ParentTrainConfig

    section = _inherit(cfg, cfg.parent.train.model_dump(exclude_unset=True))
    train = ParentTrainConfig(**section, output_dir=str(_parent_dir(ctx)))
    return ParentStageConfig(train=train.model_dump())


def check_parent(folder: Path) -> int:
    """Check a parent checkpoint from its file headers; returns its parameter count. No weight is loaded.

    What the loader accepts passes (either key prefix, stacked or per-expert experts, tied embeddings,
    ``mtp.*`` skipped); a file altered since its ``manifest.json`` or a missing, unexpected or
    mis-shaped tensor raises :class:`~model.checkpoint.CheckpointError` naming them, before any stage
    that needs the weights starts.
    """
    import torch
    from safetensors import safe_open

    from model.checkpoint import check_state, read_config, to_canonical, verify_manifest, weight_files
    from model.hybrid import HybridLM

    config, raw = read_config(folder)
    verify_manifest(folder)
    found: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                if not key.startswith("mtp."):
                    found[key] = torch.empty(fh.get_slice(key).get_shape(), device="meta")
    state = to_canonical(found)
    if "lm_head.weight" not in state and raw.get("tie_word_embeddings") and "model.embeddings.weight" in state:
        state["lm_head.weight"] = state["model.embeddings.weight"]
    with torch.device("meta"):  # shapes only: the meta device allocates nothing
        parent = HybridLM(config)
    check_state(parent.state_dict(), state, str(folder))
    return parent.num_parameters()


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
    from components.rank import RankConfig

    section = ctx.pipeline.rank.model_dump(exclude_unset=True)
    section["calibration"] = _inherit(ctx.pipeline, section.get("calibration") or {}, calibration=True)
    return RankConfig(parent_uri=parent_uri(ctx), output_dir=str(ctx.dir().resolve()), **section)


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
    from components.distill.config import DistillConfig

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
    return DistillConfig(**_merge(base, _inherit(cfg, section.model_dump(exclude_unset=True))))


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
    return ExportStageConfig(
        distill_dir=_student_dir(ctx, "distill_phase2"),
        output_dir=str((ctx.dir() / "nested").resolve()),
        **ctx.pipeline.export.model_dump(exclude_unset=True),
    )


def export_work(cfg: ExportStageConfig, publish_uri: str | None, tracker: Tracker) -> dict[str, Any]:
    """The export stage's task: the nested checkpoint streamed from the phase-2 output, its budgets logged,
    and (with a storage root) the folder published from the task's node."""
    from components.distill.stage import run_export
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


def task_device(device: str, resources: TaskResources, device_field: str, resources_field: str) -> str:
    """The evaluation device inside a stage task: ``auto`` is cuda when the task reserves a GPU and cpu
    otherwise (a CPU task on a GPU node must not use a GPU it did not reserve); cuda without one is refused,
    naming both fields."""
    if device == "auto":
        return "cuda" if resources.num_gpus > 0 else "cpu"
    if device.startswith("cuda") and resources.num_gpus == 0:
        raise ValueError(
            f"{device_field}: {device!r} but the task reserves no GPU; set {resources_field}.num_gpus (e.g. 1), "
            "or device: auto"
        )
    return device


def build_evaluate(ctx: StageContext) -> BaseModel:
    from components.evaluate import EvalConfig

    base = {"checkpoint_uri": _nested_dir(ctx), "output_dir": str(ctx.dir().resolve()), "threads": ctx.pipeline.threads}
    section = ctx.pipeline.evaluate.model_dump(exclude_unset=True)
    if ctx.pipeline.markers is not None and "markers" not in section:
        section["markers"] = ctx.pipeline.markers.model_dump()
    cfg = EvalConfig(**_merge(base, section))
    return cfg.model_copy(
        update={"device": task_device(cfg.device, cfg.resources, "evaluate.device", "evaluate.resources")}
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
    from components.quantize import QuantizeConfig

    # recovery needs accuracy per budget only: full thinking, no cap sweep, no elastic pairs; the evaluation
    # runs inside the quantize task, on its resources
    evaluate = ctx.pipeline.evaluate.model_dump(exclude_unset=True)
    ev = {k: v for k, v in evaluate.items() if k not in ("think_caps", "elastic_pairs", "resources")}
    ev.update({"think_caps": [None], "elastic_pairs": [], "carry_state_compare": False, "progress": False})
    base = {"checkpoint_uri": _nested_dir(ctx), "output_dir": str(ctx.dir().resolve()), "evaluate": ev}
    section = ctx.pipeline.quantize.model_dump(exclude_unset=True)
    section["calibration"] = _inherit(ctx.pipeline, section.get("calibration") or {}, calibration=True)
    if ctx.pipeline.markers is not None:
        ev.setdefault("markers", ctx.pipeline.markers.model_dump())
    cfg = QuantizeConfig(**_merge(base, section))
    if cfg.evaluate is not None:
        device = cfg.evaluate.get("device", "auto")
        device = task_device(device, cfg.resources, "evaluate.device", "quantize.resources")
        cfg = cfg.model_copy(update={"evaluate": {**cfg.evaluate, "device": device}})
    return cfg


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
    from components.register import RegisterConfig

    section = ctx.pipeline.registry.model_dump(exclude_unset=True)
    return RegisterConfig(checkpoint_uri=_nested_dir(ctx), **section)


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
