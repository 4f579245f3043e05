"""Registration and the promotion gate against a real MLflow server process."""

from __future__ import annotations

import pytest
import torch

from components.model_uri import resolve_model_uri
from components.register import PromotionGate, RegisterConfig, gate_decision, run_register
from components.tracking import MlflowTracker
from model.hybrid import HybridLM

pytestmark = pytest.mark.integration


def _budgets(acc_full: float, acc_small: float) -> list[dict]:
    return [
        {"name": "full", "architecture": {}, "total_params": 100, "active_params": 50, "accuracy": acc_full},
        {"name": "small", "architecture": {"hidden": 16}, "total_params": 60, "active_params": 28}
        | {"accuracy": acc_small},
    ]


def test_register_and_gate(mlflow_server, tiny_nested_checkpoint, tmp_path):
    ck = tiny_nested_checkpoint
    name = "gate-test"
    gate = PromotionGate(min_accuracy={"small": 0.3}, max_regression=0.05)

    def register(acc_full, acc_small):
        tracker = MlflowTracker(mlflow_server, "registry-test", run_name="register")
        out = run_register(
            RegisterConfig(model_name=name, checkpoint_uri=str(ck), budgets=_budgets(acc_full, acc_small), gate=gate),
            tracker,
        )
        tracker.finish()
        return out, tracker.client

    first, client = register(0.9, 0.6)
    assert first["promoted"] and first["version"] == "1"
    assert client.get_model_version_by_alias(name, "champion").version == "1"
    mv = client.get_model_version(name, "1")
    assert mv.tags["budget.small.accuracy"] == "0.6" and mv.tags["budget.small.active_params"] == "28"

    second, _ = register(0.8, 0.6)  # full regresses by 0.1 > 0.05
    assert not second["promoted"] and "regresses" in second["reasons"][0]
    assert client.get_model_version_by_alias(name, "champion").version == "1"  # alias unchanged
    assert client.get_model_version(name, second["version"]).tags["promotion"].startswith("rejected")

    third, _ = register(0.92, 0.2)  # small under its minimum
    assert not third["promoted"] and "below the minimum" in " ".join(third["reasons"])

    fourth, _ = register(0.93, 0.62)
    assert fourth["promoted"] and client.get_model_version_by_alias(name, "champion").version == fourth["version"]

    local = resolve_model_uri(f"models:/{name}@champion", mlflow_server, tmp_path / "dl")
    loaded = HybridLM.from_pretrained(local)
    ids = torch.randint(0, 64, (1, 6))
    original = HybridLM.from_pretrained(ck)
    assert torch.equal(loaded(ids).logits, original(ids).logits)


def test_gate_rules_without_champion():
    ok, reasons = gate_decision(_budgets(0.5, 0.1), None, PromotionGate(default_min_accuracy=0.2))
    assert not ok and "small" in reasons[0]
    ok, _ = gate_decision(_budgets(0.5, 0.3), None, PromotionGate(default_min_accuracy=0.2))
    assert ok
