"""Plots of the evaluate stage, and the curve arithmetic behind the elastic-vs-standard comparison
(:func:`best_elastic_vs_standard`, :func:`carry_comparison`, on the stage's result rows).

Figures use matplotlib's object API on the Agg canvas, never ``pyplot`` (safe in a Ray worker or a
thread). Curve arithmetic works on the Pareto front of one pair's points, linearly interpolated
between measured caps and never extrapolated (``None`` outside the measured range).

Design notes (the plots, why linear interpolation): docs/stages.md ("Evaluation plots and curve arithmetic").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Point = tuple[float, float]
"""(latency in seconds per problem, accuracy in [0, 1])."""


# ---------------------------------------------------------------------- curve arithmetic
def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The non-dominated points, by increasing latency, with strictly increasing accuracy."""
    front: list[Point] = []
    for lat, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or acc > front[-1][1]:
            front.append((lat, acc))
    return front


def accuracy_at(front: Sequence[Point], latency: float) -> float | None:
    """Best accuracy within ``latency`` on a front (interpolated); None below its fastest point."""
    if not front or latency < front[0][0]:
        return None
    for (l0, a0), (l1, a1) in zip(front, front[1:], strict=False):
        if l0 <= latency <= l1:
            return a0 + (a1 - a0) * (latency - l0) / (l1 - l0) if l1 > l0 else a1
    return front[-1][1]


def latency_for(front: Sequence[Point], accuracy: float) -> float | None:
    """Least latency at which a front reaches ``accuracy`` (interpolated); None above its best accuracy."""
    if not front or accuracy > front[-1][1]:
        return None
    if accuracy <= front[0][1]:
        return front[0][0]
    for (l0, a0), (l1, a1) in zip(front, front[1:], strict=False):
        if a0 < accuracy <= a1:
            return l0 + (l1 - l0) * (accuracy - a0) / (a1 - a0)
    return front[-1][0]  # pragma: no cover - accuracy <= front[-1][1] is always bracketed above


# ---------------------------------------------------------------------- comparison
def _curve(rows: Sequence[dict[str, Any]], think: str, answer: str) -> list[dict[str, Any]]:
    return [
        r
        for r in rows
        if r["think_budget"] == think and r["answer_budget"] == answer and r["level"] == "all" and not r["carry_state"]
    ]


def best_elastic_vs_standard(results: dict[str, Any], cost_key: str = "mean_latency_s") -> dict[str, Any]:
    """The best elastic pair against standard budget control on the full budget.

    Method: the standard curve is the Pareto front of the full budget's (latency, accuracy)
    points over the caps, linearly interpolated between measured caps (no extrapolation). For
    each point of an elastic pair: ``accuracy gain at equal latency`` = its accuracy minus the
    front's accuracy at its latency; ``speedup at equal accuracy`` = the front's latency to reach
    its accuracy divided by its latency (> 1: elastic is faster). A pair's score is its largest
    gain (then its largest speedup); the best pair maximises it. ``None`` where a point lies
    outside the measured range of the standard curve. ``cost_key``: the row field used as latency
    (measured ``mean_latency_s``, or the ``mean_weight_passes`` proxy of :func:`weight_passes`).
    """
    rows = results["rows"]
    full = results["full_budget"]
    std_pts = [(r[cost_key], r["accuracy"]) for r in _curve(rows, full, full)]
    front = pareto_front(std_pts)
    pairs: dict[str, Any] = {}
    for think, answer in {(r["think_budget"], r["answer_budget"]) for r in rows}:
        if think == answer:
            continue
        points = []
        for r in _curve(rows, think, answer):
            lat, acc = r[cost_key], r["accuracy"]
            std_acc, std_lat = accuracy_at(front, lat), latency_for(front, acc)
            points.append(
                {
                    "think_cap": r["think_cap"],
                    "latency_s": lat,
                    "accuracy": acc,
                    "standard_accuracy_at_latency": std_acc,
                    "accuracy_gain": None if std_acc is None else acc - std_acc,
                    "standard_latency_at_accuracy": std_lat,
                    "speedup": None if std_lat is None or lat <= 0 else std_lat / lat,
                }
            )
        gains = [p for p in points if p["accuracy_gain"] is not None]
        speeds = [p for p in points if p["speedup"] is not None]
        pairs[f"{think}->{answer}"] = {
            "think_budget": think,
            "answer_budget": answer,
            "points": points,
            "best_gain": max(gains, key=lambda p: p["accuracy_gain"], default=None),
            "best_speedup": max(speeds, key=lambda p: p["speedup"], default=None),
        }
    out: dict[str, Any] = {
        "full_budget": full,
        "cost": cost_key,
        "standard_front": front,
        "pairs": pairs,
        "method": _METHOD,
    }
    if not pairs or not front:
        out["best_pair"] = None
        out["reason"] = "no elastic pairs were evaluated" if not pairs else "no standard curve for the full budget"
        return out

    def key(item: tuple[str, dict[str, Any]]) -> tuple[float, float]:
        s = item[1]
        gain = s["best_gain"]["accuracy_gain"] if s["best_gain"] else float("-inf")
        speed = s["best_speedup"]["speedup"] if s["best_speedup"] else float("-inf")
        return gain, speed

    name, best = max(sorted(pairs.items()), key=key)
    out["best_pair"] = name
    out["accuracy_gain_at_equal_latency"] = best["best_gain"]
    out["speedup_at_equal_accuracy"] = best["best_speedup"]
    return out


