"""Expert pruning by REAP against pruning by routing frequency (and at random), on a trained parent.

Each ranking reorders the experts, the experts beyond the kept prefix are masked
(``LayerMask(experts=...)``), and the KD loss against the unpruned parent and the held-out accuracy
are reported per kept fraction; ``--diagnose`` also correlates each score with the damage of
dropping each expert alone. Method: docs/benchmarks.md; figures: benchmarks/RESULTS.md.

    python benchmarks/bench_reap.py --parent runs/demo-parent/parent --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, machine_info, replace_section, save_json, set_threads
from components.data import ProblemConfig, eval_prompts, generate_eval_sets, make_batch
from components.data.tokenizer import TextTokenizer
from components.lm_eval import task_accuracy
from model.elastic.importance import rank_model
from model.elastic.permute import permute_experts
from model.elastic.reap import combine_expert_scores, expert_order, expert_prune_mask
from model.hybrid import HybridLM
from model.masks import LayerMask, ModelMask

HEADING = "## REAP vs routing-frequency expert pruning"
METHODS = ("reap", "frequency", "reap_sum")


def kd_loss(teacher_logits: list[torch.Tensor], student, batches: list[Any], mask: ModelMask | None) -> float:
    """Mean per-token KL(teacher || student) over the non-padding positions of ``batches``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for zt, b in zip(teacher_logits, batches, strict=True):
            zs = student(b.input_ids, mask=mask).logits
            keep = b.segment_ids >= 0
            lt = F.log_softmax(zt[keep].float(), -1)
            ls = F.log_softmax(zs[keep].float(), -1)
            total += float((lt.exp() * (lt - ls)).sum())
            count += int(keep.sum())
    return total / max(count, 1)


