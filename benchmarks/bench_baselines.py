"""The nested family against its baselines: the parent, each budget sliced with no training, and each
budget's architecture distilled on its own.

Reads a finished pipeline run (``make run``: rank -> phase 1 -> phase 2 -> export) and, per budget of
the exported nested checkpoint, scores on the SAME held-out problems (the evaluate stage's levels,
count and seed) with the same greedy decoder:

* ``elastic``: the budget cut out of the nested checkpoint (phase 1 then phase 2);
* ``elastic, phase 1 only``: the same architecture cut out of the phase-1 student, to show what
  phase 2 did;
* ``sliced, untrained``: the same architecture cut out of the permuted parent (the teacher) with no
  training at all;
* ``separate KD``: the same architecture cut out of the permuted parent, then distilled ALONE from
  the same teacher with plain KD (forward KL, T = 1), the same optimizer, schedule shape, batch
  shape and data stream kind as the elastic phases, for ``1 / n_budgets`` of the elastic run's
  training tokens (phase 1 then phase 2 in the same proportions). The full budget's architecture is
  the parent's own, so its "separate" model is the parent.

Also reported: the KD loss of every model on held-out packed batches, the training tokens and an
analytic count of training FLOPs (``2 x active`` per token for the teacher forward, ``6 x active``
for the student forward + backward; the elastic student runs at full width under its masks, so it
is charged the full model's active parameters) for the elastic run against the sum of the separate
runs, and the wall time of each.

    python benchmarks/bench_baselines.py --config pipelines/configs/demo.yaml --results benchmarks/RESULTS.md
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

from benchmarks.common import format_table, load_average, machine_info, replace_section, save_json, set_threads  # noqa: E402
from components.data import ProblemConfig, TextTokenizer, derive_seed, generate_eval_sets, make_batch, make_data_batch  # noqa: E402
from components.distill.config import DistillConfig  # noqa: E402
from components.distill.worker import lr_factor  # noqa: E402
from components.evaluate import EvalConfig, problem_sets  # noqa: E402
from components.lm_eval import task_accuracy  # noqa: E402
from model.elastic.export import read_elastic  # noqa: E402
from model.elastic.losses import kd_loss  # noqa: E402
from model.elastic.params import count_params  # noqa: E402
from model.elastic.slicing import extract  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402
from pipelines.config import load_pipeline_config  # noqa: E402
from pipelines.runner import MARKER, StageContext  # noqa: E402
from pipelines.stages import build_distill1, build_distill2, build_evaluate  # noqa: E402

HEADING = "## The nested family against separately distilled models"


def distill_configs(
    config_path: str, overrides: list[str]
) -> tuple[Any, Path, DistillConfig, DistillConfig, EvalConfig]:
    """The pipeline config, its run folder and the exact configs its distill and evaluate stages used."""
    cfg = load_pipeline_config(config_path, overrides)
    run_dir = cfg.run_dir
    p1 = build_distill1(StageContext(cfg, run_dir, "distill_phase1"))
    p2 = build_distill2(StageContext(cfg, run_dir, "distill_phase2"))
    ev = build_evaluate(StageContext(cfg, run_dir, "evaluate"))
    return cfg, run_dir, p1, p2, ev


def require(path: Path, what: str) -> Path:
    if not path.exists():
        raise SystemExit(f"{what} not found at {path}: run the pipeline first (`make run`), with the same --config")
    return path


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
    """Distil ``student`` alone for ``steps`` steps shaped like ``phase`` (its global batch, sequence
    length, packing, lr, warmup share, cosine floor, weight decay, clip); returns tokens, time, losses."""
    rows = phase.micro_batch_size * phase.num_workers  # the elastic run's global batch
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
        if (step + 1) % 10 == 0 or step + 1 == steps:
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="pipelines/configs/demo.yaml", help="the pipeline config of the run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key.path=value")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kd-batches", type=int, default=8, help="held-out batches (32 problems each) for the KD loss")
    ap.add_argument(
        "--long-levels",
        type=int,
        nargs="*",
        default=[8, 10],
        help="chain lengths beyond the evaluate stage's, scored for the elastic model after phase 1 and after phase 2",
    )
    ap.add_argument("--long-per-level", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="seed of the separate runs' data streams")
    ap.add_argument("--results", default=None, help="write (or replace) this benchmark's section in this file")
    ap.add_argument("--json", default=None, help="write all figures to this JSON file")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    load_start = load_average()
    start = time.perf_counter()

    cfg, run_dir, p1, p2, ev = distill_configs(args.config, args.overrides)
    teacher_dir = require(Path(p1.teacher_uri), "the permuted parent (rank stage)")
    phase1_dir = require(Path(p1.output_dir), "the phase-1 student")
    phase2_dir = require(Path(p2.output_dir), "the phase-2 student")
    nested_dir = require(run_dir / "export" / "nested", "the nested checkpoint (export stage)")
    tok = TextTokenizer.load(teacher_dir)
    teacher = HybridLM.from_pretrained(teacher_dir).eval().requires_grad_(False)
    phase1 = HybridLM.from_pretrained(phase1_dir).eval()
    nested = HybridLM.from_pretrained(nested_dir).eval()
    info = read_elastic(nested_dir)
    depth = info.depth_order
    mc = teacher.config

    problems = [p for ps in problem_sets(ev).values() for p in ps]
    max_new = ev.think_limit + ev.max_answer_tokens
    batches = heldout_batches(p1, tok, args.kd_batches, args.seed)
    with torch.no_grad():
        teacher_logits = [teacher(b.input_ids).logits for b in batches]

    long_sets = generate_eval_sets(args.long_levels, args.long_per_level, ev.seed) if args.long_levels else {}
    long_problems = [p for ps in long_sets.values() for p in ps]

    def long_accuracy(model: HybridLM) -> float:
        return task_accuracy(model, tok, long_problems, think=True, max_new_tokens=max_new).accuracy

    def score(model: HybridLM) -> dict[str, float]:
        acc = task_accuracy(model, tok, problems, think=True, max_new_tokens=max_new).accuracy
        return {"accuracy": acc, "kd": heldout_kd(model, teacher_logits, batches)}

    tokens = {}
    for name, d in (("phase1", phase1_dir), ("phase2", phase2_dir)):
        tokens[name] = int(json.loads((d / "distill.json").read_text())["tokens_seen"])
    elastic_tokens = tokens["phase1"] + tokens["phase2"]
    n_b = len(info.budgets)
    full_active = count_params(mc).active
    print(f"parent: {len(problems)} problems", flush=True)
    parent_score = score(teacher)
    if long_problems:
        parent_score = {**parent_score, "long": long_accuracy(teacher)}
    results: dict[str, Any] = {
        "parent": parent_score,
        "long_levels": args.long_levels,
        "problems": len(problems),
        "elastic_tokens": tokens,
        "budgets": [],
    }
    separate_tokens_total = 0
    separate_flops = 0.0
    separate_seconds = 0.0
    for bi, b in enumerate(info.budgets):
        arch = b.architecture
        print(f"budget {b.name}: {arch.to_dict()}", flush=True)
        row: dict[str, Any] = {"name": b.name, "active": b.active_params, "total": b.total_params}
        after_p2, after_p1 = extract(nested, arch, depth), extract(phase1, arch, depth)
        row["elastic"], row["phase1_only"] = score(after_p2), score(after_p1)
        if long_problems:  # longer chains than the evaluate stage's: what the long phase 2 is for
            row["long"] = {"phase1_only": long_accuracy(after_p1), "elastic": long_accuracy(after_p2)}
        if bi == 0 and b.active_params == full_active:
            row["sliced"] = parent_score
            row["separate"] = {**parent_score, "note": "the full architecture is the parent"}
        else:
            student = extract(teacher, arch, depth)  # scored untrained first, then distilled alone
            row["sliced"] = score(student)
            student.requires_grad_(True)
            runs = []
            for phase, phase_tokens in ((p1, tokens["phase1"]), (p2, tokens["phase2"])):
                per_step = phase.micro_batch_size * phase.num_workers * phase.seq_len
                steps = max(1, round(phase_tokens / n_b / per_step))
                runs.append(plain_kd(student, teacher, tok, phase, steps, args.seed + bi))
            row["separate"] = {**score(student), "training": runs}
            t = sum(r["tokens"] for r in runs)
            separate_tokens_total += t
            separate_flops += t * (2 * full_active + 6 * b.active_params)
            separate_seconds += sum(r["seconds"] for r in runs)
        results["budgets"].append(row)
        print(f"  {json.dumps({k: v for k, v in row.items() if k not in ('name',)}, default=str)}", flush=True)

    elastic_flops = elastic_tokens * (2 * full_active + 6 * full_active)
    elastic_seconds = sum(
        s for s in (stage_seconds(run_dir, "distill_phase1"), stage_seconds(run_dir, "distill_phase2")) if s
    )
    results["compute"] = {
        "elastic_tokens": elastic_tokens,
        "elastic_flops": elastic_flops,
        "elastic_stage_seconds": elastic_seconds,
        "separate_tokens": separate_tokens_total,
        "separate_flops": separate_flops,
        "separate_seconds": separate_seconds,
    }
    table = format_table(
        ["budget", "active params", "elastic", "elastic, phase 1 only", "separate KD", "sliced, untrained"],
        [["parent", f"{full_active:,}", "", "", "", f"{parent_score['accuracy']:.3f} / {parent_score['kd']:.4f}"]]
        + [
            [
                r["name"],
                f"{r['active']:,} ({r['active'] / full_active:.3f})",
                *(
                    f"{r[k]['accuracy']:.3f} / {r[k]['kd']:.4f}"
                    for k in ("elastic", "phase1_only", "separate", "sliced")
                ),
            ]
            for r in results["budgets"]
        ],
    )
    long_table = ""
    if results["long_levels"]:
        long_table = format_table(
            ["budget", "after phase 1", "after phase 2", "phase 2 effect"],
            [["parent", "", f"{parent_score['long']:.3f}", ""]]
            + [
                [
                    r["name"],
                    f"{r['long']['phase1_only']:.3f}",
                    f"{r['long']['elastic']:.3f}",
                    f"{r['long']['elastic'] - r['long']['phase1_only']:+.3f}",
                ]
                for r in results["budgets"]
            ],
        )
        print(long_table)
    results.update(
        long_table=long_table,
        table=table,
        seconds=time.perf_counter() - start,
        machine=machine_info(args.threads),
        load_average=(load_start, load_average()),
        args=vars(args),
    )
    print(table)
    print(json.dumps(results["compute"], indent=1))
    if args.json:
        save_json(args.json, results)
    if args.results:
        command = "python benchmarks/bench_baselines.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        replace_section(Path(args.results), HEADING, section(results, command, p1, p2, ev, n_b))
    return results


def _load(avg: Any) -> str:
    return "n/a" if not avg else f"{avg[0]:.2f}"


def section(
    results: dict[str, Any], command: str, p1: DistillConfig, p2: DistillConfig, ev: EvalConfig, n_b: int
) -> str:
    """The Markdown section: how the figures were made, the table and the compute comparison."""
    c = results["compute"]
    lines = [
        HEADING,
        "",
        f"Every cell is accuracy / KD loss: accuracy by greedy decoding with full thinking of the evaluate "
        f"stage's {results['problems']} held-out problems (levels {ev.levels}, {ev.n_per_level} each, seed "
        f"{ev.seed}); KD loss (nats/token) against the permuted parent on held-out problems, one per row. "
        f"Separate KD: each architecture alone, plain KD from the same parent, 1/{n_b} of the elastic run's "
        f"tokens, phase-1 then phase-2 shaped (lr {p1.lr} then {p2.lr}, batches "
        f"{p1.micro_batch_size * p1.num_workers} x {p1.seq_len} then {p2.micro_batch_size * p2.num_workers} x "
        f"{p2.seq_len}).",
        "",
        "```",
        "make run",
        command,
        "```",
        "",
        results["table"],
        "",
        *(
            [
                f"Phase 2 (longer chains) on problems longer than the evaluate stage's: chain lengths "
                f"{results['long_levels']}, accuracy with full thinking, the same architecture after phase 1 "
                "and after phase 2:",
                "",
                results["long_table"],
                "",
            ]
            if results["long_table"]
            else []
        ),
        f"Training compute: elastic run {c['elastic_tokens']:,} tokens, {c['elastic_flops']:.3g} FLOPs "
        f"(teacher forward + full-width masked student), {c['elastic_stage_seconds']:.0f} s of stage time "
        f"(2 Ray Train workers, start-up and checkpoints included); the separate runs together "
        f"{c['separate_tokens']:,} tokens, {c['separate_flops']:.3g} FLOPs, {c['separate_seconds']:.0f} s "
        f"(one process). Load average (1 min) {_load(results['load_average'][0])} at the start, "
        f"{_load(results['load_average'][1])} at the end.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