_METHOD = (
    "standard = Pareto front of the full budget over thinking caps, linear between measured caps; "
    "gain = elastic accuracy - standard accuracy at the same latency; "
    "speedup = standard latency to reach the elastic accuracy / elastic latency"
)


def carry_comparison(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per elastic pair and cap (overall rows): carried-state accuracy minus re-prefill accuracy, latency ratio."""
    base = {
        (r["think_budget"], r["answer_budget"], r["think_cap"]): r
        for r in rows
        if r["level"] == "all" and not r["carry_state"] and r["control"] == "elastic"
    }
    out: dict[str, Any] = {}
    for r in rows:
        if r["level"] != "all" or not r["carry_state"]:
            continue
        b = base[(r["think_budget"], r["answer_budget"], r["think_cap"])]
        cap = "none" if r["think_cap"] is None else str(r["think_cap"])
        out.setdefault(f"{r['think_budget']}->{r['answer_budget']}", {})[cap] = {
            "accuracy_delta": r["accuracy"] - b["accuracy"],
            "latency_ratio": r["mean_latency_s"] / b["mean_latency_s"] if b["mean_latency_s"] > 0 else None,
            "answer_fed_carry": r["mean_answer_fed"],
            "answer_fed_re_prefill": b["mean_answer_fed"],
            "carry_note": r.get("carry_note"),
        }
    return out


# ---------------------------------------------------------------------- plots
def _cap_key(cap: Any) -> float:
    return float("inf") if cap is None else float(cap)


def _label(think: str, answer: str) -> str:
    return think if think == answer else f"{think} -> {answer}"


def pareto_plot(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    title: str = "Accuracy vs latency per (think, answer) budget pair",
    x_key: str = "mean_latency_s",
    x_label: str = "mean latency per problem (s)",
) -> Path:
    """Write the two-panel PNG from overall result rows (``level == "all"``, ``carry_state`` False).

    Each row needs ``think_budget``, ``answer_budget``, ``think_cap`` (int or None),
    ``x_key`` (default ``mean_latency_s``) and ``accuracy``. Returns ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        curves.setdefault((r["think_budget"], r["answer_budget"]), []).append(r)
    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)
    ax, ax_cap = fig.subplots(1, 2)
    caps = sorted({r["think_cap"] for r in rows}, key=_cap_key)
    cap_pos = {c: i for i, c in enumerate(caps)}
    all_points: list[Point] = []
    for (think, answer), pts in curves.items():
        style = "-" if think == answer else "--"
        by_lat = sorted(pts, key=lambda r: r[x_key])
        xs = [r[x_key] for r in by_lat]
        ys = [r["accuracy"] for r in by_lat]
        (line,) = ax.plot(xs, ys, style, marker="o", markersize=4, label=_label(think, answer))
        for r in by_lat:
            cap = "none" if r["think_cap"] is None else str(r["think_cap"])
            ax.annotate(cap, (r[x_key], r["accuracy"]), fontsize=6, alpha=0.7, xytext=(2, 2),
                        textcoords="offset points")  # fmt: skip
        all_points.extend(zip(xs, ys, strict=True))
        by_cap = sorted(pts, key=lambda r: _cap_key(r["think_cap"]))
        ax_cap.plot([cap_pos[r["think_cap"]] for r in by_cap], [r["accuracy"] for r in by_cap], style, marker="o",
                    markersize=4, color=line.get_color(), label=_label(think, answer))  # fmt: skip
    front = pareto_front(all_points)
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="grey", alpha=0.5, lw=3,
                label="Pareto front", zorder=0)  # fmt: skip
    ax.set_xlabel(x_label)
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax_cap.set_xticks(range(len(caps)), ["none" if c is None else str(c) for c in caps])
    ax_cap.set_xlabel("thinking cap (tokens)")
    ax_cap.set_ylabel("accuracy")
    ax_cap.set_ylim(-0.02, 1.02)
    ax_cap.set_title("Accuracy vs thinking cap", fontsize=10)
    ax_cap.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
