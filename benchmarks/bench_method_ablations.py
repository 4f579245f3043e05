"""Each change of the method as published, switched off alone, against the demo run that has them all.

The demo run (``make run``: ``--base-run``, default ``runs/demo``) has every change. Each variant
below is the same demo pipeline (parent -> rank -> phase 1 -> phase 2 -> export) run in its own
folder under ``--runs-dir`` from a copy of the source tree at ``--commit`` (``git archive``), with
one change undone by a config edit or by a literal text replacement in the copy (each replacement must
match exactly once, so a stale variant fails loudly instead of measuring nothing):

* ``mask-formulas-before``: the soft expert mask and the norm scale as they were (selection on
  ``s + b + log m`` with the weights renormalised and then scaled by ``m``; norms scaled by
  ``sqrt(E[p])``) instead of the reference's (selection on ``m (s + b)``, weights ``m s``
  renormalised; ``E[sqrt p]``);
* ``schedule-restart``: phase 2 restarts the router's anneal over its own steps instead of
  continuing phase 1's;
* ``active-target-only``: the small budget states only its active target (0.56), as before, not
  ``{total: 0.45, active: 0.56}``;
* ``grad-accum-2``: two micro-batches of half the rows per update, a budget drawn per micro-batch
  (the same rows per update as the demo's one);
* ``before``: the commit before all of these changes (``--before-commit``), with its own demo config;
* ``seed-1``: the demo as it is with distillation seed 1: the run-to-run noise floor.

Every exported budget is scored on the same held-out problems as ``bench_baselines.py`` (the
evaluate stage's levels and seed, the first 30 and 100 per level: 180 and 600 problems, greedy, full
thinking), with binomial standard errors and each variant's difference from the demo run.

    python benchmarks/bench_method_ablations.py --commit <sha> --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import yaml

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baselines_common import difference, distill_configs, nested_accuracy  # noqa: E402
from benchmarks.common import format_table, load_average, machine_info, replace_section, save_json  # noqa: E402
from components.data import TextTokenizer  # noqa: E402
from components.evaluate import problem_sets  # noqa: E402
from model.elastic.export import read_elastic  # noqa: E402
from model.elastic.slicing import extract  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402

HEADING = "## Each change of the method, switched off alone"
DEMO = "pipelines/configs/demo.yaml"
STAGES = ("parent", "rank", "distill_phase1", "distill_phase2", "export")


@dataclass(frozen=True)
class Variant:
    """One change undone: by text replacements in the source copy and/or an edit of the demo config."""

    name: str
    what: str
    replacements: tuple[tuple[str, str, str], ...] = ()  # (path, old text, new text)
    edit: Callable[[dict[str, Any]], None] | None = None
    before: bool = False  # the source tree of --before-commit instead of --commit
    extra: dict[str, Any] = field(default_factory=dict)


def _active_only(cfg: dict[str, Any]) -> None:
    cfg["elastic"]["budgets"] = [
        {"name": "small", "fraction": 0.56} if b["name"] == "small" else b for b in cfg["elastic"]["budgets"]
    ]


def _grad_accum(cfg: dict[str, Any]) -> None:
    for phase in ("distill_phase1", "distill_phase2"):
        section = cfg[phase]
        section["micro_batch_size"] //= 2
        section["grad_accum_steps"] = 2


def _seed(cfg: dict[str, Any]) -> None:
    for phase in ("distill_phase1", "distill_phase2"):
        cfg[phase]["seed"] = 1


VARIANTS = (
    Variant(
        "mask-formulas-before",
        "soft expert mask: select on s+b+log m, weights renormalised then x m; norm scale sqrt(E[p])",
        replacements=(
            (
                "model/moe.py",
                "            choice = torch.where(m > 0, m * choice, -torch.inf)\n            scores = scores * m\n",
                "            choice = choice + torch.log(m.clamp_min(0.0))\n",
            ),
            (
                "model/moe.py",
                "            w = w / (w.sum(-1, keepdim=True) + 1e-20)\n",
                "            w = w / (w.sum(-1, keepdim=True) + 1e-20)\n"
                "        if expert_mask is not None:\n"
                "            w = w * expert_mask.float()[idx]\n",
            ),
            (
                "model/norms.py",
                "return fraction.fraction, fraction.scale",
                "return fraction.fraction, fraction.fraction.sqrt()",
            ),
        ),
    ),
    Variant(
        "schedule-restart",
        "phase 2 restarts the router anneal over its own steps",
        replacements=(
            (
                "components/distill/config.py",
                "if config.phase == 2 and config.init_from and (rc.step_offset == 0 or rc.schedule_steps is None):",
                "if False:",
            ),
        ),
    ),
    Variant("active-target-only", "small budget: active 0.56 only (no total target)", edit=_active_only),
    Variant("grad-accum-2", "2 micro-batches of half the rows per update, a budget per micro-batch", edit=_grad_accum),
    Variant("before", "the commit before all of these changes, its own demo config", before=True),
    Variant("seed-1", "the demo as it is, distillation seed 1 (noise floor)", edit=_seed),
)


def source_tree(repo: Path, commit: str, dst: Path, replacements: tuple[tuple[str, str, str], ...]) -> Path:
    """``dst`` holding ``commit``'s tracked files with ``replacements`` applied (each must match once)."""
    if not (dst / "pyproject.toml").exists():
        dst.mkdir(parents=True, exist_ok=True)
        blob = subprocess.run(["git", "-C", str(repo), "archive", commit], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=BytesIO(blob)) as tar:
            tar.extractall(dst, filter="data")
        for rel, old, new in replacements:
            path = dst / rel
            text = path.read_text()
            if text.count(old) != 1:
                n = text.count(old)
                raise SystemExit(f"{commit}:{rel}: the text to replace occurs {n} times, not once:\n{old}")
            path.write_text(text.replace(old, new))
    return dst


