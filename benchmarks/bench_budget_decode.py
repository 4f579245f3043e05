"""Decode speed of every budget served as a VIEW of one weight copy, against the full model and the floor.

For each model (the demo-sized parent and a ~120M-parameter one where weights dominate; random
weights, three budgets each) and each budget, at batch 1:

* ``ms/step``: a budget's cached single-token decode step at batch 1 after a ``--prompt``-token
  prefill, on its view model (:func:`model.decode.budget_view.budget_model`). The budgets (and their
  contiguous copies) are measured in ``--rounds`` interleaved rounds, every round running each case
  once (``--steps`` steps after a fresh prefill; the round's figure is its fastest step, since other
  processes only ever add time) and alternating the order. ``ms/step`` is the median of the rounds'
  figures; ``tok/s`` = 1000/that.
* ``speedup``: full's step time / the budget's, taken round by round (both ran in the same round, so
  a slow phase of the machine weighs on both) and reported as the median with its interquartile
  range; ``param ratio``: full's active parameters / the budget's. Target: speedup >= 0.9 x param
  ratio (the median).
* ``contiguous``: the same step on a contiguous copy of the budget laid out as a view model lays out
  its parent (:func:`model.elastic.slicing.extract`, then a full-size view of the copy, so every
  matrix is stored inputs-major): the cost of the budget's own shapes without any strided or split
  matrix. Its ``x floor`` bounds what any memory layout of the views could reach on this machine.
* ``floor``: the physical floor of a batch-1 step, the bytes of weights one token must read (active
  parameters minus the embedding table, of which one row is read, times the dtype size) over the
  measured memory read bandwidth. Target: step time within 1.5x of it.
* Bandwidth: two pure reads of a 512 MB tensor, far larger than the caches (``sum``, and a GEMV of one
  row against it viewed as an inputs-major matrix; the floor uses the faster), and ``clone`` (read +
  write, both bytes counted), with the same thread count; best of 9, measured before and after.
* ``lm_head layouts``: the largest single GEMV of a step, for each budget's hidden size, as a column
  view of the row-major (vocab, hidden) matrix against a row prefix of the same matrix stored transposed
  (what a view model computes: :func:`~model.decode.budget_view.budget_model` stores the parent inputs-major).

``--gemv`` also times one-row GEMVs on weights cycled from memory (no cache hits), by block size, as a
strided view of a larger matrix against the same block contiguous (:func:`cold_gemv`).

``--profile`` prints the top operators of the decode step of the demo parent and of the large
model's full and smallest budgets (what dominates when a step is far from its floor).

    python benchmarks/bench_budget_decode.py --threads 2 --json runs/bench_budget_decode.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode_paired import LARGE  # noqa: E402
from benchmarks.bench_decode_paired import LARGE_BUDGETS as PAIRED_LARGE_BUDGETS  # noqa: E402
from benchmarks.common import format_table, machine_info, save_json, set_threads, time_call  # noqa: E402
from model.config import HybridConfig  # noqa: E402
from model.decode.budget_view import BudgetRegistry, budget_model  # noqa: E402
from model.elastic import Architecture, count_params  # noqa: E402
from model.elastic.slicing import extract  # noqa: E402
from model.hybrid import HybridLM  # noqa: E402

DEMO = dict(  # components.parent.DEMO_PARENT_ARCH with the character tokenizer's vocabulary
    vocab_size=112, hidden_size=64, pattern="M*EMEM-E", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=32,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
)  # fmt: skip
DEMO_BUDGETS = {
    "full": Architecture(),
    "medium": Architecture(hidden=48, mamba_heads=6, moe_ffn=32, shared_ffn=48, mlp_ffn=96, experts=6),
    "small": Architecture(hidden=32, mamba_heads=4, moe_ffn=16, shared_ffn=32, mlp_ffn=64, experts=4),
}
LARGE_BUDGETS = {name: Architecture(**kw) for name, kw in PAIRED_LARGE_BUDGETS.items()}


def bandwidth(threads: int, mbytes: int = 512) -> dict[str, float]:
    """GB/s of two pure reads, ``sum`` over a vector and a GEMV (one row times a matrix stored inputs-major,
    the layout the budget views use), and of a copy (``clone``: read + write counted), best of 9 runs each.

    ``read_gbs``, the floor's bandwidth, is the faster of the two reads: whichever kernel streams memory
    faster shows what the machine can read, and a GEMV is what a decode step mostly is.
    """
    x = torch.rand(mbytes * 2**20 // 4)
    read_sum = x.nbytes / time_call(lambda: x.sum(), warmup=2, repeats=9).min_s / 1e9
    copy = 2 * x.nbytes / time_call(lambda: x.clone(), warmup=2, repeats=9).min_s / 1e9
    w = x.view(-1, 8192)  # (in, out): the same 512 MB read as a matrix
    v = torch.rand(1, w.shape[0])
    read_gemv = w.nbytes / time_call(lambda: v @ w, warmup=2, repeats=9).min_s / 1e9
    return {"read_gbs": max(read_sum, read_gemv), "read_sum_gbs": read_sum, "read_gemv_gbs": read_gemv,
            "copy_gbs": copy, "threads": threads}  # fmt: skip


def decode_state(model: torch.nn.Module, prompt: int, vocab: int) -> dict[str, Any]:
    """A fresh cache after a ``prompt``-token prefill (same tokens every time) and the next token."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prompt), generator=g)
    res = model(ids, use_cache=True, logits_to_keep=1)
    return {"cache": res.cache, "tok": res.logits[:, -1].argmax(-1, keepdim=True)}


