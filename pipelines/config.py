"""The pipeline's YAML config: one validated document feeding every stage.

Top-level keys are typed here; each stage section is validated by that stage's
own config class when the pipeline builds its stage configs (before anything
runs), so an unknown key anywhere is reported with its full path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from components.parent import ParentTrainConfig
from components.register import PromotionGate


class ParentSection(BaseModel):
    """Where the parent comes from: an existing nemotron_h checkpoint, or the demo parent trained here."""

    model_config = ConfigDict(extra="forbid")

    uri: str | None = Field(None, description="A nemotron_h checkpoint folder (or s3:// URI); null trains one.")
    train: ParentTrainConfig = Field(default_factory=ParentTrainConfig, description="Used when uri is null.")


class ElasticSection(BaseModel):
    """The nested family: elastic axes with candidate sizes, and the budgets to train."""

    model_config = ConfigDict(extra="forbid")

    space: dict[str, Any] = Field(description="Candidate sizes per elastic axis (see model.elastic.space).")
    budgets: list[dict[str, Any]] = Field(description="Budgets: name and target fraction of active parameters.")


class RegisterSection(BaseModel):
    """Model registry settings."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("star-elastic-demo", description="Registered model name in MLflow.")
    alias: str = Field("champion", description="Alias moved by the promotion gate.")
    gate: PromotionGate = Field(default_factory=PromotionGate, description="Promotion rules.")


class PipelineConfig(BaseModel):
    """Everything one pipeline execution needs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    run_name: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$", description="Folder name under runs_dir.")
    runs_dir: str = Field("runs", description="Where every run writes (checkpoints, MLflow store, artifacts).")
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default sqlite:///<runs_dir>/mlflow.db (MLFLOW_TRACKING_URI wins)."
    )
    experiment: str = Field("star-elastic", description="MLflow experiment name.")
    storage_uri: str | None = Field(None, description="s3://bucket/prefix to publish stage outputs to; null: local.")
    threads: int = Field(2, ge=1, description="torch CPU threads per process on the driver.")
    parent: ParentSection = Field(default_factory=ParentSection, description="The parent model.")
    elastic: ElasticSection = Field(description="Elastic axes and budgets.")
    rank: dict[str, Any] = Field(default_factory=dict, description="Rank stage settings.")
    distill_phase1: dict[str, Any] = Field(default_factory=dict, description="Phase 1 (short context) settings.")
    distill_phase2: dict[str, Any] = Field(default_factory=dict, description="Phase 2 (long context) settings.")
    export: dict[str, Any] = Field(default_factory=dict, description="Export settings.")
    evaluate: dict[str, Any] = Field(default_factory=dict, description="Evaluation settings.")
    quantize: dict[str, Any] = Field(default_factory=dict, description="Quantization settings.")
    registry: RegisterSection = Field(
        default_factory=RegisterSection, alias="register", description="Registry and promotion (YAML key: register)."
    )
    serve: dict[str, Any] = Field(default_factory=dict, description="Serving settings (star-elastic serve).")

    @model_validator(mode="after")
    def _budgets_named(self) -> PipelineConfig:
        names = [b.get("name") for b in self.elastic.budgets]
        if len(set(names)) != len(names) or None in names:
            raise ValueError(f"elastic.budgets: every budget needs a unique name, got {names}")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run_name

    def resolved_tracking_uri(self) -> str:
        import os

        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        if self.tracking_uri:
            return self.tracking_uri
        return f"sqlite:///{Path(self.runs_dir).resolve() / 'mlflow.db'}"


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown key; remove it or fix its spelling" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def set_by_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``a.b.c=value`` override on a nested dict (value parsed as YAML)."""
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")
    cur[keys[-1]] = yaml.safe_load(value) if isinstance(value, str) else value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``key.path=value`` strings to a nested dict in place (values parsed as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key.path=value")
        key, value = item.split("=", 1)
        set_by_path(data, key.strip(), value)


def load_pipeline_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML file, apply ``key.path=value`` overrides, validate; every problem listed by field path."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"config file {p} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping at the top level")
    apply_overrides(data, overrides or [])
    try:
        return PipelineConfig(**data)
    except ValidationError as err:
        raise ValueError(f"{p}: invalid pipeline config:\n{_describe(err)}") from None
