"""Register the nested checkpoint in the MLflow model registry and gate its promotion.

One model version per pipeline execution, carrying tags per budget (architecture,
total/active parameters, accuracy, formats). A promotion gate from config decides
whether the version takes the ``champion`` alias: every budget must reach its
minimum accuracy, and none may regress by more than ``max_regression`` against
the current champion's recorded accuracy. A failing gate leaves the alias where
it was and records why (tag ``promotion``). Aliases, never the deprecated stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from components.tracking import MlflowTracker, Tracker


class PromotionGate(BaseModel):
    """When a new version may become the champion."""

    model_config = ConfigDict(extra="forbid")

    min_accuracy: dict[str, float] = Field(
        default_factory=dict, description="Per budget name: the lowest acceptable accuracy (0..1)."
    )
    default_min_accuracy: float = Field(0.0, ge=0, le=1, description="Minimum for budgets not listed above.")
    max_regression: float = Field(
        0.05, ge=0, le=1, description="Largest allowed accuracy drop of any budget against the current champion."
    )


class RegisterConfig(BaseModel):
    """Inputs of the register stage."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("star-elastic-demo", description="Registered model name.")
    alias: str = Field("champion", description="Alias the gate moves.")
    checkpoint_uri: str = Field(description="The nested checkpoint folder to register.")
    budgets: list[dict[str, Any]] = Field(
        default_factory=list, description="Per budget: name, architecture, total_params, active_params, accuracy."
    )
    formats: dict[str, str] = Field(
        default_factory=dict, description="Extra formats of the same family: format name -> checkpoint folder."
    )
    gate: PromotionGate = Field(default_factory=PromotionGate, description="Promotion rules.")


def gate_decision(
    budgets: list[dict[str, Any]], champion: dict[str, float] | None, gate: PromotionGate
) -> tuple[bool, list[str]]:
    """(promote?, reasons). ``champion`` maps budget name -> accuracy of the current champion."""
    reasons: list[str] = []
    for b in budgets:
        name, acc = b["name"], b.get("accuracy")
        if acc is None:
            reasons.append(f"budget {name}: no accuracy recorded")
            continue
        floor = gate.min_accuracy.get(name, gate.default_min_accuracy)
        if acc < floor:
            reasons.append(f"budget {name}: accuracy {acc:.3f} below the minimum {floor:.3f}")
        if champion and name in champion and acc < champion[name] - gate.max_regression:
            reasons.append(
                f"budget {name}: accuracy {acc:.3f} regresses more than {gate.max_regression:.3f} "
                f"against the champion's {champion[name]:.3f}"
            )
    return not reasons, reasons


def _champion_accuracy(client, name: str, alias: str) -> tuple[str | None, dict[str, float] | None]:
    try:
        mv = client.get_model_version_by_alias(name, alias)
    except Exception:  # no registered model or no alias yet
        return None, None
    acc = {k.split(".")[1]: float(v) for k, v in mv.tags.items() if k.startswith("budget.") and k.endswith(".accuracy")}
    return mv.version, acc


def run_register(cfg: RegisterConfig, tracker: Tracker) -> dict[str, Any]:
    """Log the checkpoint, create a model version with per-budget tags, apply the promotion gate."""
    if not isinstance(tracker, MlflowTracker):
        return {"registered": False, "reason": "tracking is off: nothing to register"}
    client = tracker.client
    tracker.log_artifact(cfg.checkpoint_uri, "model")
    for fmt, path in cfg.formats.items():
        tracker.log_artifact(path, f"model-{fmt}")
    try:
        client.get_registered_model(cfg.model_name)
    except Exception:
        client.create_registered_model(cfg.model_name, description="Nested elastic family in one checkpoint.")
    champion_version, champion_acc = _champion_accuracy(client, cfg.model_name, cfg.alias)
    source = f"runs:/{tracker.run_id}/model"
    mv = client.create_model_version(cfg.model_name, source, run_id=tracker.run_id)
    tags: dict[str, str] = {"checkpoint_uri": str(cfg.checkpoint_uri), "formats": ",".join(["bf16", *cfg.formats])}
    for b in cfg.budgets:
        prefix = f"budget.{b['name']}"
        tags[f"{prefix}.architecture"] = json.dumps(b.get("architecture", {}), sort_keys=True)
        for key in ("total_params", "active_params", "accuracy", "fraction"):
            if b.get(key) is not None:
                tags[f"{prefix}.{key}"] = str(b[key])
    promote, reasons = gate_decision(cfg.budgets, champion_acc, cfg.gate)
    tags["promotion"] = "promoted" if promote else "rejected: " + "; ".join(reasons)
    for k, v in tags.items():
        client.set_model_version_tag(cfg.model_name, mv.version, k, v)
    if promote:
        client.set_registered_model_alias(cfg.model_name, cfg.alias, mv.version)
    tracker.log_metrics({"promoted": float(promote)})
    tracker.set_tags({"model_version": mv.version, "promotion": tags["promotion"]})
    return {
        "registered": True,
        "model_name": cfg.model_name,
        "version": mv.version,
        "promoted": promote,
        "reasons": reasons,
        "previous_champion": champion_version,
        "model_uri": f"models:/{cfg.model_name}/{mv.version}",
        "champion_uri": f"models:/{cfg.model_name}@{cfg.alias}",
    }


def resolve_model_uri(uri: str, tracking_uri: str | None, dst: str | Path | None = None) -> Path:
    """``models:/NAME@alias`` or ``models:/NAME/VERSION`` -> a local folder with the nested checkpoint."""
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst) if dst else None)
    return Path(local)
