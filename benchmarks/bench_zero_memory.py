"""Per-worker memory and step time of elastic distillation at ZeRO-0 and ZeRO-3, against ``star-elastic plan``.

Two data-parallel workers run a few steps of the distillation worker's own code (the host-memory setup,
teacher, student and engine builders of :mod:`components.distill.worker`, :func:`elastic_loss`, DeepSpeed
backward and step, then one sharded checkpoint) on a random parent of about 100M parameters, at ZeRO-0 and
at ZeRO-3 (teacher included: replicated at ZeRO-0, its own ZeRO-3 engine at ZeRO-3), for each of a few
host-memory variants (``VARIANTS``: the worker's default, glibc's allocator as it is, ...), all in one run.
For every worker it prints the peak resident memory above the process's baseline after imports and
process-group setup, the plan's prediction for the same config (:func:`components.plan.plan_phase` with
``device="cpu"``), the step time and, per step, the CPU seconds, the system (kernel) seconds and the minor
page faults: on a loaded machine the wall time mostly measures the neighbours, the CPU time much less so.

The workers are two ``torch.distributed`` processes (gloo) started by this script: that isolates what the
distillation itself holds, and everything they run is the worker module's code.
:mod:`benchmarks.bench_zero_memory_ray` measures the same through the distill stage on Ray Train.

Peak memory is the kernel's high-water mark (``VmHWM``), restarted after the baseline and at the end of
each phase of a step (teacher forward, student forward + loss, backward, optimizer step;
``/proc/self/clear_refs``), which also gives the peak of each phase. Linux only.

    .venv/bin/python -m benchmarks.bench_zero_memory            # ~100M parent, 4 steps, worker default vs glibc
    .venv/bin/python -m benchmarks.bench_zero_memory --variants worker glibc pinned-coalesced glibc-per-parameter
    .venv/bin/python -m benchmarks.bench_zero_memory --tiny     # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
PHASES = ("teacher forward", "student forward + loss", "backward", "step")

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "worker": ("worker default", {}),
    "glibc": ("glibc default, coalesced gathers", {"host_heap": {}, "zero3_gathers": "coalesced"}),
    "pinned-coalesced": (
        "mmap threshold 128 KB, coalesced gathers",
        {"host_heap": {"mmap_threshold": 131072}, "zero3_gathers": "coalesced"},
    ),
    "glibc-per-parameter": (
        "glibc default, per-parameter gathers",
        {"host_heap": {}, "zero3_gathers": "per_parameter"},
    ),
    "pinned": ("mmap threshold 128 KB at every stage", {"host_heap": {"mmap_threshold": 131072}}),
}
"""Host-memory settings compared: name -> (label, DistillConfig fields). ``worker`` is what the worker does by
itself (:func:`components.distill.worker.configure_host_memory`, :func:`components.distill.zero3.
per_parameter_gathers`)."""


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def rss_bytes() -> int:
    """Resident memory of this process now."""
    return _status_kb("VmRSS") * 1024


def peak_bytes() -> int:
    """High-water mark of resident memory since the last :func:`reset_peak`."""
    return _status_kb("VmHWM") * 1024


def reset_peak() -> None:
    """Restart the high-water mark at the current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")


def parent_config(tiny: bool) -> dict[str, Any]:
    """The benchmark parent: the demo's layer pattern twice (16 layers), hidden 768, vocabulary 8192,
    103.2M parameters; ``tiny``: the same kinds at toy sizes."""
    if tiny:
        return dict(
            vocab_size=512, hidden_size=64, pattern="M*EMEM-E", num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
            chunk_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=64,
        )  # fmt: skip
    return dict(
        vocab_size=8192, hidden_size=768, pattern="M*EMEM-E" * 2, num_attention_heads=12, num_key_value_heads=2,
        head_dim=64, intermediate_size=2048, mamba_num_heads=24, mamba_head_dim=64, n_groups=2, ssm_state_size=64,
        chunk_size=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=640,
        moe_shared_expert_intermediate_size=1280,
    )  # fmt: skip


