"""The nested family against its baselines, and what phase 2 does on long problems.

Part ``baselines`` reads a finished pipeline run of ``--config`` (``make run``: rank -> phase 1 ->
phase 2 -> export) and, per budget of the exported nested checkpoint, scores on the SAME held-out
problems (the evaluate stage's levels and seed, the first ``k`` problems per level for each ``k`` of
``--per-level``: 30 and 100 give the evaluate stage's 180 problems and 600) with the same greedy
decoder:

* ``elastic``: the budget cut out of the nested checkpoint (phase 1 then phase 2);
* ``sliced, untrained``: the same architecture cut out of the permuted parent (the teacher);
* ``separate KD``: the same architecture cut out of the permuted parent, then distilled ALONE from
  the same teacher with plain KD (forward KL, T = 1), the same optimizer, schedule shape, batch
  shape and data stream kind as the elastic phases (phase 1 then phase 2, in the elastic run's
  proportions), twice from the same start:

  - ``equal tokens``: ``1 / n_budgets`` of the elastic run's training tokens each, what each budget
    saw in the elastic run under uniform sampling;
  - ``equal compute``: the separate runs TOGETHER get the elastic run's training FLOPs, split equally
    between them (FLOPs per token: teacher forward 2 A_parent + student forward and backward 6 A,
    with A the active parameters of the budget's architecture; the elastic student runs at full
    width under its masks and is charged 6 A_parent: :mod:`benchmarks.baselines_common`).

  The full budget's architecture is the parent's own, so its "separate" model is the parent and needs
  no run.

Also reported: every model's KD loss on held-out batches, accuracies with binomial standard errors,
the tokens, FLOPs and wall time of every run.

Part ``phase2`` is the phase-2 ablation of ``--long-config`` (:mod:`benchmarks.baselines_phase2`).

One command for both, training what is missing first (``--run-missing``: the two pipeline runs up to
export, resumed from whatever stages are already done):

    python benchmarks/bench_baselines.py --run-missing --per-level 30 100 \\
        --results benchmarks/RESULTS.md --json runs/bench_baselines.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baselines_common import (  # noqa: E402
    difference,
    distill_configs,
    elastic_flops,
    ensure_trained,
    flops_per_token,
    nested_accuracy,
    rows_per_update,
    steps_for_flops,
    steps_for_tokens,
)
from benchmarks.baselines_phase2 import HEADING as PHASE2_HEADING  # noqa: E402
from benchmarks.baselines_phase2 import phase2_section, phase2_table, run_phase2_ablation  # noqa: E402
from benchmarks.common import format_table, load_average, machine_info, replace_section, save_json, set_threads  # noqa: E402
from components.data import ProblemConfig, TextTokenizer, derive_seed, make_batch, make_data_batch  # noqa: E402
from components.distill.config import DistillConfig  # noqa: E402
from components.distill.draws import lr_factor  # noqa: E402
from components.evaluate import problem_sets  # noqa: E402
from model.elastic.export import read_elastic  # noqa: E402
from model.elastic.losses import kd_loss  # noqa: E402
from model.elastic.params import count_params  # noqa: E402
from model.elastic.slicing import extract  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402
from pipelines.runner import MARKER  # noqa: E402

HEADING = "## The nested family against separately distilled models"
KINDS = ("elastic", "separate_tokens", "separate_compute", "sliced")


def heldout_batches(cfg: DistillConfig, tok: TextTokenizer, n: int, seed: int) -> list[Any]:
    """``n`` batches of 32 fresh problems, one per row as the parent was trained and is evaluated, from
    a stream no training step draws from (the eval prompts excluded)."""
    stream = derive_seed("baseline-heldout", seed)
    exclude = cfg.excluded_prompts()
    return [make_batch(ProblemConfig(), tok, 32, 64, stream, i, exclude=exclude) for i in range(n)]


@torch.no_grad()
def heldout_kd(student: HybridLM, teacher_logits: list[torch.Tensor], batches: list[Any]) -> float:
    """Mean per-token KL(teacher || student) over the target tokens of ``batches``."""
    total, count = 0.0, 0
    for zt, b in zip(teacher_logits, batches, strict=True):
        zs = student(b.input_ids).logits
        n = int(b.loss_mask.sum())
        total += float(kd_loss(zs, zt, b.loss_mask)) * n
        count += n
    return total / max(count, 1)


def plain_kd(
    student: HybridLM, teacher: HybridLM, tok: TextTokenizer, phase: DistillConfig, steps: int, seed: int
) -> dict[str, Any]:
    """Distil ``student`` alone for ``steps`` steps shaped like ``phase`` (its rows per update, sequence
    length, packing, lr, warmup share, cosine floor, weight decay, clip); returns tokens, time, losses."""
    rows = rows_per_update(phase)  # the elastic run's rows per update, as one batch
    decay = [p for n, p in student.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in student.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": phase.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=phase.lr, betas=(0.9, 0.95))
    warmup = phase.model_copy(update={"steps": steps}).warmup_steps  # the elastic phase's rule at this length
    stream = derive_seed("baseline", seed, phase.phase)
    excluded = phase.excluded_prompts()  # the same held-out problems as the elastic run leaves out
    losses: list[float] = []
    student.train()
    start = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = phase.lr * lr_factor(step, steps, warmup, phase.min_lr_ratio)
        batch = make_data_batch(
            phase.data, tok, batch_size=rows, seq_len=phase.seq_len, seed=stream, phase=f"baseline{phase.phase}",
            step=step, exclude=excluded,
        )  # fmt: skip
        with torch.no_grad():
            zt = teacher(batch.input_ids).logits
        loss = kd_loss(student(batch.input_ids).logits, zt, batch.loss_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), phase.grad_clip)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 20 == 0 or step + 1 == steps:
            rate = (step + 1) / (time.perf_counter() - start)
            print(
                f"    phase {phase.phase} step {step + 1}/{steps} kd {sum(losses[-10:]) / len(losses[-10:]):.4f} "
                f"{rate * rows * phase.seq_len:,.0f} tok/s eta {(steps - step - 1) / rate:.0f}s",
                flush=True,
            )
    student.eval()
    return {
        "steps": steps,
        "tokens": steps * rows * phase.seq_len,
        "seconds": time.perf_counter() - start,
        "kd_first10": sum(losses[:10]) / max(len(losses[:10]), 1),
        "kd_last10": sum(losses[-10:]) / max(len(losses[-10:]), 1),
    }


def stage_seconds(run_dir: Path, stage: str) -> float | None:
    marker = run_dir / stage / MARKER
    return float(json.loads(marker.read_text())["seconds"]) if marker.exists() else None


def run_baselines(args: argparse.Namespace) -> dict[str, Any]:
    """The ``baselines`` part: every model of every budget scored, the separate runs trained."""
    load_start, start = load_average(), time.perf_counter()
    ensure_trained(args.config, args.overrides, args.run_missing)
    cfg, p1, p2, _, ev = distill_configs(args.config, args.overrides)
    run_dir, teacher_dir = cfg.run_dir, Path(p1.teacher_uri)
    nested_dir = run_dir / "export" / "nested"
    tok = TextTokenizer.load(teacher_dir)
    teacher = HybridLM.from_pretrained(teacher_dir).eval().requires_grad_(False)
    nested = HybridLM.from_pretrained(nested_dir).eval()
    info = read_elastic(nested_dir)
    depth = info.depth_order
    full = count_params(teacher.config)

    per_level = sorted(set(args.per_level or [ev.n_per_level]))
    sets = problem_sets(ev.model_copy(update={"n_per_level": per_level[-1]}))
    max_new = ev.think_limit + ev.max_answer_tokens
    batches = heldout_batches(p1, tok, args.kd_batches, args.seed)
    with torch.no_grad():
        teacher_logits = [teacher(b.input_ids).logits for b in batches]

    def score(model: HybridLM) -> dict[str, Any]:
        acc = nested_accuracy(model, tok, sets, per_level, max_new)
        return {"accuracy": acc, "kd": heldout_kd(model, teacher_logits, batches)}

    phases = (p1, p2)
    by_name = {b.name: b for b in info.budgets}
    elastic = elastic_flops(phases, full.active, [by_name[b.name].active_params for b in p1.budgets])
    for ph, d in zip(elastic, (p1.output_dir, p2.output_dir), strict=True):
        seen = int(json.loads((Path(d) / "distill.json").read_text())["tokens_seen"])
        if seen != ph["tokens"]:  # the run was resumed or shaped differently from this config
            print(f"note: {d} saw {seen:,} tokens, this config's shape gives {ph['tokens']:,}", flush=True)
    n_b = len(info.budgets)
    # the full budget's architecture is the parent's: its separate model is the parent, with no run
    trained = [b.name for b in info.budgets if (b.active_params, b.total_params) != (full.active, full.total)]
    elastic_full_width = [ph["full_width"] for ph in elastic]

    print(f"parent: {sum(len(s) for s in sets.values())} problems", flush=True)
    parent = score(teacher)
    results: dict[str, Any] = {"parent": parent, "per_level": per_level, "elastic": elastic, "budgets": []}
    for b in info.budgets:
        arch = b.architecture
        print(f"budget {b.name}: {arch.to_dict()}", flush=True)
        row: dict[str, Any] = {"name": b.name, "active": b.active_params, "total": b.total_params}
        row["elastic"] = score(extract(nested, arch, depth))
        if b.name not in trained:
            row["sliced"] = row["separate_tokens"] = row["separate_compute"] = {**parent, "note": "the parent"}
        else:
            row["sliced"] = score(extract(teacher, arch, depth))
            for kind in ("separate_tokens", "separate_compute"):
                student = extract(teacher, arch, depth).requires_grad_(True)  # the same start for both
                runs = []
                for phase, ph, share in zip(phases, elastic, elastic_full_width, strict=True):
                    if kind == "separate_tokens":
                        steps = steps_for_tokens(ph["tokens"] / n_b, phase)
                    else:
                        steps = steps_for_flops(share / len(trained), phase, full.active, b.active_params)
                    print(f"  {kind}: phase {phase.phase}, {steps} steps", flush=True)
                    run = plain_kd(student, teacher, tok, phase, steps, args.seed + info.budgets.index(b))
                    run["flops"] = run["tokens"] * flops_per_token(full.active, b.active_params)
                    runs.append(run)
                row[kind] = {**score(student), "training": runs}
        results["budgets"].append(row)
        print(f"  {json.dumps({k: row[k] for k in KINDS}, default=str)}", flush=True)

    def total(kind: str, key: str) -> float:
        return sum(r[key] for row in results["budgets"] for r in row[kind].get("training", []))

    results["compute"] = {
        "elastic_tokens": sum(ph["tokens"] for ph in elastic),
        "elastic_flops": sum(elastic_full_width),
        "elastic_flops_drawn": sum(ph["drawn"] for ph in elastic),
        "elastic_stage_seconds": sum(
            s for s in (stage_seconds(run_dir, "distill_phase1"), stage_seconds(run_dir, "distill_phase2")) if s
        ),
        **{f"{kind}_{key}": total(kind, key) for kind in KINDS[1:3] for key in ("tokens", "flops", "seconds")},
    }
    results.update(
        problems=[sum(min(k, len(s)) for s in sets.values()) for k in per_level],
        levels=ev.builtin_levels,
        eval_seed=ev.seed,
        phases=[{"lr": p.lr, "rows": rows_per_update(p), "seq_len": p.seq_len, "steps": p.steps} for p in phases],
        full={"active": full.active, "total": full.total},
        seconds=time.perf_counter() - start,
        load_average=(load_start, load_average()),
    )
    return results


def _acc(a: dict[str, float]) -> str:
    return f"{a['accuracy']:.3f} ± {a['se']:.3f}"


def accuracy_table(results: dict[str, Any], n: str) -> str:
    """Accuracy ± SE on ``n`` problems per budget and model, and elastic - separate at equal compute."""
    full = results["full"]["active"]
    rows = [["parent", f"{full:,}", "", "", "", _acc(results["parent"]["accuracy"][n]), ""]]
    for r in results["budgets"]:
        acc = {k: r[k]["accuracy"][n] for k in KINDS}
        d = difference(acc["elastic"], acc["separate_compute"])
        cells = [_acc(acc[k]) if "note" not in r[k] else f"{_acc(acc[k])} (parent)" for k in KINDS]
        rows.append(
            [r["name"], f"{r['active']:,} ({r['active'] / full:.3f})", *cells, f"{d['diff']:+.3f} ± {d['se']:.3f}"]
        )
    headers = ["budget", "active params", "elastic", "separate, equal tokens", "separate, equal compute"]
    return format_table([*headers, "sliced, untrained", "elastic - separate (equal compute)"], rows)


def compute_table(results: dict[str, Any]) -> str:
    """Tokens, FLOPs, steps and seconds of the elastic run and of every separate run."""
    c = results["compute"]
    rows = [
        [
            "elastic (all budgets, 2 Ray Train workers)",
            f"{c['elastic_tokens']:,}",
            f"{c['elastic_flops']:.3g} ({c['elastic_flops_drawn']:.3g} as drawn)",
            " + ".join(str(p["steps"]) for p in results["phases"]),
            f"{c['elastic_stage_seconds']:.0f}",
        ]
    ]
    for kind, label in (("separate_tokens", "equal tokens"), ("separate_compute", "equal compute")):
        for r in results["budgets"]:
            runs = r[kind].get("training")
            if runs:
                rows.append(
                    [
                        f"separate {r['name']}, {label}",
                        f"{sum(x['tokens'] for x in runs):,}",
                        f"{sum(x['flops'] for x in runs):.3g}",
                        " + ".join(str(x["steps"]) for x in runs),
                        f"{sum(x['seconds'] for x in runs):.0f}",
                    ]
                )
        rows.append(
            [
                f"separate, {label}, together",
                f"{c[kind + '_tokens']:,.0f}",
                f"{c[kind + '_flops']:.3g} ({c[kind + '_flops'] / c['elastic_flops']:.3f}x the elastic run)",
                "",
                f"{c[kind + '_seconds']:.0f}",
            ]
        )
    return format_table(["run", "tokens", "FLOPs", "steps (phase 1 + 2)", "seconds"], rows)


def kd_table(results: dict[str, Any]) -> str:
    rows = [[r["name"], *(f"{r[k]['kd']:.4f}" for k in KINDS)] for r in results["budgets"]]
    return format_table(["budget", "elastic", "separate, equal tokens", "separate, equal compute", "sliced"], rows)


def _load(avg: Any) -> str:
    return "n/a" if not avg else f"{avg[0]:.2f}"


def baselines_section(results: dict[str, Any], command: str) -> str:
    """The Markdown section: how the figures were made, the tables and the compute comparison."""
    p1, p2 = results["phases"]
    counts = [str(n) for n in results["problems"]]
    lines = [
        HEADING,
        "",
        f"Accuracy ± binomial standard error, greedy decoding with full thinking, on the first "
        f"{' and '.join(str(k) for k in results['per_level'])} held-out problems per level (levels "
        f"{results['levels']}, seed {results['eval_seed']}: {' and '.join(counts)} problems; the first count "
        "per level is a prefix of the larger one). Separate KD: each architecture alone, plain KD from the "
        f"same parent, phase-1 then phase-2 shaped (lr {p1['lr']} then {p2['lr']}, batches {p1['rows']} x "
        f"{p1['seq_len']} then {p2['rows']} x {p2['seq_len']}), from the same slice of the parent twice: with "
        "1/n_budgets of the elastic run's tokens each (equal tokens), and with the elastic run's training "
        "FLOPs split equally between the separate runs (equal compute: together they spend what the elastic "
        "run spent). FLOPs per token: 2 x the parent's active parameters (teacher forward) + 6 x the student's "
        "(forward and backward); the elastic student runs at full width under its masks and is charged the "
        "full model ('as drawn': each micro-batch charged its drawn budget's active parameters instead). "
        "The last column's error is the unpaired one (the paired one, same problems, is smaller).",
        "",
        "```",
        command,
        "```",
        "",
    ]
    for n in counts:
        lines += [f"{n} problems:", "", accuracy_table(results, n), ""]
    c = results["compute"]
    load = results["load_average"]
    lines += [
        "Training compute:",
        "",
        compute_table(results),
        "",
        f"At equal compute the separate runs together spend {c['separate_compute_flops'] / c['elastic_flops']:.3f}x "
        f"the elastic run's FLOPs (equal tokens: {c['separate_tokens_flops'] / c['elastic_flops']:.3f}x). "
        "Seconds: the elastic stages' time includes Ray start-up and checkpoints; the separate runs are one "
        "process each.",
        "",
        "KD loss (nats/token) against the permuted parent on held-out problems, one per row:",
        "",
        kd_table(results),
        "",
        f"{results['seconds']:.0f} s for this part; load average (1 min) {_load(load[0])} at the start, "
        f"{_load(load[1])} at the end.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="pipelines/configs/demo.yaml", help="the pipeline config of the baselines run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="override of --config: key.path=value")
    ap.add_argument(
        "--long-config", default="pipelines/configs/demo-long.yaml", help="the pipeline config of the phase-2 ablation"
    )
    ap.add_argument("--long-set", dest="long_overrides", action="append", default=[], help="override of --long-config")
    ap.add_argument("--parts", nargs="+", choices=["baselines", "phase2"], default=["baselines", "phase2"])
    ap.add_argument(
        "--per-level",
        type=int,
        nargs="+",
        default=None,
        help="held-out problems per level to score (each a prefix of the next); default: the evaluate stage's",
    )
    ap.add_argument("--run-missing", action="store_true", help="run the pipelines' training stages that are not done")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kd-batches", type=int, default=8, help="held-out batches (32 problems each) for the KD loss")
    ap.add_argument("--seed", type=int, default=0, help="seed of the separate runs' data streams")
    ap.add_argument("--results", default=None, help="write (or replace) this benchmark's sections in this file")
    ap.add_argument("--json", default=None, help="write all figures to this JSON file")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    command = "python benchmarks/bench_baselines.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    out: dict[str, Any] = {"machine": machine_info(args.threads), "args": vars(args)}
    sections: list[tuple[str, str]] = []
    if "baselines" in args.parts:
        out["baselines"] = res = run_baselines(args)
        for n in (str(k) for k in res["problems"]):
            print(f"\n{n} problems:\n{accuracy_table(res, n)}")
        print(f"\n{compute_table(res)}\n\n{kd_table(res)}")
        sections.append((HEADING, baselines_section(res, command)))
    if "phase2" in args.parts:
        out["phase2"] = res = run_phase2_ablation(args.long_config, args.long_overrides, args.run_missing)
        print(f"\n{phase2_table(res)}")
        sections.append((PHASE2_HEADING, phase2_section(res, command)))
    if args.json:
        save_json(args.json, out)
    if args.results:
        for heading, body in sections:
            replace_section(Path(args.results), heading, body)
    return out


if __name__ == "__main__":
    main()
