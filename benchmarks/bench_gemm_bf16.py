"""Projections of a few rows: the several-rows operators against the library GEMM, per shape and row count.

A decode step of a batch multiplies a few rows (one per stream) by every weight. ``F.linear`` in bfloat16 (the
library GEMM the several-rows step used) and ``star_elastic::gemm_bf16`` (:mod:`model.decode.dot_bf16`: AMX
tiles read the weight as it is, where the CPU has them; the dot-product loop otherwise) on the ~115M family's
shapes, at 2-64 rows, alternating in every round:

- ``hot``: one weight, multiplied again and again (it stays in the cache where it fits);
- ``cold``: as many distinct weights as fill ~400 MB, each multiplied once per pass (every one from memory).

``--dtype float32`` times ``star_elastic::gemm_f32`` (the float32 dot-product tiles) against ``F.linear`` in
float32 instead, on the same shapes plus the medium budget's LM head as a budget view holds it (640 of the
parent's 768 columns: rows 768 apart).

Prints each case's median time, the weight bytes read per second and linear / operator (above 1: the operator
is faster); then the greedy pick over the family's 49,152-token vocabulary at 1 and 16 rows: torch's argmax
(bfloat16 cast to float32 first, as ``greedy_tokens`` did) against ``star_elastic::argmax_rows``. Also the
GEMV read bandwidth of the machine measured in the same run (bench_budget_decode's)::

    python benchmarks/bench_gemm_bf16.py --threads 2 --json runs/bench_gemm_bf16.json
    python benchmarks/bench_gemm_bf16.py --threads 2 --dtype float32 --json runs/bench_gemm_f32.json
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
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_budget_decode import bandwidth  # noqa: E402
from benchmarks.common import format_table, machine_info, save_json, set_threads  # noqa: E402
from model.decode import dot_bf16  # noqa: E402

SHAPES = {  # (out, in, the parent's in) of the ~115M family's projections (bench_peers' parent, its budgets)
    "Mamba in_proj, full": (1288, 768, 768),
    "Mamba in_proj, small": (772, 512, 512),
    "Mamba out_proj, full": (768, 512, 512),
    "LM head, small": (49152, 512, 512),
}
VIEW_SHAPES = {"LM head, medium (a view)": (49152, 640, 768)}  # float32 only: the first 640 of 768 columns


def median_seconds(fn, weights: list[torch.Tensor], x: torch.Tensor, rounds: int) -> float:
    """Median over ``rounds`` of one pass over ``weights`` (seconds per weight)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        times.append((time.perf_counter() - start) / len(weights))
    return statistics.median(times)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows_out = []
    dtype = getattr(torch, args.dtype)
    operator = dot_bf16.gemm_f32 if dtype == torch.float32 else dot_bf16.gemm
    shapes = {**SHAPES, **(VIEW_SHAPES if dtype == torch.float32 else {})}
    for label, (out, inputs, parent_in) in shapes.items():
        nbytes = out * inputs * dtype.itemsize
        for mode in args.modes:
            count = 1 if mode == "hot" else max(1, (args.cold_mb << 20) // (out * parent_in * dtype.itemsize))
            weights = [torch.randn(out, parent_in).to(dtype)[:, :inputs] for _ in range(count)]
            reps = max(1, 20 // count)
            for m in args.rows:
                x = torch.randn(m, inputs).to(dtype)
                linear = lambda x, w: F.linear(x, w)  # noqa: E731
                for fn in (linear, operator):  # warm both (allocator, operator's first call)
                    fn(x, weights[0])
                ts: dict[str, list[float]] = {"linear": [], "operator": []}
                for r in range(args.rounds):  # alternate, the order reversed every other round
                    order = [("linear", linear), ("operator", operator)]
                    for name, fn in order if r % 2 == 0 else order[::-1]:
                        ts[name].append(median_seconds(fn, weights * reps, x, 1))
                lin, op = statistics.median(ts["linear"]), statistics.median(ts["operator"])
                ratios = [a / b for a, b in zip(ts["linear"], ts["operator"], strict=True)]
                rows_out.append({"shape": label, "out": out, "in": inputs, "mode": mode, "rows": m,
                                 "linear_us": lin * 1e6, "operator_us": op * 1e6,
                                 "linear_gbs": nbytes / lin / 1e9, "operator_gbs": nbytes / op / 1e9,
                                 "linear_over_operator": statistics.median(ratios)})  # fmt: skip
                print(f"  {label} {mode} rows {m}: linear {lin * 1e6:.1f} us, operator {op * 1e6:.1f} us", flush=True)
            del weights
    return rows_out


def greedy_picks(rounds: int, vocab: int = 49152) -> list[dict[str, Any]]:
    """Median microseconds of torch's argmax and of the operator over (rows, vocab) logits, alternating."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 16):
            logits = torch.randn(rows, vocab).to(dtype)
            cases = {"torch": lambda t=logits: (t.float() if t.dtype == torch.bfloat16 else t).argmax(-1),
                     "operator": lambda t=logits: dot_bf16.argmax_rows(t)}  # fmt: skip
            ts: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(rounds * 20):
                for name, fn in cases.items():
                    start = time.perf_counter()
                    fn()
                    ts[name].append(time.perf_counter() - start)
            torch_us, op_us = (statistics.median(ts[k]) * 1e6 for k in ("torch", "operator"))
            out.append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "torch_us": torch_us,
                        "operator_us": op_us})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="2,4,8,16,32,64", help="comma-separated row counts")
    p.add_argument("--modes", default="hot,cold", help="hot, cold or both")
    p.add_argument("--cold-mb", type=int, default=400, help="weights per cold pass (MB)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    set_threads(args.threads)
    if not dot_bf16.available():
        raise SystemExit(f"the bfloat16 operators do not run here: {dot_bf16.unavailable_reason()}")
    amx = dot_bf16.rows_available()
    load = os.getloadavg()
    bw = bandwidth(args.threads)
    kernel = "AMX tiles" if amx else f"the dot-product loop: {dot_bf16.rows_unavailable_reason()}"
    kernel = "float32 dot-product tiles (gemm_f32)" if args.dtype == "float32" else kernel
    print(f"load average {load[0]:.2f}; GEMV read {bw['read_gbs']:.1f} GB/s; operator on {kernel}")
    results = run(args)
    headers = ["shape (out x in)", "mode", "rows", "linear us", "GB/s", "operator us", "GB/s", "linear / operator"]
    body = [[f"{r['shape']} ({r['out']} x {r['in']})", r["mode"], r["rows"], f"{r['linear_us']:.1f}",
             f"{r['linear_gbs']:.1f}", f"{r['operator_us']:.1f}", f"{r['operator_gbs']:.1f}",
             f"{r['linear_over_operator']:.2f}"] for r in results]  # fmt: skip
    print(format_table(headers, body))
    picks = greedy_picks(args.rounds)
    print(format_table(["logits", "rows", "torch argmax us", "operator us", "torch / operator"],
                       [[p["dtype"], p["rows"], f"{p['torch_us']:.1f}", f"{p['operator_us']:.1f}",
                         f"{p['torch_us'] / p['operator_us']:.1f}"] for p in picks]))  # fmt: skip
    end = os.getloadavg()[0]
    print(f"load average at the end {end:.2f} (with this benchmark's own threads)")
    if args.json:
        save_json(args.json, {"machine": machine_info(args.threads), "load_average": load, "load_end": end,
                              "bandwidth": bw, "amx": amx, "dtype": args.dtype, "rows": results,
                              "greedy_picks": picks})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
