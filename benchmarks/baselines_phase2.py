"""What phase 2 does where it should matter: a run whose phase 1 sees only short problems in short
rows and whose phase 2 sees longer problems in longer rows (``pipelines/configs/demo-long.yaml``),
scored on long problems after phase 1 and after phase 2.

"After phase 1" is the phase-1 student exported on its own (its router's architectures, through the
export stage's own settings) as if the run had stopped there; "after phase 2" is the run's nested
checkpoint. Both are scored per budget on the run's evaluate-stage problems (its ``levels`` and
``n_per_level``: the long problems), greedy with full thinking, with binomial standard errors; the
phase-2 effect's error is the unpaired one (both models answer the same problems).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.baselines_common import difference, distill_configs, ensure_trained, nested_accuracy
from benchmarks.common import format_table, load_average
from components.data import TextTokenizer
from components.distill.export import run_export
from components.evaluate import problem_sets
from model.elastic.export import read_elastic
from model.elastic.params import count_params
from model.elastic.slicing import extract
from model.hybrid import HybridLM

HEADING = "## Phase 2 on long problems"


def _budget_models(nested_dir: Path) -> tuple[HybridLM, Any]:
    return HybridLM.from_pretrained(nested_dir).eval(), read_elastic(nested_dir)


@torch.no_grad()
def run_phase2_ablation(config_path: str, overrides: list[str], run_missing: bool) -> dict[str, Any]:
    """Train the run if asked (and needed), export its phase-1 student, score both on long problems."""
    load_start, start = load_average(), time.perf_counter()
    ensure_trained(config_path, overrides, run_missing)
    cfg, p1, p2, export, ev = distill_configs(config_path, overrides)
    teacher_dir = Path(p1.teacher_uri)
    phase1_nested = cfg.run_dir / "bench_baselines" / "phase1_nested"
    shutil.rmtree(phase1_nested, ignore_errors=True)
    run_export(p1.output_dir, phase1_nested, export.allow_off_target, export.tolerance, None, export.select)

    tok = TextTokenizer.load(teacher_dir)
    teacher = HybridLM.from_pretrained(teacher_dir).eval()
    after = {"phase1": _budget_models(phase1_nested), "phase2": _budget_models(Path(export.output_dir))}
    sets = problem_sets(ev)
    per_level = [ev.n_per_level]
    max_new = ev.think_limit + ev.max_answer_tokens
    full = count_params(teacher.config)
    print(f"phase-2 ablation ({config_path}): {sum(len(s) for s in sets.values())} problems, levels {ev.levels}")
    parent = nested_accuracy(teacher, tok, sets, per_level, max_new)
    budgets = []
    for name in [b.name for b in after["phase2"][1].budgets]:
        row: dict[str, Any] = {"name": name}
        for phase, (model, info) in after.items():
            b = next(x for x in info.budgets if x.name == name)
            acc = nested_accuracy(extract(model, b.architecture, info.depth_order), tok, sets, per_level, max_new)
            row[phase] = {
                "active": b.active_params,
                "total": b.total_params,
                "architecture": b.architecture.to_dict(),
                "accuracy": next(iter(acc.values())),
            }
        row["effect"] = difference(row["phase2"]["accuracy"], row["phase1"]["accuracy"])
        print(f"  {name}: {row['phase1']['accuracy']} -> {row['phase2']['accuracy']}", flush=True)
        budgets.append(row)
    return {
        "config": config_path,
        "overrides": overrides,
        "levels": ev.levels,
        "n_per_level": ev.n_per_level,
        "phase1": _phase_summary(p1),
        "phase2": _phase_summary(p2),
        "full": {"active": full.active, "total": full.total},
        "parent": next(iter(parent.values())),
        "budgets": budgets,
        "seconds": time.perf_counter() - start,
        "load_average": (load_start, load_average()),
    }


def _phase_summary(p: Any) -> dict[str, Any]:
    sources = [s.model_dump(include={"type", "min_steps", "max_steps"}) for s in p.data.sources]
    rows = p.micro_batch_size * p.num_workers * p.grad_accum_steps
    return {"steps": p.steps, "rows": rows, "seq_len": p.seq_len, "pack": p.data.pack, "sources": sources}


def _acc(a: dict[str, float]) -> str:
    return f"{a['accuracy']:.3f} ± {a['se']:.3f}"


def phase2_table(results: dict[str, Any]) -> str:
    full = results["full"]["active"]
    rows = [["parent", f"{full:,}", f"{full:,}", _acc(results["parent"]), _acc(results["parent"]), ""]]
    for r in results["budgets"]:
        a1, a2 = r["phase1"]["active"], r["phase2"]["active"]
        rows.append(
            [
                r["name"],
                f"{a1:,} ({a1 / full:.3f})",
                f"{a2:,} ({a2 / full:.3f})",
                _acc(r["phase1"]["accuracy"]),
                _acc(r["phase2"]["accuracy"]),
                f"{r['effect']['diff']:+.3f} ± {r['effect']['se']:.3f}",
            ]
        )
    headers = ["budget", "active after phase 1", "active after phase 2", "after phase 1", "after phase 2", "phase 2"]
    return format_table(headers, rows)


def _describe(phase: dict[str, Any]) -> str:
    src = ", ".join(f"{s.get('min_steps')}-{s.get('max_steps')} steps" for s in phase["sources"])
    return f"{phase['steps']} steps of {phase['rows']} x {phase['seq_len']} tokens, problems of {src}"


def phase2_section(results: dict[str, Any], command: str) -> str:
    """The Markdown section of the ablation."""
    n = results["parent"]["n"]
    smallest = results["budgets"][-1]
    load = results["load_average"]
    lines = [
        HEADING,
        "",
        f"Phase 1 on short problems only, phase 2 on longer problems in longer rows "
        f"(`{results['config']}`: phase 1 {_describe(results['phase1'])}; phase 2 "
        f"{_describe(results['phase2'])}), scored on {n} long held-out problems (levels {results['levels']}, "
        f"{results['n_per_level']} each, greedy, full thinking). Cells are accuracy ± binomial standard error; "
        "'after phase 1' is the phase-1 student exported on its own (its router's architectures), 'after "
        "phase 2' the run's nested checkpoint; the phase-2 column is the difference with the unpaired error.",
        "",
        "```",
        command,
        "```",
        "",
        phase2_table(results),
        "",
        f"Smallest budget ({smallest['name']}): {_acc(smallest['phase1']['accuracy'])} after phase 1, "
        f"{_acc(smallest['phase2']['accuracy'])} after phase 2 ({smallest['effect']['diff'] * 100:+.1f} ± "
        f"{smallest['effect']['se'] * 100:.1f} points; the published ablation: +19.8 points for the smallest "
        f"variant). {results['seconds']:.0f} s; load average (1 min) "
        f"{load[0][0] if load[0] else float('nan'):.2f} at the start, {load[1][0] if load[1] else float('nan'):.2f} "
        "at the end.",
        "",
    ]
    return "\n".join(lines)
