"""What the evaluate stage makes of its result rows: the results document, its files and the headline metrics.

The stage (:func:`components.evaluate.run_evaluate`) decodes and scores; this module only reads the rows it
produced (one per (think budget, answer budget, control, carry state, cap, level), plus an ``"all"`` row per
run aggregated over the levels) and turns them into:

* :func:`build_results` - the ``results.json`` document: every budget's accuracy with full thinking, the rows,
  and the elastic-vs-standard comparisons (:mod:`components.eval_plots`) by measured latency and by the
  weight-pass proxy;
* :func:`write_results` - ``results.json``, ``results.csv`` and the two Pareto plots in the output folder;
* :func:`headline_metrics` - the flat metrics MLflow gets (accuracy per budget and level, each pair's accuracy
  and latency per cap, the comparison's gains).

No decoding, no model, no tracker: plain data in, plain data (or files) out.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from components.eval_plots import best_elastic_vs_standard, carry_comparison, pareto_plot

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
PLOT_FILE = "pareto.png"
PROXY_PLOT_FILE = "pareto_weight_passes.png"
CSV_COLUMNS = (
    "think_budget",
    "answer_budget",
    "control",
    "carry_state",
    "think_cap",
    "level",
    "n",
    "accuracy",
    "mean_latency_s",
    "mean_weight_passes",
    "mean_think_tokens",
    "mean_answer_tokens",
    "mean_think_generated",
    "mean_answer_fed",
)


def cap_label(cap: int | None) -> str:
    """A thinking cap as the tables and metric names spell it (``"none"`` for no cap)."""
    return "none" if cap is None else str(cap)


def _metric_name(*parts: Any) -> str:
    return "/".join(re.sub(r"[^\w.\- ]", "_", str(p)) for p in parts)


def _write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "think_cap": cap_label(r["think_cap"])})


def overall_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows over every level (``"all"``) of the runs that re-prefill: what the plots and metrics show."""
    return [r for r in rows if r["level"] == "all" and not r["carry_state"]]


def build_results(
    config: Mapping[str, Any],
    active_params: Mapping[str, int],
    levels: Mapping[str, int],
    rows: Sequence[dict[str, Any]],
    carry_state_compare: bool = False,
) -> dict[str, Any]:
    """The ``results.json`` document. ``config``: the stage's settings as logged; ``active_params``: budget ->
    active parameters, the full budget first; ``levels``: table label -> problems; ``rows``: the stage's rows."""
    names = list(active_params)
    per_budget: dict[str, dict[str, float]] = {b: {} for b in names}  # full thinking, per level and "all"
    for r in rows:
        if r["control"] == "standard" and r["think_cap"] is None and not r["carry_state"]:
            per_budget[r["think_budget"]][r["level"]] = r["accuracy"]
    results: dict[str, Any] = {
        "config": dict(config),
        "full_budget": names[0],
        "budgets": [{"name": b, "active_params": active_params[b]} for b in names],
        "levels": dict(levels),
        "accuracy_per_budget": per_budget,
        "rows": list(rows),
    }
    results["comparison"] = best_elastic_vs_standard(results)
    # At demo size a decode step costs its operator overhead whatever the budget, so measured latency
    # cannot show what a smaller think budget saves; the weight-pass proxy shows it where weights dominate.
    results["comparison_weight_passes"] = best_elastic_vs_standard(results, "mean_weight_passes")
    if carry_state_compare:
        results["carry_vs_re_prefill"] = carry_comparison(rows)
    return results


def write_results(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.csv`` and both Pareto plots (latency, weight passes) into ``out``;
    returns their paths by kind (``json``, ``csv``, ``plot``, ``proxy_plot``)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / RESULTS_JSON, "csv": out / RESULTS_CSV}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    _write_csv(results["rows"], paths["csv"])
    overall = overall_rows(results["rows"])
    paths["plot"] = pareto_plot(overall, out / PLOT_FILE)
    paths["proxy_plot"] = pareto_plot(
        overall,
        out / PROXY_PLOT_FILE,
        title="Accuracy vs weight-bound latency proxy per (think, answer) pair",
        x_key="mean_weight_passes",
        x_label="full-model forward passes per problem (active-parameter weighted)",
    )
    return paths


def _comparison_metrics(comparison: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """The accuracy gain at equal cost and the speedup at equal accuracy of one comparison, when measured."""
    out: dict[str, float] = {}
    if comparison.get("accuracy_gain_at_equal_latency"):
        out[f"{prefix}/accuracy_gain"] = comparison["accuracy_gain_at_equal_latency"]["accuracy_gain"]
    if comparison.get("speedup_at_equal_accuracy"):
        out[f"{prefix}/speedup"] = comparison["speedup_at_equal_accuracy"]["speedup"]
    return out


def headline_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """The flat metrics of a results document: ``acc/<budget>`` (and ``/L<level>``), per pair and cap its
    accuracy and latency, ``latency_s/<budget>`` with full thinking, and the comparisons' gains."""
    metrics: dict[str, float] = {}
    for b, accs in results["accuracy_per_budget"].items():
        metrics[_metric_name("acc", b)] = accs["all"]
        for label, acc in accs.items():
            if label != "all":
                metrics[_metric_name("acc", b, f"L{label}")] = acc
    for r in overall_rows(results["rows"]):
        stem = ("pair", r["think_budget"], r["answer_budget"], f"cap_{cap_label(r['think_cap'])}")
        metrics[_metric_name(*stem, "acc")] = r["accuracy"]
        metrics[_metric_name(*stem, "latency_s")] = r["mean_latency_s"]
        if r["think_budget"] == r["answer_budget"] and r["think_cap"] is None:
            metrics[_metric_name("latency_s", r["think_budget"])] = r["mean_latency_s"]
    metrics.update(_comparison_metrics(results["comparison"], "elastic_vs_standard"))
    metrics.update(_comparison_metrics(results["comparison_weight_passes"], "elastic_vs_standard_weight_passes"))
    return metrics