def fastest_step(model: torch.nn.Module, state: dict[str, Any], steps: int, warmup: int = 2) -> float:
    """Seconds of the fastest of ``steps`` batch-1 decode steps continuing ``state`` (after ``warmup`` more)."""
    best = float("inf")
    for i in range(warmup + steps):
        start = time.perf_counter()
        out = model(state["tok"], cache=state["cache"])
        elapsed = time.perf_counter() - start
        state["cache"], state["tok"] = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        if i >= warmup:
            best = min(best, elapsed)
    return best


def interleaved_steps(models: dict[str, torch.nn.Module], args, vocab: int) -> dict[str, list[float]]:
    """Per case, the fastest step of each of ``args.rounds`` rounds; every round runs every case once, the
    order reversed every other round, each from a fresh prefill (untimed)."""
    out: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms up every case (lazily derived tensors, allocator)
            for name in names if r % 2 == 0 else reversed(names):
                state = decode_state(models[name], args.prompt, vocab)
                best = fastest_step(models[name], state, args.steps)
                if r > 0:
                    out[name].append(best)
    return out


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median and the first and third quartiles."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return statistics.median(values), q[0], q[2]


def lm_head_layouts(fields: dict, budgets: dict[str, Architecture], repeats: int = 15) -> list[dict[str, Any]]:
    """Best ms of the lm_head GEMV of each budget: a column view of a row-major ``(vocab, hidden)`` weight
    against a row prefix of the same weight stored transposed, ``(hidden, vocab)`` (what a view model does)."""
    config = HybridConfig(**fields)
    w = torch.randn(config.vocab_size, config.hidden_size)
    wt = w.t().contiguous()
    rows = []
    for name, arch in budgets.items():
        h = arch.hidden or config.hidden_size
        x, col_w, row_w = torch.randn(1, h), w[:, :h], wt[:h]
        col = time_call(lambda x=x, m=col_w: torch.nn.functional.linear(x, m), warmup=2, repeats=repeats).min_s
        row = time_call(lambda x=x, m=row_w: x @ m, warmup=2, repeats=repeats).min_s
        rows.append({"budget": name, "hidden": h, "column_view_ms": 1e3 * col, "transposed_row_prefix_ms": 1e3 * row})
    return rows


