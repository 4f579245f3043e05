"""Cost of one elastic distillation step against a plain KD step on the full student (CPU, one process).

Same batch, frozen teacher and student weights for both; the elastic step is
:func:`components.distill.step.elastic_loss` (router sample, soft masks, KD + budget loss) without
Ray and DeepSpeed. The steps alternate and the ratio is the median of per-pair ratios.
Target: elastic / plain <= 1.3. Method: docs/benchmarks.md; figures: benchmarks/RESULTS.md.

    python benchmarks/bench_elastic_step.py --threads 2 --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, machine_info, set_threads
from components.data import ProblemConfig, TextTokenizer, build_demo_tokenizer, make_batch
from components.distill.draws import router_generator
from components.distill.step import ElasticSpec, ElasticStudent, elastic_loss
from components.parent import DEMO_PARENT_ARCH
from model.config import HybridConfig
from model.elastic.budgets import BudgetSet
from model.elastic.losses import kd_loss
from model.elastic.router import BudgetRouter
from model.elastic.space import ElasticSpace
from model.hybrid import HybridLM

SECTION = "## Elastic step vs plain KD step"

SPACES: dict[str, dict[str, list[int]]] = {
    "all axes": {
        "hidden": [64, 48, 32],
        "mamba_heads": [8, 6, 4],
        "attn_heads": [4, 2],
        "mlp_ffn": [128, 96, 64],
        "moe_ffn": [32, 24, 16],
        "shared_ffn": [64, 48, 32],
        "experts": [8, 6, 4],
    },
    "reported axes": {"hidden": [64, 48, 32], "moe_ffn": [32, 24, 16], "experts": [8, 6, 4]},
}
BUDGETS = {"full": 1.0, "mid": 0.78, "small": 0.56}


def measure(space_name: str, batch_size: int, seq_len: int, warmup: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Median seconds of both steps and the median per-pair ratio for one elastic space."""
    tok = TextTokenizer(build_demo_tokenizer())
    config = HybridConfig(vocab_size=tok.vocab_size, **DEMO_PARENT_ARCH)
    teacher = HybridLM(config).init_weights(seed).requires_grad_(False).eval()
    space = ElasticSpace(**SPACES[space_name])
    budgets = BudgetSet.of(BUDGETS)
    spec = ElasticSpec.of(config, space, budgets)
    batch = make_batch(ProblemConfig(), tok, batch_size, seq_len, seed, 0, pack=True)

    plain = HybridLM(config)
    plain.load_state_dict(teacher.state_dict())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    student = HybridLM(config)
    student.load_state_dict(teacher.state_dict())
    elastic = ElasticStudent(student, BudgetRouter(config, space, budgets))
    elastic_opt = torch.optim.AdamW(
        [{"params": elastic.student.parameters(), "lr": 1e-4}, {"params": elastic.router.parameters(), "lr": 1e-2}]
    )

    def plain_step() -> None:
        with torch.no_grad():
            t_logits = teacher(batch.input_ids).logits
        loss = kd_loss(plain(batch.input_ids).logits, t_logits, batch.loss_mask)
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        plain_opt.step()

    def elastic_step(step: int) -> None:
        loss, *_ = elastic_loss(
            elastic, teacher, spec, batch.input_ids, batch.loss_mask, step % len(budgets), (step, 1000),
            router_generator(seed, 1, step),
        )  # fmt: skip
        elastic_opt.zero_grad(set_to_none=True)
        loss.backward()
        elastic_opt.step()

    for i in range(warmup):
        plain_step()
        elastic_step(i)
    plain_s, elastic_s = [], []
    for i in range(repeats):
        start = time.perf_counter()
        plain_step()
        plain_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        elastic_step(warmup + i)
        elastic_s.append(time.perf_counter() - start)
    ratios = [e / p for e, p in zip(elastic_s, plain_s, strict=True)]
    return {
        "space": space_name,
        "tokens": batch.input_ids.numel(),
        "plain_s": statistics.median(plain_s),
        "elastic_s": statistics.median(elastic_s),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def results_block(
    rows: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any], load: tuple[float, float]
) -> str:
    """The Markdown section written to RESULTS.md."""
    table = format_table(
        ["space", "tokens/step", "plain KD step (ms)", "elastic step (ms)", "elastic / plain", "pair ratio range"],
        [
            [
                r["space"], r["tokens"], 1000 * r["plain_s"], 1000 * r["elastic_s"], f"{r['ratio']:.3f}",
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
            ]
            for r in rows
        ],
    )  # fmt: skip
    command = "python benchmarks/bench_elastic_step.py " + " ".join(sys.argv[1:])
    return "\n".join(
        [
            SECTION,
            "",
            f"Command: `{command}`",
            "",
            f"Demo parent ({DEMO_PARENT_ARCH['pattern']}, hidden {DEMO_PARENT_ARCH['hidden_size']}), batch "
            f"{args.batch} x {args.seq} packed tokens, {args.threads} thread(s), median of {args.repeats} alternating "
            f"pairs after {args.warmup} warmup pairs; CPU: {info.get('cpu_model', info['processor'])}, "
            f"torch {info['torch']}. Both steps include the teacher forward and the AdamW step. Target: <= 1.3x.",
            "",
            table,
            "",
            f"Load average (1 min) of the machine: {load[0]:.1f} at the start, {load[1]:.1f} at the end; the pair "
            "ratio range shows how much other processes disturbed single pairs (the median is the figure).",
            "",
        ]
    )


def write_section(path: Path, block: str) -> None:
    """Replace this benchmark's section in ``path`` (or append it), leaving other sections alone."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION in text:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + block + (text[nxt + 1 :] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--batch", type=int, default=16, help="rows per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row (packed)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed step pairs")
    parser.add_argument("--repeats", type=int, default=15, help="timed step pairs")
    parser.add_argument("--results", type=Path, help="write the section into this RESULTS.md")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()[0]
    rows = [measure(name, args.batch, args.seq, args.warmup, args.repeats) for name in SPACES]
    block = results_block(rows, args, machine_info(args.threads), (load_start, os.getloadavg()[0]))
    print(block)
    if args.results:
        write_section(args.results, block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