def train(variant: Variant, args: argparse.Namespace) -> Path:
    """Run the variant's pipeline up to export (skipped when its export is done); its run folder."""
    home = Path(args.runs_dir).resolve() / variant.name
    commit = args.before_commit if variant.before else args.commit
    src = source_tree(Path(args.repo), commit, home / "src", variant.replacements)
    cfg = yaml.safe_load((src / DEMO).read_text())
    if variant.edit:
        variant.edit(cfg)
    cfg["runs_dir"] = str(home / "runs")
    config = home / "config.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = home / "runs" / cfg.get("run_name", "demo")
    if (run_dir / "export" / "_stage.json").exists():
        return run_dir
    command = [sys.executable, "-m", "pipelines.cli", "run", str(config), *(a for s in STAGES for a in ("--only", s))]
    print(f"{variant.name}: {shlex.join(command)} (in {src})", flush=True)
    env = {**os.environ, "PYTHONPATH": str(src)}  # the copy's code, for the driver and Ray's workers alike
    for attempt in range(1, args.attempts + 1):
        # a busy machine can time out Ray's start-up; the runner resumes the stages already done
        if subprocess.call(command, cwd=src, env=env) == 0:
            return run_dir
        print(f"{variant.name}: the pipeline failed (attempt {attempt} of {args.attempts})", flush=True)
    raise SystemExit(f"{variant.name}: the pipeline failed {args.attempts} times")


def stage_seconds(run_dir: Path) -> float:
    return sum(json.loads((run_dir / s / "_stage.json").read_text()).get("seconds", 0.0) for s in STAGES[2:4])


def score_run(run_dir: Path, sets: dict[str, list[Any]], per_level: list[int], max_new: int) -> dict[str, Any]:
    """Every exported budget's accuracy on the first ``k`` problems per level, for each ``k``."""
    nested_dir = run_dir / "export" / "nested"
    tok = TextTokenizer.load(nested_dir)
    nested = HybridLM.from_pretrained(nested_dir).eval()
    info = read_elastic(nested_dir)
    out: dict[str, Any] = {}
    for b in info.budgets:
        with_arch = extract(nested, b.architecture, info.depth_order)
        out[b.name] = {
            "total": b.total_params,
            "active": b.active_params,
            "accuracy": nested_accuracy(with_arch, tok, sets, per_level, max_new),
        }
        print(f"  {b.name}: {json.dumps(out[b.name])}", flush=True)
    return out


