"""Per-worker memory and step time of elastic distillation at ZeRO-0 and ZeRO-3, against ``star-elastic plan``.

Two data-parallel workers run a few steps of the distillation worker's own code (the teacher, student and
engine builders of :mod:`components.distill.worker`, :func:`elastic_loss`, DeepSpeed backward and step,
then one sharded checkpoint) on a random parent of about 100M parameters, once at ZeRO-0 and once at
ZeRO-3 (teacher included: replicated at ZeRO-0, its own ZeRO-3 engine at ZeRO-3). For every worker it
prints the peak resident memory above the process's baseline after imports and process-group setup,
the plan's prediction for the same shape (:func:`components.plan.plan_phase` with ``device="cpu"``,
float32) and the median step time.

The workers are two ``torch.distributed`` processes (gloo) started by this script, not Ray Train
workers: Ray Train adds its own controller, reports and object store to each process, which would
blur what the distillation itself holds; everything the workers run is the worker module's code.

Peak memory is the kernel's high-water mark (``VmHWM``), reset after the baseline is taken
(``/proc/self/clear_refs``). Linux only.

    .venv/bin/python -m benchmarks.bench_zero_memory   # ~100M parent, 4 steps, ZeRO-0 then ZeRO-3
    .venv/bin/python -m benchmarks.bench_zero_memory --release-large-blocks   # peaks of the live memory
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


def release_large_blocks(threshold: int = 128 << 10) -> bool:
    """glibc: serve allocations of ``threshold`` bytes or more with their own memory mappings, which go back to
    the system when freed (``mallopt(M_MMAP_THRESHOLD)``; setting it also stops glibc from raising it).

    By default glibc raises that threshold up to 32 MB as large blocks are freed; blocks below it then come from
    the heap and stay there after they are freed, so the resident peak also counts memory the process has freed.
    With this call the peak is the live memory, at the price of a page fault for every page of every new large
    block. Returns False where ``mallopt`` is unavailable (not glibc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt is not None and mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD


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


def distill_settings(parent: Path, out: Path, stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """The DistillConfig of the measured runs (float32, 2 workers)."""
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
    }


# ---------------------------------------------------------------------- one worker process
def run_worker(args: argparse.Namespace) -> None:
    """One rank: baseline after imports, then build, train ``steps`` steps, save one checkpoint; JSON out."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two workers share the machine's cores
    import deepspeed

    from components.data import TextTokenizer, derive_seed, make_data_batch
    from components.distill import ckpt, heap
    from components.distill import worker as W
    from components.distill.config import DistillConfig
    from model.checkpoint import read_config
    from model.elastic.params import count_params

    heap_cfg = heap.HostHeapConfig.model_validate_json(args.heap or "{}")
    heap.apply(heap_cfg)
    if args.release_large_blocks:
        release_large_blocks()
    if args.zero3_extra:
        from components.distill import zero3

        base_settings = zero3.zero3_settings
        zero3.zero3_settings = lambda c, **k: {**base_settings(c, **k), **json.loads(args.zero3_extra)}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    import gc

    gc.collect()
    baseline = rss_bytes()
    reset_peak()
    out = Path(args.out)
    cfg = DistillConfig(**json.loads(Path(args.config).read_text()))
    parent = Path(cfg.teacher_uri)
    model_config = read_config(parent)[0]
    device = torch.device("cpu")
    t0 = time.perf_counter()
    teacher = W.build_teacher(cfg, parent, model_config, device, world)
    after_teacher = rss_bytes()
    engine, base_lrs = W.build_engine(
        cfg, W.build_student(cfg, model_config, parent, device, world), world, model_config
    )
    after_build = rss_bytes()
    build_s = time.perf_counter() - t0
    tokenizer = TextTokenizer.load(parent)
    counts = count_params(model_config)
    stream_seed = derive_seed("distill", cfg.seed, cfg.phase)
    times, kds, cpu_s, sys_s, faults = [], [], [], [], []
    phases: dict[str, list[float]] = {}
    overall = [peak_bytes()]
    trim_phase = heap_cfg.trim == "phase"

    def mark(name: str) -> None:
        """End of a phase: record its resident peak and the heap's state, then restart the high-water mark."""
        peak = peak_bytes()
        overall.append(peak)
        info = heap.mallinfo()
        row = phases.setdefault(name, [])
        row.append((peak - baseline, rss_bytes() - baseline, info.get("fordblks", 0), info.get("hblkhd", 0)))
        if trim_phase or (heap_cfg.trim == "micro_step" and name == "step"):
            heap.trim()
        reset_peak()

    class Traced:
        def __init__(self, inner):
            self.inner = inner
            self.module = getattr(inner, "module", inner)

        def __call__(self, *a, **k):
            out = self.inner(*a, **k)
            mark("teacher forward")
            return out

    teacher = Traced(teacher)
    import cProfile
    import pstats

    profile = cProfile.Profile() if args.profile and rank == 0 else None
    for step in range(cfg.steps):
        if profile is not None and step == 1:
            profile.enable()
        start = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF)
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
            engine, teacher, batch.input_ids, batch.loss_mask, cfg.budget_set, b_idx, g_step, g_total,
            W.router_generator(cfg.seed, cfg.phase, step, 0, rank), cfg.alpha, counts.active, cfg.space,
            cfg.depth_order, cfg.dead_zone, counts.total,
            W.draw_hard_sample(cfg.seed, cfg.phase, step, 0, cfg.router.hard_sample_prob), cfg.kd_chunk_tokens,
        )  # fmt: skip
        mark("student forward + loss")
        engine.backward(loss)
        mark("backward")
        engine.step()
        mark("step")
        reduced = kd.detach().double().reshape(1)
        dist.all_reduce(reduced)
        kds.append(reduced.item() / world)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
        sys_s.append(after.ru_stime - usage.ru_stime)
        faults.append(after.ru_minflt - usage.ru_minflt)
        if os.environ.get("BENCH_MALLOC_INFO") and step == cfg.steps - 1:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            libc.fopen.restype = ctypes.c_void_p
            fp = libc.fopen(f"{os.environ['BENCH_MALLOC_INFO']}/mi_z{cfg.zero_stage}_r{rank}.xml".encode(), b"w")
            libc.malloc_info(0, ctypes.c_void_p(fp))
            libc.fclose(ctypes.c_void_p(fp))
        if profile is not None and step == 1:
            profile.disable()
            with open(out / "profile.txt", "w") as fh:
                pstats.Stats(profile, stream=fh).sort_stats("tottime").print_stats(15)
    peak_train = max(overall)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        state = ckpt.TrainState(next_step=cfg.steps, world_size=world, zero_stage=cfg.zero_stage)
        t1 = time.perf_counter()
        ckpt.save_checkpoint(engine, Path(tmp), rank, state)
        save_s = time.perf_counter() - t1
        shard_bytes = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
    peak_all = max(peak_train, peak_bytes())
    comm = collective_seconds_per_gb(dist)
    result = {
        "rank": rank,
        "zero_stage": cfg.zero_stage,
        "baseline_bytes": baseline,
        "after_teacher_bytes": after_teacher - baseline,
        "after_build_bytes": after_build - baseline,
        "peak_train_bytes": peak_train - baseline,
        "peak_bytes": peak_all - baseline,
        "collective_s_per_gb": comm,
        "build_s": build_s,
        "step_s": times,
        "cpu_s": cpu_s,
        "sys_s": sys_s,
        "minor_faults": faults,
        "kd": kds,
        "save_s": save_s,
        "shard_bytes": shard_bytes,
        "phases": phases,
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


def run_stage(parent: Path, stage: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Both ranks of one ZeRO stage; returns their results."""
    out = work / f"zero{stage}"
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps(distill_settings(parent, out / "output", stage, args)))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "benchmarks.bench_zero_memory", "--worker", "--config", str(config), "--out", str(out)]
    cmd += ["--release-large-blocks"] * args.release_large_blocks + ["--profile"] * args.profile
    cmd += ["--heap", args.heap, "--zero3-extra", args.zero3_extra]
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    logs = [p.communicate()[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"ZeRO-{stage} rank {r} failed ({p.returncode}):\n{log[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def read_profile(work: Path, stage: int) -> str:
    """The profile rank 0 wrote for ``stage`` (``--profile``): the table rows only."""
    path = work / f"zero{stage}" / "profile.txt"
    if not path.exists():
        return ""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), 0)
    return "\n".join(line[:160] for line in lines[start:] if line.strip())


def planned(parent: Path, stage: int, args: argparse.Namespace) -> Any:
    """The plan of the measured runs' DistillConfig on 2 CPU ranks (float32)."""
    from components.distill.config import DistillConfig
    from components.plan import PhaseShape, PlanHardware, plan_phase
    from model.checkpoint import read_config

    shape = PhaseShape.of(f"zero{stage}", DistillConfig(**distill_settings(parent, Path("plan"), stage, args)))
    hw = PlanHardware(gpus=2, gpu_mem_gb=1000.0, device="cpu", gpus_per_node=2, host_overhead_gb=0.0)
    return plan_phase(read_config(parent)[0], shape, hw)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--kd-chunk", type=int, default=1024, help="kd_chunk_tokens (0: the reference loss)")
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false", help="activations kept whole")
    ap.add_argument(
        "--release-large-blocks",
        action="store_true",
        help="workers return every freed block of 128 KB or more to the system (release_large_blocks): the peak is "
        "then the live memory; glibc's default keeps freed blocks of up to 32 MB in the heap",
    )
    ap.add_argument("--profile", action="store_true", help="print rank 0's top functions in its second step")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_zero_memory")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--heap", default="", help="HostHeapConfig JSON applied by the workers")
    ap.add_argument("--zero3-extra", default="", help="JSON merged into the ZeRO-3 settings")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    parent = make_parent(args.work, args.tiny)
    from model.checkpoint import read_config
    from model.elastic.params import count_params

    n = count_params(read_config(parent)[0]).total
    load = os.getloadavg()
    print(
        f"parent: {n / 1e6:.1f}M parameters (float32), 2 workers x 1 thread, {args.steps} steps of "
        f"{args.micro_batch} x {args.seq_len} tokens per worker; activation checkpointing "
        f"{'on' if args.checkpointing else 'off'}; kd_chunk_tokens {args.kd_chunk}; glibc allocator "
        f"{'with release_large_blocks' if args.release_large_blocks else 'default'}; "
        f"load average {load[0]:.1f} / {load[1]:.1f}"
    )
    rows, results = [], {}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for stage in args.stages:
            ranks = run_stage(parent, stage, args, Path(tmp))
            plan = planned(parent, stage, args)
            results[stage] = {
                "ranks": ranks,
                "plan_bytes": plan.total_bytes,
                "plan_items": [{"name": i.name, "gb": i.bytes / GB} for i in plan.items],
                "profile": read_profile(Path(tmp), stage),
            }
            for r in ranks:
                print(
                    f"ZeRO-{stage} rank {r['rank']}: cpu s/step {[round(x, 2) for x in r['cpu_s']]}, sys "
                    f"{[round(x, 2) for x in r['sys_s']]}, faults {r['minor_faults']}, "
                    f"wall {[round(x, 2) for x in r['step_s']]}"
                )
                steps = r["step_s"][1:] or r["step_s"]
                rows.append((stage, r["rank"], r["baseline_bytes"] / GB, r["after_build_bytes"] / GB,
                             r["peak_train_bytes"] / GB, r["peak_bytes"] / GB, plan.total_bytes / GB,
                             r["peak_bytes"] / plan.total_bytes, statistics.median(steps), r["build_s"]))  # fmt: skip
    print()
    print("| ZeRO | rank | baseline GB | built GB | peak (steps) GB | peak (+ checkpoint) GB | plan GB | "
          "peak / plan | step s (median) | build s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.1f} |".format(*row))
    if 0 in results and 3 in results:
        peak0 = max(r["peak_bytes"] for r in results[0]["ranks"])
        peak3 = max(r["peak_bytes"] for r in results[3]["ranks"])
        step0 = statistics.median(s for r in results[0]["ranks"] for s in r["step_s"][1:] or r["step_s"])
        step3 = statistics.median(s for r in results[3]["ranks"] for s in r["step_s"][1:] or r["step_s"])
        kd0, kd3 = results[0]["ranks"][0]["kd"], results[3]["ranks"][0]["kd"]
        print()
        print(f"ZeRO-3 / ZeRO-0 peak above baseline (largest rank): {peak3 / peak0:.2f}")
        print(f"ZeRO-3 / ZeRO-0 median step time (steps after the first): {step3 / step0:.2f}")
        print(f"KD loss per step, ZeRO-0: {[round(v, 6) for v in kd0]}")
        print(f"KD loss per step, ZeRO-3: {[round(v, 6) for v in kd3]}")
        print(f"largest difference: {max(abs(a - b) for a, b in zip(kd0, kd3, strict=True)):.2e}")
    comm = results[args.stages[0]]["ranks"][0]["collective_s_per_gb"]
    print("\ngloo collectives between the two workers, seconds per GB of the full tensor: "
          + ", ".join(f"{k} {v:.2f}" for k, v in comm.items()))  # fmt: skip
    for stage, res in results.items():
        print(f"\nZeRO-{stage} rank 0 by phase (GB above baseline; max over steps): peak / resident after / "
              "free in heap / own mappings")  # fmt: skip
        for name, rows in res["ranks"][0]["phases"].items():
            print(f"  {name:24s} " + " / ".join(f"{max(r[i] for r in rows) / GB:.2f}" for i in range(4))
                  + "   per step peak: " + ", ".join(f"{r[0] / GB:.2f}" for r in rows))  # fmt: skip
        if res.get("profile"):
            print(f"\nrank 0, second step, ZeRO-{stage} (cProfile, by own time):\n{res['profile']}")
        print(f"\nplan, ZeRO-{stage}: " + ", ".join(f"{i['name']} {i['gb']:.3f}" for i in res["plan_items"]))
    if args.json:
        end_load = os.getloadavg()
        args.json.write_text(json.dumps({"load_average": [load, end_load], "args": vars(args) | {
            "work": str(args.work), "json": str(args.json)}, "results": results}, indent=1, default=str))  # fmt: skip
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} / {os.getloadavg()[1]:.1f}")


if __name__ == "__main__":
    main()