def pruned_model(parent: HybridLM, orders: dict[int, torch.Tensor]) -> HybridLM:
    """A copy of ``parent`` with the experts of MoE layer i stored in ``orders[i]`` order."""
    model = copy.deepcopy(parent)
    for i, order in orders.items():
        permute_experts(model.model.layers[i].mixer, order)
    return model


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (no tie correction: scores here are continuous)."""
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def single_removal_damage(parent: HybridLM, layer: int, teacher, kd_batches) -> torch.Tensor:
    """(E,) KD loss with expert j of ``layer`` dropped alone (its router row masked), for every j."""
    cfg = parent.config
    out = []
    for j in range(cfg.n_routed_experts):
        keep = torch.ones(cfg.n_routed_experts)
        keep[j] = 0.0
        layers = [LayerMask() for _ in cfg.layer_kinds]
        layers[layer] = LayerMask(experts=keep)
        out.append(kd_loss(teacher, parent, kd_batches, ModelMask(layers=layers)))
    return torch.tensor(out)


def evaluate(model, mask, tok, problems, teacher, kd_batches, max_new_tokens: int) -> dict[str, float]:
    score = task_accuracy(model, tok, problems, think=True, max_new_tokens=max_new_tokens, mask=mask)
    return {"kd": kd_loss(teacher, model, kd_batches, mask), "acc": score.accuracy}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parent", default="runs/demo-parent/parent", help="parent checkpoint folder (with tokenizer)")
    ap.add_argument("--keep", type=float, nargs="+", default=[0.5], help="fractions of experts kept per MoE layer")
    ap.add_argument("--calib-samples", type=int, default=256, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per calibration / KD sequence")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--calib-seed", type=int, default=1234)
    ap.add_argument("--kd-batches", type=int, default=8, help="held-out batches for the KD loss")
    ap.add_argument("--kd-seed", type=int, default=4321)
    ap.add_argument("--eval-levels", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--eval-per-level", type=int, default=50)
    ap.add_argument("--eval-seed", type=int, default=0, help="seed of the parent's held-out eval sets")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--random-seeds", type=int, default=3, help="random expert orders averaged")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-diagnose", dest="diagnose", action="store_false", help="skip the single-removal diagnosis")
    ap.add_argument("--results", default=None, help="append the table to this Markdown file")
    ap.add_argument("--json", default=None, help="write all figures to this JSON file")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    start = time.perf_counter()

    parent = HybridLM.from_pretrained(args.parent).eval()
    tok = TextTokenizer.load(args.parent)
    cfg = parent.config
    problem = ProblemConfig()
    eval_sets = generate_eval_sets(args.eval_levels, args.eval_per_level, args.eval_seed, problem)
    exclude = eval_prompts(eval_sets)
    problems = [p for level in args.eval_levels for p in eval_sets[level]]

    def batch(seed: int, index: int):
        return make_batch(problem, tok, args.batch_size, args.seq_len, seed, index, pack=True, exclude=exclude)

    n_calib = -(-args.calib_samples // args.batch_size)
    calib = [batch(args.calib_seed, i) for i in range(n_calib)]
    rankings = rank_model(parent, calib, axes=["experts"], progress=False)
    moe_layers = [i for i, lr in enumerate(rankings.layers) if lr.experts is not None]
    scores = {
        method: {
            i: combine_expert_scores(
                torch.tensor(rankings.layers[i].expert_reap), torch.tensor(rankings.layers[i].expert_frequency), method
            )
            for i in moe_layers
        }
        for method in METHODS
    }
    kd_batches = [batch(args.kd_seed, i) for i in range(args.kd_batches)]
    with torch.no_grad():
        teacher = [parent(b.input_ids).logits for b in kd_batches]

    parent_acc = task_accuracy(parent, tok, problems, think=True, max_new_tokens=args.max_new_tokens).accuracy
    rows: list[list[Any]] = [["parent (all experts)", cfg.n_routed_experts, 0.0, parent_acc]]
    results: dict[str, Any] = {"parent_acc": parent_acc, "runs": []}
    for frac in args.keep:
        keep = max(cfg.num_experts_per_tok, round(frac * cfg.n_routed_experts))
        mask = expert_prune_mask(cfg, keep)
        for method in METHODS:
            orders = {i: expert_order(s, cfg.n_group) for i, s in scores[method].items()}
            r = evaluate(pruned_model(parent, orders), mask, tok, problems, teacher, kd_batches, args.max_new_tokens)
            rows.append([f"{method} top {keep}", keep, r["kd"], r["acc"]])
            results["runs"].append(
                {"method": method, "keep": keep, **r, "orders": {i: o.tolist() for i, o in orders.items()}}
            )
        rand = []
        for seed in range(args.random_seeds):
            g = torch.Generator().manual_seed(seed)
            orders = {i: expert_order(torch.rand(cfg.n_routed_experts, generator=g), cfg.n_group) for i in moe_layers}
            rand.append(
                evaluate(pruned_model(parent, orders), mask, tok, problems, teacher, kd_batches, args.max_new_tokens)
            )
        if rand:
            kd = [r["kd"] for r in rand]
            acc = [r["acc"] for r in rand]
            sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
            rows.append([f"random {keep} (mean±sd of {len(rand)})", keep, f"{statistics.mean(kd):.4g}±{sd(kd):.2g}",
                         f"{statistics.mean(acc):.4g}±{sd(acc):.2g}"])  # fmt: skip
            results["runs"].append({"method": "random", "keep": keep, "kd": kd, "acc": acc})

    table = format_table(["experts kept per MoE layer by", "kept", "KD loss (nats/token)", "accuracy"], rows)
    detail = []
    for i in moe_layers:
        freq = scores["frequency"][i]
        line = (
            f"layer {i}: REAP {[round(v, 3) for v in scores['reap'][i].tolist()]}; "
            f"tokens routed {[int(v) for v in freq.tolist()]} (max/min {freq.max() / freq.clamp_min(1).min():.1f})"
        )
        if args.diagnose:
            damage = single_removal_damage(parent, i, teacher, kd_batches)
            corr = {m: spearman(scores[m][i], damage) for m in METHODS}
            results.setdefault("diagnosis", {})[i] = {"damage": damage.tolist(), "spearman": corr}
            line += f"; KD when dropped alone {[round(v, 4) for v in damage.tolist()]}; Spearman with that damage: "
            line += ", ".join(f"{m} {c:+.2f}" for m, c in corr.items())
        detail.append(line)
    elapsed = time.perf_counter() - start
    print(table)
    print("\n".join(detail))
    print(f"({elapsed:.0f}s)")
    results.update(table=table, detail=detail, seconds=elapsed, machine=machine_info(args.threads), args=vars(args))
    if args.json:
        save_json(args.json, results)
    if args.results:
        command = "python benchmarks/bench_reap.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        append_section(Path(args.results), command, table, detail, cfg, problems, rankings.num_tokens, parent_acc)
    return results


def append_section(
    path: Path, command: str, table: str, detail: list[str], cfg, problems, n_tokens, parent_acc
) -> None:
    """Append (or replace) this benchmark's section in the Markdown results file; other sections are kept."""
    body = "\n".join(
        [
            HEADING,
            "",
            f"Parent: pattern `{cfg.pattern}`, {cfg.n_routed_experts} routed experts, top-{cfg.num_experts_per_tok}, "
            f"hidden {cfg.hidden_size}. Experts ranked on {n_tokens:,} calibration tokens; accuracy by greedy "
            f"decoding of {len(problems)} held-out problems; KD loss on held-out packed batches.",
            "",
            "```",
            command,
            "```",
            "",
            table,
            "",
            "Per MoE layer (lists in original expert order):",
            "",
            *[f"- {line}" for line in detail],
            "",
        ]
    )
    replace_section(path, HEADING, body)


if __name__ == "__main__":
    main()