def table(results: dict[str, Any], n: str) -> str:
    base = results["runs"]["all"]
    rows = []
    for name, run in results["runs"].items():
        for budget, r in run["budgets"].items():
            acc = r["accuracy"][n]
            row = [name, budget, f"{r['total']:,} / {r['active']:,}", f"{acc['accuracy']:.3f} ± {acc['se']:.3f}"]
            if name == "all":
                row.append("")
            else:
                d = difference(acc, base["budgets"][budget]["accuracy"][n])
                row.append(f"{d['diff']:+.3f} ± {d['se']:.3f}")
            rows.append(row)
    return format_table(["variant", "budget", "total / active params", f"accuracy ({n})", "vs all"], rows)


def section(results: dict[str, Any], command: str) -> str:
    lines = [HEADING, "", "```", command, "```", ""]
    lines += [f"- `{v['name']}`: {v['what']}" for v in results["variants"]]
    lines += ["", f"Source commit {results['commit']}; `before` is {results['before_commit']}."]
    for n in results["problems"]:
        lines += ["", f"{n} problems:", "", table(results, n)]
    secs = ", ".join(f"{k} {v['distill_seconds']:.0f} s" for k, v in results["runs"].items())
    lines += ["", f"Distillation seconds (phase 1 + 2): {secs}. Load average {results['load_average']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="git repository to copy from")
    ap.add_argument("--commit", default="HEAD", help="the source of every variant but 'before'")
    ap.add_argument("--before-commit", default="5f1e446", help="the source of the 'before' variant")
    ap.add_argument("--base-run", default="runs/demo", help="the demo run with every change (make run)")
    ap.add_argument("--runs-dir", default="runs/ablations")
    ap.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS], choices=[v.name for v in VARIANTS])
    ap.add_argument("--attempts", type=int, default=3, help="runs of a variant's pipeline before giving up")
    ap.add_argument("--per-level", type=int, nargs="+", default=[30, 100])
    ap.add_argument("--results", default=None, help="write (or replace) this benchmark's section in this file")
    ap.add_argument("--json", default="runs/bench_method_ablations.json")
    args = ap.parse_args(argv)
    command = "python benchmarks/bench_method_ablations.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    load_start, start = load_average(), time.perf_counter()
    _, _, _, _, ev = distill_configs(DEMO, [])
    per_level = sorted(set(args.per_level))
    sets = problem_sets(ev.model_copy(update={"n_per_level": per_level[-1]}))
    max_new = ev.think_limit + ev.max_answer_tokens
    results: dict[str, Any] = {
        "machine": machine_info(2),
        "commit": args.commit,
        "before_commit": args.before_commit,
        "variants": [{"name": v.name, "what": v.what} for v in VARIANTS if v.name in args.variants],
        "runs": {},
    }
    run_dirs = {"all": Path(args.base_run)}
    for v in VARIANTS:
        if v.name in args.variants:
            run_dirs[v.name] = train(v, args)
    for name, run_dir in run_dirs.items():
        print(f"scoring {name} ({run_dir})", flush=True)
        budgets = score_run(run_dir, sets, per_level, max_new)
        results["runs"][name] = {"budgets": budgets, "distill_seconds": stage_seconds(run_dir)}
        save_json(args.json, results)  # partial results survive an interruption
    results["problems"] = list(next(iter(results["runs"]["all"]["budgets"].values()))["accuracy"])
    results["load_average"] = (load_start, load_average())
    results["seconds"] = time.perf_counter() - start
    save_json(args.json, results)
    for n in results["problems"]:
        print(f"\n{n} problems:\n{table(results, n)}")
    if args.results:
        replace_section(Path(args.results), HEADING, section(results, command))
    return results


if __name__ == "__main__":
    main()