def distill_settings(parent: Path, out: Path, stage: int, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """The DistillConfig of one measured run (float32, 2 CPU workers)."""
    return {
        "teacher_uri": str(parent),
        "output_dir": str(out),
        "space": {"hidden": [64, 48, 32] if args.tiny else [768, 640, 512], "experts": [8, 6]},
        "budgets": [{"name": "full", "fraction": 1.0}, {"name": "small", "fraction": 0.7}],
        "data": {"sources": [{"type": "generator", "max_steps": 4}]},
        "steps": args.steps,
        "micro_batch_size": args.micro_batch,
        "seq_len": args.seq_len,
        "num_workers": 2,
        "zero_stage": stage,
        "bf16": False,
        "kd_chunk_tokens": args.kd_chunk,
        "activation_checkpointing": args.checkpointing,
        "warmup_frac": 0.0,
        **VARIANTS[variant][1],
    }


# ---------------------------------------------------------------------- one worker process
def run_worker(args: argparse.Namespace) -> None:  # noqa: C901 - one measured sequence
    """One rank: host-memory setup, baseline after imports, then build, train ``steps`` steps, save one
    checkpoint; JSON out."""
    import cProfile
    import gc
    import pstats

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two workers share the machine's cores
    import deepspeed

    from components.data import TextTokenizer, derive_seed, make_data_batch
    from components.distill import ckpt, heap
    from components.distill import worker as W
    from components.distill.config import DistillConfig
    from components.distill.step import ElasticSpec
    from model.checkpoint import read_config

    cfg = DistillConfig(**json.loads(Path(args.config).read_text()))
    applied = W.configure_host_memory(cfg)  # what the Ray Train worker does first
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    gc.collect()
    baseline = rss_bytes()
    reset_peak()
    out = Path(args.out)
    parent = Path(cfg.teacher_uri)
    model_config = read_config(parent)[0]
    device = torch.device("cpu")
    t0 = time.perf_counter()
    teacher = W.build_teacher(cfg, parent, model_config, device, world)
    engine, base_lrs = W.build_engine(
        cfg, W.build_student(cfg, model_config, parent, device, world), world, model_config
    )
    after_build = rss_bytes()
    build_s = time.perf_counter() - t0
    tokenizer = TextTokenizer.load(parent)
    spec = ElasticSpec.from_config(cfg, model_config)
    stream_seed = derive_seed("distill", cfg.seed, cfg.phase)
    steps: list[dict[str, float]] = []
    phases: dict[str, list[list[float]]] = {name: [] for name in PHASES}
    peaks = [peak_bytes()]  # the build's peak, then each phase's

    def mark(name: str) -> None:
        """End of a phase: its resident peak, the resident memory and glibc's free heap now; restart the mark."""
        peaks.append(peak_bytes())
        info = heap.mallinfo()
        phases[name].append([peaks[-1] - baseline, rss_bytes() - baseline, info.get("fordblks", 0)])
        reset_peak()

    class MarkedTeacher:
        """The teacher as :func:`elastic_loss` calls it, marking the end of its forward."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.module = inner, getattr(inner, "module", inner)

        def __call__(self, *a: Any, **k: Any) -> Any:
            result = self.inner(*a, **k)
            mark("teacher forward")
            return result

    marked = MarkedTeacher(teacher)
    profile = cProfile.Profile() if args.profile and rank == 0 else None
    for step in range(cfg.steps):
        if profile is not None and step == 1:
            profile.enable()
        start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        factor = W.lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        for group, base in zip(engine.optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * factor
        g_step, g_total = cfg.router.schedule_at(step, cfg.steps)
        b_idx = W.draw_budget(cfg.seed, cfg.phase, step, cfg.sampling_probs)
        batch = make_data_batch(
            cfg.data, tokenizer, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=stream_seed,
            phase="distill1", step=step, rank=rank, world=world,
        )  # fmt: skip
        loss, kd, _, _ = W.elastic_loss(
            engine, marked, spec, batch.input_ids, batch.loss_mask, b_idx, (g_step, g_total),
            W.router_generator(cfg.seed, cfg.phase, step, 0, rank),
            W.draw_hard_sample(cfg.seed, cfg.phase, step, 0, cfg.router.hard_sample_prob),
        )  # fmt: skip
        mark("student forward + loss")
        engine.backward(loss)
        mark("backward")
        engine.step()
        mark("step")
        wall, now = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        reduced = kd.detach().double().reshape(1)
        dist.all_reduce(reduced)
        steps.append({
            "wall_s": wall, "kd": reduced.item() / world,
            "cpu_s": now.ru_utime + now.ru_stime - usage.ru_utime - usage.ru_stime,
            "sys_s": now.ru_stime - usage.ru_stime, "minor_faults": now.ru_minflt - usage.ru_minflt,
        })  # fmt: skip
        if profile is not None and step == 1:
            profile.disable()
            with open(out / "profile.txt", "w") as fh:
                pstats.Stats(profile, stream=fh).sort_stats("tottime").print_stats(15)
    peak_train = max(peaks)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        state = ckpt.TrainState(next_step=cfg.steps, world_size=world, zero_stage=cfg.zero_stage)
        t1 = time.perf_counter()
        ckpt.save_checkpoint(engine, Path(tmp), rank, state)
        save_s = time.perf_counter() - t1
        shard_bytes = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
    result = {
        "rank": rank,
        "zero_stage": cfg.zero_stage,
        "host_heap": applied,
        "baseline_bytes": baseline,
        "after_build_bytes": after_build - baseline,
        "peak_train_bytes": peak_train - baseline,
        "peak_bytes": max(peak_train, peak_bytes()) - baseline,
        "collective_s_per_gb": collective_seconds_per_gb(dist),
        "build_s": build_s,
        "steps": steps,
        "phases": phases,
        "save_s": save_s,
        "shard_bytes": shard_bytes,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def collective_seconds_per_gb(dist: Any, numel: int = 25_000_000) -> dict[str, float]:
    """Seconds per GB of the full (gathered / reduced) tensor of gloo's all-reduce, all-gather and reduce-scatter
    between the two workers, 100 MB per rank (after the measured steps: not in the peak)."""
    import torch

    x, full = torch.randn(numel), torch.empty(2 * numel)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, x),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(x, full),
    }
    out = {}
    for name, op in ops.items():
        op()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(3):
            op()
        dist.barrier()
        out[name] = (time.perf_counter() - start) / 3 / (full.numel() * 4 / GB)
    return out


# ---------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_parent(folder: Path, tiny: bool) -> Path:
    """A random parent (seeded) with the demo tokenizer beside it, written once and reused."""
    from components.data import TextTokenizer, build_demo_tokenizer
    from model.config import HybridConfig
    from model.hybrid import HybridLM

    target = folder / ("parent-tiny" if tiny else "parent")
    if (target / "config.json").exists():
        return target
    tok = TextTokenizer(build_demo_tokenizer())
    tok_dir = tok.save(folder / "tok")
    model = HybridLM(HybridConfig(**parent_config(tiny))).init_weights(0)
    return model.save_pretrained(target, extra_files={p.name: p for p in tok_dir.iterdir()})


def run_stage(parent: Path, stage: int, variant: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Both ranks of one (ZeRO stage, variant); returns their results."""
    out = work / f"{variant}-zero{stage}"
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps(distill_settings(parent, out / "output", stage, variant, args)))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "benchmarks.bench_zero_memory", "--worker", "--config", str(config), "--out", str(out)]
    cmd += ["--profile"] * args.profile
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    logs = [p.communicate()[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"ZeRO-{stage} {variant} rank {r} failed ({p.returncode}):\n{log[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def planned(parent: Path, stage: int, variant: str, args: argparse.Namespace) -> Any:
    """The plan of the measured runs' DistillConfig on 2 CPU ranks (float32)."""
    from components.distill.config import DistillConfig
    from components.plan import PhaseShape, PlanHardware, plan_phase
    from model.checkpoint import read_config

    cfg = DistillConfig(**distill_settings(parent, Path("plan"), stage, variant, args))
    hw = PlanHardware(gpus=2, gpu_mem_gb=1000.0, device="cpu", gpus_per_node=2, host_overhead_gb=0.0)
    return plan_phase(read_config(parent)[0], PhaseShape.of(f"zero{stage}", cfg), hw)


def _median(ranks: list[dict[str, Any]], key: str) -> float:
    """Median of ``key`` over both ranks' steps after the first (the first also allocates Adam's moments)."""
    return statistics.median(s[key] for r in ranks for s in (r["steps"][1:] or r["steps"]))


def report(results: dict[tuple[str, int], dict[str, Any]], args: argparse.Namespace) -> None:
    """The tables: memory and time per (variant, stage, rank), the ratios, the phases, the plan's items."""
    print("\n| allocator / gathers | ZeRO | rank | built GB | peak GB | plan GB | peak / plan | step s | CPU s | "
          "sys s | page faults | load |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for (variant, stage), res in results.items():
        for r in res["ranks"]:
            one = {k: statistics.median(s[k] for s in r["steps"][1:] or r["steps"]) for k in r["steps"][0]}
            peak, plan = r["peak_bytes"] / GB, res["plan_bytes"] / GB
            load = f"{res['load'][0]:.1f} -> {res['load'][1]:.1f}"
            print(f"| {VARIANTS[variant][0]} | {stage} | {r['rank']} | {r['after_build_bytes'] / GB:.2f} | "
                  f"{peak:.2f} | {plan:.2f} | {peak / plan:.2f} | {one['wall_s']:.2f} | {one['cpu_s']:.2f} | "
                  f"{one['sys_s']:.2f} | {one['minor_faults']:,.0f} | {load} |")  # fmt: skip
    print("\n(step, CPU and sys seconds and faults: medians over both ranks of the steps after the first; load: the "
          "1-minute load average before -> after the run)")  # fmt: skip

    def peak(key: tuple[str, int]) -> float:
        return max(r["peak_bytes"] for r in results[key]["ranks"])

    def ratios(z3: tuple[str, int], z0: tuple[str, int]) -> str:
        r3, r0 = results[z3]["ranks"], results[z0]["ranks"]
        wall, cpu = _median(r3, "wall_s") / _median(r0, "wall_s"), _median(r3, "cpu_s") / _median(r0, "cpu_s")
        return f"peak (largest rank) {peak(z3) / peak(z0):.2f}, step {wall:.2f}, CPU {cpu:.2f}"

    for variant in args.variants:
        label = VARIANTS[variant][0]
        if (variant, 0) in results and (variant, 3) in results:
            print(f"\n{label}: ZeRO-3 / ZeRO-0 {ratios((variant, 3), (variant, 0))}")
            kd0 = [s["kd"] for s in results[(variant, 0)]["ranks"][0]["steps"]]
            kd3 = [s["kd"] for s in results[(variant, 3)]["ranks"][0]["steps"]]
            diff = max(abs(a - b) for a, b in zip(kd0, kd3, strict=True))
            print(f"  KD loss per step: ZeRO-0 {[round(v, 6) for v in kd0]}, ZeRO-3 largest difference {diff:.1e}")
        if ("glibc", 0) in results and (variant, 3) in results and variant != "glibc":
            print(f"{label} ZeRO-3 / glibc default ZeRO-0: {ratios((variant, 3), ('glibc', 0))}")
    comm = next(iter(results.values()))["ranks"][0]["collective_s_per_gb"]
    print("\ngloo collectives between the two workers, seconds per GB of the full tensor: "
          + ", ".join(f"{k} {v:.2f}" for k, v in comm.items()))  # fmt: skip
    print("\nrank 0 by phase, steps after the first (GB above baseline, largest): peak / resident after / free heap")
    for (variant, stage), res in results.items():
        cells = []
        for name, rows in res["ranks"][0]["phases"].items():
            rows = rows[1:] or rows
            cells.append(f"{name} " + " / ".join(f"{max(r[i] for r in rows) / GB:.2f}" for i in range(3)))
        print(f"  {VARIANTS[variant][0]}, ZeRO-{stage}: " + "; ".join(cells))
        if res.get("profile"):
            print(f"\nrank 0, second step (cProfile, by own time):\n{res['profile']}")
    for stage in sorted({s for _, s in results}):
        items = next(res["plan_items"] for (_, s), res in results.items() if s == stage)
        print(f"\nplan, ZeRO-{stage}: " + ", ".join(f"{i['name']} {i['gb']:.3f}" for i in items))


def parser(description: str) -> argparse.ArgumentParser:
    """The options of a measured run (shared with :mod:`benchmarks.bench_zero_memory_ray`)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--kd-chunk", type=int, default=1024, help="kd_chunk_tokens (0: the reference loss)")
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false", help="activations kept whole")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["worker", "glibc"],
                    help="host-memory variants, each run at every stage: " + "; ".join(
                        f"{k}: {v[0]}" for k, v in VARIANTS.items()))  # fmt: skip
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_zero_memory")
    return ap


def describe(parent: Path, args: argparse.Namespace) -> None:
    """Print the parent's size, the run's shape and the load average."""
    from model.checkpoint import read_config
    from model.elastic.params import count_params

    n = count_params(read_config(parent)[0]).total
    print(
        f"parent: {n / 1e6:.1f}M parameters (float32), 2 workers x 1 thread, {args.steps} steps of "
        f"{args.micro_batch} x {args.seq_len} tokens per worker; activation checkpointing "
        f"{'on' if args.checkpointing else 'off'}; kd_chunk_tokens {args.kd_chunk}; "
        f"load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)"
    )


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--profile", action="store_true", help="print rank 0's top functions in its second step")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    parent = make_parent(args.work, args.tiny)
    describe(parent, args)
    results: dict[tuple[str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for variant in args.variants:
            for stage in args.stages:
                before = os.getloadavg()[0]
                ranks = run_stage(parent, stage, variant, args, Path(tmp))
                plan = planned(parent, stage, variant, args)
                profile = Path(tmp) / f"{variant}-zero{stage}" / "profile.txt"
                results[(variant, stage)] = {
                    "ranks": ranks,
                    "load": (before, os.getloadavg()[0]),
                    "plan_bytes": plan.total_bytes,
                    "plan_items": [{"name": i.name, "gb": i.bytes / GB} for i in plan.items],
                    "profile": _profile_rows(profile),
                }
    report(results, args)
    if args.json:
        data = {f"{v}/zero{s}": res for (v, s), res in results.items()}
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": data}, indent=1)
        )
    print(f"\nload average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")


def _profile_rows(path: Path) -> str:
    """The rows of a cProfile table rank 0 wrote (``--profile``), or ''."""
    if not path.exists():
        return ""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), 0)
    return "\n".join(line[:160] for line in lines[start:] if line.strip())


if __name__ == "__main__":
    main()
