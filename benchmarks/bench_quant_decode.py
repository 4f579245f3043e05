"""CPU decode throughput per budget: fp32, bf16, FP8 and NVFP4, every budget cut from ONE quantized checkpoint.

A random model with the demo parent's architecture (optionally a larger one) is exported as a nested
checkpoint with three budgets, quantized once per format (default preset), and every budget is
extracted from that one quantized checkpoint (:func:`model.quant.extract_quantized_budget`). Per
(budget, format): a ``--prompt``-token prefill, then ``--steps`` cached single-token greedy decode
steps at batch ``--batch``; the timed figure is decode tokens/s (median of ``--repeats`` interleaved runs
after ``--warmup``). Quantized formats run twice: with dequantized weights cached after the first step
(the default of the quantized modules) and dequantizing on every step.

The quantized modules are numerics references (dequantize, then a dense fp32 matmul): on CPU they
cannot beat fp32; the figures show what the reference costs and which dequantization mode to use.

    python benchmarks/bench_quant_decode.py --threads 1 --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, machine_info, replace_section, set_threads  # noqa: E402
from components.parent import DEMO_PARENT_ARCH  # noqa: E402
from model.config import HybridConfig  # noqa: E402
from model.decode import DecodePlan  # noqa: E402
from model.elastic import Architecture, ElasticSpace, count_params  # noqa: E402
from model.elastic.budgets import BudgetSet  # noqa: E402
from model.elastic.export import export_nested, extract_budget  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402
from model.quant import extract_quantized_budget, load_quantized_model, quantize_checkpoint  # noqa: E402

DEMO = {"vocab_size": 112, **DEMO_PARENT_ARCH}
"""The demo parent's architecture (components.parent.DEMO_PARENT_ARCH with the built-in vocabulary)."""

LARGE = {
    **DEMO,
    "vocab_size": 4096,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "head_dim": 64,
    "intermediate_size": 1024,
    "mamba_num_heads": 16,
    "mamba_head_dim": 64,
    "n_routed_experts": 16,
    "moe_intermediate_size": 256,
    "moe_shared_expert_intermediate_size": 512,
}
"""A larger random config (~25M parameters) where the matmuls, not Python overhead, dominate."""


def budgets_for(cfg: HybridConfig) -> dict[str, Architecture]:
    """Three nested budgets, every width a multiple of 16 (NVFP4 blocks), per group for heads."""
    h, f, e, m = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.mamba_num_heads
    return {
        "full": Architecture(),
        "mid": Architecture(hidden=3 * h // 4, moe_ffn=f // 2, experts=3 * e // 4),
        "small": Architecture(hidden=h // 2, moe_ffn=f // 2, experts=e // 2, mamba_heads=m // 2),
    }


def build(cfg: HybridConfig, root: Path, seed: int) -> tuple[Path, dict[str, Architecture]]:
    """A random nested checkpoint of ``cfg`` (router weights random, so routing is not a tie-break)."""
    model = HybridLM(cfg).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.model.layers:
            if block.kind == "moe":
                block.mixer.gate.weight.normal_(0.0, 0.5, generator=g)
    archs = budgets_for(cfg)
    full = count_params(cfg).active
    fractions = {n: count_params(cfg, a).active / full for n, a in archs.items()}
    space = ElasticSpace(
        hidden=sorted({a.hidden or cfg.hidden_size for a in archs.values()}, reverse=True),
        moe_ffn=sorted({a.moe_ffn or cfg.moe_intermediate_size for a in archs.values()}, reverse=True),
        experts=sorted({a.experts or cfg.n_routed_experts for a in archs.values()}, reverse=True),
        mamba_heads=sorted({a.mamba_heads or cfg.mamba_num_heads for a in archs.values()}, reverse=True),
        nvfp4_aligned=True,
    )
    return export_nested(model, archs, BudgetSet.of(fractions), space, root / "nested"), archs


def decode_rates(
    models: dict[str, HybridLM], vocab: int, batch: int, prompt: int, steps: int, warmup: int, repeats: int
) -> dict[str, float]:
    """Median decode tokens/s (batch * steps tokens per timed run) of each model after a ``prompt``-token prefill.

    Runs are interleaved (one run of every model per round), so a change of machine load during the
    measurement shifts every model alike instead of favouring whichever ran last.
    """
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0))

    plans = {name: DecodePlan(model) for name, model in models.items()}  # the decode step generation runs

    def one_run(name: str, model: HybridLM) -> float:
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1)  # prefill: untimed
            cache, tok = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(steps):
                out = plans[name](tok, cache)
                cache, tok = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - start

    samples: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(warmup + repeats):
        for name, model in models.items():
            elapsed = one_run(name, model)
            if round_ >= warmup:
                samples[name].append(elapsed)
    return {name: batch * steps / statistics.median(s) for name, s in samples.items()}


