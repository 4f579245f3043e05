"""The stages of the pipeline: adapters from the pipeline config to each component's config and function.

Each adapter's ``build`` returns the stage's validated config using the
deterministic folders of upstream stages; ``run`` calls the component and
returns JSON-able outputs (URIs and metrics) recorded in the stage marker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from components.tracking import Tracker
from pipelines.config import PipelineConfig
from pipelines.runner import StageContext, StageSpec


def _merge(base: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """``section`` over ``base`` (one level deep for nested dicts)."""
    out = dict(base)
    for k, v in section.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
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
    train = cfg.parent.train.model_copy(update={"output_dir": str(_parent_dir(ctx))})
    return ParentStageConfig(train=train.model_dump())


def run_parent(cfg: ParentStageConfig, tracker: Tracker, ctx: StageContext) -> dict[str, Any]:
    from components.parent import ParentTrainConfig, train_parent
    from components.storage import materialize
    from model.hybrid import HybridLM

    if cfg.uri:
        local = materialize(cfg.uri)
        model = HybridLM.from_pretrained(local)  # fails early, naming tensors, if the checkpoint is bad
        tracker.log_params({"parent_uri": cfg.uri, "num_parameters": model.num_parameters()})
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


STAGES: list[StageSpec] = [
    StageSpec("parent", [], build_parent, run_parent, "the parent checkpoint (train the demo parent if none given)"),
]


def pipeline_stages() -> list[StageSpec]:
    """Every stage of the DAG, in order."""
    return list(STAGES)


def summary_json(outputs: dict[str, dict[str, Any]]) -> str:
    return json.dumps(outputs, indent=2, default=str)