def cold_gemv(repeats: int = 60) -> list[dict[str, Any]]:
    """GB/s of one-row GEMVs on weights not in any cache, by matrix size and layout.

    A pool of matrices much larger than the last-level cache is cycled, so each call reads its weights
    from memory, as a decode step does. Per case: the budget's ``[:r, :c]`` block of an (R, C) matrix as
    a strided view (what a view model reads), the same block contiguous, and the bytes counted are the
    block's. The 25% quantile of the calls is reported (other processes only add time).
    """
    rows = []
    for big_r, big_c, r, c in [(1024, 1024, 768, 768), (1024, 1024, 512, 512), (2048, 1024, 1536, 768),
                               (512, 512, 512, 512), (4096, 4096, 4096, 4096)]:  # fmt: skip
        count = max(4, int(512e6 / (big_r * big_c * 4)))
        pool = [torch.randn(big_r, big_c) for _ in range(count)]
        blocks = [m[:r, :c].contiguous() for m in pool]
        x = torch.randn(1, r)
        out = {"matrix": f"{big_r}x{big_c}", "block": f"{r}x{c}", "block_mb": r * c * 4 / 2**20}
        for name, mats in (("strided_gbs", [m[:r, :c] for m in pool]), ("contiguous_gbs", blocks)):
            t = time_call(lambda m=itertools.cycle(mats), v=x: v @ next(m), warmup=count, repeats=repeats)
            q25 = sorted(t.samples)[len(t.samples) // 4]
            out[name] = r * c * 4 / q25 / 1e9
        rows.append(out)
        del pool, blocks
    return rows


def weight_bytes_read(config: HybridConfig, arch: Architecture, itemsize: int) -> int:
    """Bytes of weights one token reads: active parameters, with one embedding row instead of the table."""
    active = count_params(config, arch).active
    hidden = arch.hidden or config.hidden_size
    return (active - config.vocab_size * hidden + hidden) * itemsize


def layout_cases(config: HybridConfig, budgets: dict[str, Architecture], measured: list[str]) -> dict[str, Any]:
    """Per budget in ``measured``, two models of the same random weights: ``name`` as serving builds it (a
    registry over all ``budgets``) and ``name/contiguous`` (a contiguous copy of the budget, viewed so that
    it is stored inputs-major)."""
    full = HybridLM(config).init_weights(0).eval()
    models: dict[str, torch.nn.Module] = {}
    for budget in measured:
        models[f"{budget}/contiguous"] = budget_model(extract(full, budgets[budget]).eval(), Architecture())
    registry = BudgetRegistry(full, budgets)
    for budget in measured:
        models[budget] = registry.get(budget)
    return models


def bench_model(name: str, fields: dict, budgets: dict[str, Architecture], bw: float, args) -> list[dict[str, Any]]:
    config = HybridConfig(**fields)
    models = layout_cases(config, budgets, list(budgets))
    steps = interleaved_steps(models, args, config.vocab_size)
    first = next(iter(budgets))
    rows = []
    for budget, arch in budgets.items():
        count, full_count = count_params(config, arch), count_params(config, budgets[first])
        floor = weight_bytes_read(config, arch, 4) / (bw * 1e9)
        view, contiguous = steps[budget], steps[f"{budget}/contiguous"]
        speedup = quartiles([a / b for a, b in zip(steps[first], view, strict=True)])
        rows.append(
            {"model": name, "budget": budget, "total_params": count.total, "active_params": count.active,
             "step_s": statistics.median(view), "step_rounds_s": view,
             "contiguous_step_s": statistics.median(contiguous),
             "contiguous_rounds_s": contiguous, "floor_s": floor, "view_mode": models[budget].mode,
             "speedup": speedup[0], "speedup_q1": speedup[1], "speedup_q3": speedup[2],
             "param_ratio": full_count.active / count.active}
        )  # fmt: skip
    for r in rows:
        r["tok_s"] = 1.0 / r["step_s"]
        r["speedup_target_met"] = r["speedup"] >= 0.9 * r["param_ratio"]
        r["x_floor"] = r["step_s"] / r["floor_s"]
        r["contiguous_x_floor"] = r["contiguous_step_s"] / r["floor_s"]
        r["floor_target_met"] = r["x_floor"] <= 1.5
    return rows


def profile_step(fields: dict, arch: Architecture, prompt: int, steps: int, rows: int = 12) -> str:
    """Top operators (self CPU time, grouped by input shapes) of ``steps`` decode steps of a budget's view."""
    from torch.profiler import ProfilerActivity, profile

    config = HybridConfig(**fields)
    model = budget_model(HybridLM(config).init_weights(0).eval(), arch)
    ids = torch.randint(0, config.vocab_size, (1, prompt))
    with torch.inference_mode():
        res = model(ids, use_cache=True, logits_to_keep=1)
        cache, tok = res.cache, res.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(2):
            cache = model(tok, cache=cache).cache
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                cache = model(tok, cache=cache).cache
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=28, max_shapes_column_width=60
    )
    calls = sum(e.count for e in prof.key_averages())
    return f"{calls / steps:.0f} operator calls per step\n{table}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32, help="prefill length before the timed steps")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (medians over rounds are reported)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per case and round (the fastest counts)")
    p.add_argument("--skip-large", action="store_true", help="only the demo-sized model")
    p.add_argument("--profile", action="store_true", help="print the demo decode step's top operators")
    p.add_argument("--gemv", action="store_true", help="also time cold GEMVs by size, strided vs contiguous")
    p.add_argument("--json", type=str, default=None)
    p.add_argument(
        "--family",
        action="store_true",
        help="instead: bench_peers' ~115M family, dense / FP8 / NVFP4, at --batches (family_decode.py)",
    )
    p.add_argument(
        "--family-formats",
        default="f32,fp8,nvfp4",
        help="with --family: comma-separated formats (f32, bf16, fp8, nvfp4; fp8-cached / nvfp4-cached with "
        "cache_dequantized, f32-compiled / bf16-compiled with decode_compile)",
    )
    p.add_argument("--batches", default="1,16", help="with --family: comma-separated batch sizes")
    args = p.parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(0)
    load = os.getloadavg()
    bw = bandwidth(args.threads)
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; bandwidth read {bw['read_gbs']:.1f} GB/s "
          f"(sum {bw['read_sum_gbs']:.1f}, GEMV {bw['read_gemv_gbs']:.1f}), copy {bw['copy_gbs']:.1f} GB/s "
          f"({args.threads} threads)")  # fmt: skip
    if args.family:
        return family_main(args, load, bw)
    rows = bench_model("demo", DEMO, DEMO_BUDGETS, bw["read_gbs"], args)
    if not args.skip_large:
        rows += bench_model("large", LARGE, LARGE_BUDGETS, bw["read_gbs"], args)
    headers = ["model", "budget", "active", "ms/step", "tok/s", "speedup (IQR)", "param ratio", "met",
               "contiguous ms", "floor ms", "x floor", "met", "contiguous x floor"]  # fmt: skip
    table = [
        [r["model"], r["budget"], f"{r['active_params']:,}", 1e3 * r["step_s"], r["tok_s"],
         f"{r['speedup']:.3f} ({r['speedup_q1']:.3f}-{r['speedup_q3']:.3f})", r["param_ratio"],
         "yes" if r["speedup_target_met"] else "no", 1e3 * r["contiguous_step_s"],
         1e3 * r["floor_s"], r["x_floor"], "yes" if r["floor_target_met"] else "no", r["contiguous_x_floor"]]
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, table))
    heads = lm_head_layouts(
        LARGE if not args.skip_large else DEMO, LARGE_BUDGETS if not args.skip_large else DEMO_BUDGETS
    )
    print(
        format_table(
            ["lm_head of budget", "hidden", "column view ms", "transposed row prefix ms"],
            [[r["budget"], r["hidden"], r["column_view_ms"], r["transposed_row_prefix_ms"]] for r in heads],
        )
    )
    bw_end = bandwidth(args.threads)
    print(f"bandwidth at the end: read {bw_end['read_gbs']:.1f} GB/s (sum {bw_end['read_sum_gbs']:.1f}, GEMV "
          f"{bw_end['read_gemv_gbs']:.1f}); load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    gemv = cold_gemv() if args.gemv else []
    if gemv:
        print(format_table(
            ["matrix", "block", "block MB", "strided view GB/s", "contiguous GB/s"],
            [[g["matrix"], g["block"], g["block_mb"], g["strided_gbs"], g["contiguous_gbs"]] for g in gemv],
        ))  # fmt: skip
    prof = {}
    if args.profile:
        targets = [("demo", "full", DEMO, DEMO_BUDGETS["full"], 20)]
        if not args.skip_large:
            targets += [("large", b, LARGE, LARGE_BUDGETS[b], 5) for b in ("full", "small")]
        for model_name, budget, fields, arch, steps in targets:
            prof[f"{model_name}/{budget}"] = profile_step(fields, arch, args.prompt, steps)
            print(f"\nprofile {model_name}/{budget} ({steps} steps):\n{prof[f'{model_name}/{budget}']}")
    if args.json:
        save_json(args.json, {"machine": machine_info(args.threads), "load_average": load, "bandwidth": bw,
                              "bandwidth_end": bw_end, "rows": rows, "lm_head_layouts": heads,
                              "cold_gemv": gemv,
                              "profile": prof})  # fmt: skip
    return 0


def family_main(args: argparse.Namespace, load: tuple[float, float, float], bw: dict[str, float]) -> int:
    """``--family``: every budget of one nested family, dense and quantized, at several batch sizes."""
    import tempfile

    from benchmarks.family_decode import family_table, run_family

    args.family_formats = [f.strip() for f in args.family_formats.split(",") if f.strip()]
    args.batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="family-decode-") as tmp:
        rows = run_family(args, Path(tmp))
    headers, body = family_table(rows)
    print(format_table(headers, body))
    bw_end = bandwidth(args.threads)
    print(f"bandwidth at the end: read {bw_end['read_gbs']:.1f} GB/s; load average {os.getloadavg()[0]:.2f}")
    if args.json:
        save_json(args.json, {"machine": machine_info(args.threads), "load_average": load, "bandwidth": bw,
                              "bandwidth_end": bw_end, "family_rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
