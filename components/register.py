"""Register the nested checkpoint in the MLflow model registry and gate its promotion.

Every format of one pipeline execution (the dense nested checkpoint, and the FP8 / NVFP4 ones the
quantize stage writes) is logged as an MLflow pyfunc model (:mod:`components.mlflow_model`: the
checkpoint inside, a ``predict`` that answers chat and completion requests on any budget) and
becomes one version of the registered model. Each version carries tags a deployment can select by:

* ``format`` (``dense``, ``fp8``, ``nvfp4``), ``formats`` (the family, e.g. ``dense,fp8,nvfp4``) and
  ``version.<format>`` (the version number of each sibling);
* ``budgets`` (names, largest first) and per budget ``budget.<name>.architecture``, ``.total_params``,
  ``.active_params``, ``.fraction`` (and ``.accuracy`` on the dense version, which was evaluated);
* ``promotion`` (``promoted`` or ``rejected: <reasons>``) and ``checkpoint_uri``.

A promotion gate from config decides whether the family takes the alias (``champion``): every
budget must reach its minimum accuracy, and none may regress by more than ``max_regression``
against the current champion's recorded accuracy. Promotion moves ``<alias>`` to the dense version
and ``<alias>-<format>`` (e.g. ``champion-fp8``) to each quantized one, and drops a
``<alias>-<format>`` the new family lacks; a failing gate moves nothing and records why. Aliases,
never the deprecated stages.

Logging a format loads it once: MLflow runs the pyfunc on its input example to check it loads and
answers. The pipeline therefore runs this stage as a Ray task with ``resources``
(:mod:`components.stage_task`), so that check runs on a worker and the driver holds no model.

Reading a registered version back (``models:/`` URIs) is :mod:`components.model_uri`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from components.model_uri import BASE_FORMAT
from components.settings import MlflowStore
from components.stage_task import TaskResources
from components.tracking import MlflowTracker, Tracker

QUANTIZED_FORMATS = ("fp8", "nvfp4", "nvfp4_w4a4")


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

    model_config = ConfigDict(extra="forbid", frozen=True)  # resolved once, then only read

    model_name: str = Field(
        "star-elastic-demo",
        pattern=r"^[^/:]*[^/:\s][^/:]*$",
        description="Registered model name (not blank, no '/' or ':').",
    )
    alias: str = Field(
        "champion", pattern=r"^[A-Za-z0-9_-]+$", description="Alias the gate moves (letters, digits, '_', '-')."
    )
    checkpoint_uri: str = Field(description="The nested checkpoint folder to register.")
    budgets: list[dict[str, Any]] = Field(
        default_factory=list, description="Per budget: name, architecture, total_params, active_params, accuracy."
    )
    formats: dict[str, str] = Field(
        default_factory=dict, description="Extra formats of the same family: format name -> checkpoint folder."
    )
    gate: PromotionGate = Field(default_factory=PromotionGate, description="Promotion rules.")
    resources: TaskResources = Field(
        default_factory=TaskResources,
        description="The Ray task the pipeline's register stage runs in (components.stage_task.TaskResources). "
        "Logging a format as an MLflow model loads it once and answers the input example (MLflow's check), so "
        "the task needs the largest format's memory.",
    )


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


def version_tags(cfg: RegisterConfig, fmt: str, versions: dict[str, str], promotion: str) -> dict[str, str]:
    """The tags of the ``fmt`` version of a family whose versions are ``versions`` (format -> version)."""
    tags = {
        "format": fmt,
        "formats": ",".join(versions),
        "checkpoint_uri": str(cfg.checkpoint_uri if fmt == BASE_FORMAT else cfg.formats[fmt]),
        "budgets": ",".join(b["name"] for b in cfg.budgets),
        "promotion": promotion,
    }
    tags.update({f"version.{f}": v for f, v in versions.items()})
    for b in cfg.budgets:
        prefix = f"budget.{b['name']}"
        tags[f"{prefix}.architecture"] = json.dumps(b.get("architecture", {}), sort_keys=True)
        # accuracy was measured on the dense checkpoint only; the quantize stage reports each format's recovery
        keys = ("total_params", "active_params", "fraction") + (("accuracy",) if fmt == BASE_FORMAT else ())
        for key in keys:
            if b.get(key) is not None:
                tags[f"{prefix}.{key}"] = str(b[key])
    return tags


def _move_aliases(client, cfg: RegisterConfig, versions: dict[str, str]) -> dict[str, str]:
    """Point ``alias`` and ``alias-<format>`` at the family; drop ``alias-<format>`` for formats it lacks."""
    aliases = {(cfg.alias if fmt == BASE_FORMAT else f"{cfg.alias}-{fmt}"): v for fmt, v in versions.items()}
    for alias, version in aliases.items():
        client.set_registered_model_alias(cfg.model_name, alias, version)
    existing = client.get_registered_model(cfg.model_name).aliases
    for fmt in QUANTIZED_FORMATS:
        stale = f"{cfg.alias}-{fmt}"
        if fmt not in versions and stale in existing:
            client.delete_registered_model_alias(cfg.model_name, stale)
    return aliases


def run_register(cfg: RegisterConfig, tracker: Tracker) -> dict[str, Any]:
    """Log every format as a pyfunc model, create a tagged version of each, apply the promotion gate."""
    from components.mlflow_model import log_nested_model

    if not isinstance(tracker, MlflowTracker):
        return {"registered": False, "reason": "tracking is off: nothing to register"}
    client = tracker.client
    try:
        client.get_registered_model(cfg.model_name)
    except Exception:
        client.create_registered_model(cfg.model_name, description="Nested elastic family in one checkpoint.")
    champion_version, champion_acc = _champion_accuracy(client, cfg.model_name, cfg.alias)
    family = {BASE_FORMAT: cfg.checkpoint_uri, **cfg.formats}
    versions: dict[str, str] = {}
    for fmt, folder in family.items():
        info = log_nested_model(
            folder,
            tracking_uri=tracker.tracking_uri,
            registry_uri=tracker.registry_uri,
            run_id=tracker.run_id,
            experiment_id=tracker.experiment_id,
            name="model" if fmt == BASE_FORMAT else f"model-{fmt}",
        )
        names = ", ".join(b["name"] for b in cfg.budgets)
        # MLflow's SQL registry reads a models:/<model_id> source through the process-wide store, not the client's
        with MlflowStore.of(tracker.tracking_uri, tracker.registry_uri).process_wide():
            mv = client.create_model_version(
                cfg.model_name, info.model_uri, run_id=tracker.run_id, model_id=info.model_id,
                description=f"{fmt} weights; every budget in one checkpoint ({names})",
            )  # fmt: skip
        versions[fmt] = mv.version
    promote, reasons = gate_decision(cfg.budgets, champion_acc, cfg.gate)
    promotion = "promoted" if promote else "rejected: " + "; ".join(reasons)
    for fmt, version in versions.items():
        for k, v in version_tags(cfg, fmt, versions, promotion).items():
            client.set_model_version_tag(cfg.model_name, version, k, v)
    aliases = _move_aliases(client, cfg, versions) if promote else {}
    tracker.log_metrics({"promoted": float(promote)})
    tracker.set_tags(
        {"model_version": versions[BASE_FORMAT], "promotion": promotion}
        | {f"model_version.{fmt}": v for fmt, v in versions.items()}
    )
    return {
        "registered": True,
        "model_name": cfg.model_name,
        "version": versions[BASE_FORMAT],
        "versions": versions,
        "aliases": aliases,
        "promoted": promote,
        "reasons": reasons,
        "previous_champion": champion_version,
        "model_uri": f"models:/{cfg.model_name}/{versions[BASE_FORMAT]}",
        "champion_uri": f"models:/{cfg.model_name}@{cfg.alias}",
    }