def run(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    set_threads(args.threads)
    load_before = os.getloadavg()[0]
    configs = {"demo": DEMO} | ({"large": LARGE} if args.large else {})
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for cname, fields in configs.items():
            cfg = HybridConfig(**fields)
            root = Path(tmp) / cname
            nested, archs = build(cfg, root, args.seed)
            quantized = {fmt: quantize_checkpoint(nested, root / fmt, fmt, "default") for fmt in ("fp8", "nvfp4")}
            for budget in archs:
                dense_dir = extract_budget(nested, budget, root / f"fp32-{budget}")
                loaders: dict[str, Callable[[], HybridLM]] = {
                    "fp32": lambda d=dense_dir: HybridLM.from_pretrained(d),
                    "bf16": lambda d=dense_dir: HybridLM.from_pretrained(d, dtype=torch.bfloat16),
                }
                for fmt, qdir in quantized.items():
                    sub = extract_quantized_budget(qdir, budget, root / f"{fmt}-{budget}")
                    loaders[f"{fmt} cached"] = lambda d=sub: load_quantized_model(d, cache_dequantized=True)
                    loaders[f"{fmt} on-the-fly"] = lambda d=sub: load_quantized_model(d, cache_dequantized=False)
                rates = decode_rates(
                    {label: load() for label, load in loaders.items()},
                    cfg.vocab_size, args.batch, args.prompt, args.steps, args.warmup, args.repeats,
                )  # fmt: skip
                params = count_params(cfg, archs[budget])
                for label, rate in rates.items():
                    rows.append({"model": cname, "budget": budget, "active": params.active, "format": label,
                                 "tok_s": rate, "vs_fp32": rate / rates["fp32"]})  # fmt: skip
                    print(f"{cname:6s} {budget:6s} {label:18s} {rate:10.1f} tok/s", flush=True)
    table = format_table(
        ["model", "budget", "active params", "format", "decode tok/s", "vs fp32"],
        [[r["model"], r["budget"], r["active"], r["format"], r["tok_s"], f"{r['vs_fp32']:.2f}x"] for r in rows],
    )
    table += (
        f"\n\nLoad average (1 min) of the machine: {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end."
    )
    return table, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before the timed decode steps")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    ap.add_argument("--large", action="store_true", help="also run the larger random config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None, help="write (or replace) its section in this Markdown file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    table, _ = run(args)
    info = machine_info(args.threads)
    print()
    print(table)
    if args.results is not None:
        command = "python benchmarks/bench_quant_decode.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        text = (
            "## Quantized decode on CPU\n\n"
            f"Command: `{command}`\n\n"
            f"Machine: {info.get('cpu_model', info['processor'])}, {info['cpu_count']} cores, "
            f"torch {info['torch']}, {args.threads} thread(s). Batch {args.batch}, {args.prompt}-token prompt, "
            f"{args.steps} decode steps, median of {args.repeats}.\n\n"
            "Every quantized budget is extracted from ONE quantized nested checkpoint (default preset: attention, "
            "lm_head, embeddings, norms and routers stay high precision). The quantized modules dequantize to fp32 "
            "and run a dense matmul (a numerics reference, not a low-precision kernel); *cached* keeps the "
            "dequantized weights after the first step, *on-the-fly* dequantizes at every step.\n\n"
            f"{table}\n"
        )
        replace_section(args.results, "## Quantized decode on CPU", text)


if __name__ == "__main__":
    main()
