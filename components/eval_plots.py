"""Plots of the evaluate stage, and the curve arithmetic behind the elastic-vs-standard comparison.

Design choices:

* Figures are built on matplotlib's object API with the Agg canvas (``Figure`` +
  ``FigureCanvasAgg``), never ``pyplot``: no global figure state, no display needed, safe in a
  Ray worker or a thread.
* The main plot is accuracy (y) against mean latency per problem (x), one curve per
  (think budget, answer budget) pair through its thinking caps (sorted by latency), standard
  pairs solid and elastic pairs dashed, with the Pareto front of all points in grey. A second
  panel shows accuracy against the thinking cap (the uncapped point at the right end).
* Curve arithmetic works on the Pareto front of one pair's points -- the best accuracy reachable
  within a latency -- linearly interpolated between measured caps. Linear interpolation between
  two operating points is achievable by serving a matching share of requests at each cap, so it
  is an honest (if conservative) reading of what lies between two measurements. Nothing is
  extrapolated: outside the measured range the answer is ``None``.
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
