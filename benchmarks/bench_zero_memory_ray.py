"""Per-worker memory and step time of elastic distillation through Ray Train, at ZeRO-0 and ZeRO-3.

The same parent, settings and plan as :mod:`benchmarks.bench_zero_memory`, but run by the distill stage
itself (:func:`components.distill.stage.run_distill`: 2 Ray Train workers on local Ray, then the
consolidation task). Memory is each run's ``memory/host_peak_gb``, which every Ray Train worker logs: the
largest over ranks of the resident peak above the worker's baseline after imports and process-group setup
(:func:`components.distill.worker.memory_peaks`). Step times come from the logged token rate (wall time
only: the stage logs no CPU time).

    .venv/bin/python -m benchmarks.bench_zero_memory_ray --variants worker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_zero_memory import GB, VARIANTS, describe, distill_settings, make_parent, parser, planned


def run_one(parent: Path, stage: int, variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One (ZeRO stage, variant) through the distill stage on 2 Ray Train workers: the largest rank's resident
    peak above its baseline (bytes) and the step wall times after the first (from the logged token rate)."""
    from components.distill.config import DistillConfig
    from components.distill.stage import run_distill

    settings = distill_settings(parent, work / f"ray-{variant}-zero{stage}" / "output", stage, variant, args)
    cfg = DistillConfig(**settings, log_every=1, checkpoint_every=args.steps, max_failures=0)
    before = os.getloadavg()[0]
    out = run_distill(cfg)
    rows = json.loads((Path(out.checkpoint_uri) / "history.json").read_text())  # one row per step (log_every 1)
    tokens = cfg.micro_batch_size * cfg.seq_len * cfg.num_workers * cfg.grad_accum_steps
    elapsed = [tokens * (i + 1) / r["tokens_per_s"] for i, r in enumerate(rows)]
    step_s = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]
    return {
        "peak_bytes": max(r["memory/host_peak_gb"] for r in rows) * GB,
        "step_s": statistics.median(step_s or elapsed),
        "kd": [r["kd"] for r in rows],
        "load": (before, os.getloadavg()[0]),
    }


def report(results: dict[tuple[str, int], dict[str, Any]], args: argparse.Namespace) -> None:
    """The Ray Train table and ratios."""
    print("\nRay Train, 2 workers (distill stage):\n")
    print("| allocator / gathers | ZeRO | peak GB (largest rank) | plan GB | peak / plan | step s | load |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for (variant, stage), res in results.items():
        peak, plan = res["peak_bytes"] / GB, res["plan_bytes"] / GB
        print(f"| {VARIANTS[variant][0]} | {stage} | {peak:.2f} | {plan:.2f} | {peak / plan:.2f} | "
              f"{res['step_s']:.2f} | {res['load'][0]:.1f} -> {res['load'][1]:.1f} |")  # fmt: skip
    for variant in args.variants:
        if (variant, 0) in results and (variant, 3) in results:
            z0, z3 = results[(variant, 0)], results[(variant, 3)]
            diff = max(abs(a - b) for a, b in zip(z0["kd"], z3["kd"], strict=True))
            print(f"\n{VARIANTS[variant][0]}: ZeRO-3 / ZeRO-0 peak {z3['peak_bytes'] / z0['peak_bytes']:.2f}, "
                  f"step {z3['step_s'] / z0['step_s']:.2f}; KD per step ZeRO-0 {[round(v, 6) for v in z0['kd']]}, "
                  f"ZeRO-3 largest difference {diff:.1e}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__.split("\n")[0]).parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    parent = make_parent(args.work, args.tiny)
    describe(parent, args)
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    results: dict[tuple[str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for variant in args.variants:
            for stage in args.stages:
                res = run_one(parent, stage, variant, args, Path(tmp))
                results[(variant, stage)] = {**res, "plan_bytes": planned(parent, stage, variant, args).total_bytes}
    ray.shutdown()
    report(results, args)
    print(f"\nload average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
