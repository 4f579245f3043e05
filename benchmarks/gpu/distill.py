"""One ZeRO-3 elastic distillation step on the device: NCCL on CUDA (gloo on a CPU), one process, world size 1.

The parent is ``bench_zero_memory.py``'s (~103M parameters; ``--quick``: its tiny one) with the demo tokenizer.
The step is the distillation worker's own code, as ``bench_zero_memory.py`` runs it outside Ray: the teacher
and student builders of :mod:`components.distill.worker` (the teacher as its own ZeRO-3 engine, the student
partitioned as it is built), the learning-rate schedule, a budget draw, :func:`elastic_loss`, DeepSpeed's
backward and step; in bfloat16 on CUDA (DeepSpeed bf16, float32 master weights), float32 on a CPU. The host
heap settings a CPU worker applies to itself are left out (they would outlive the check in this process).

Two steps (``--quick``: one) are taken. Reported: the build's seconds, the first step's seconds (it pays for
lazy initialisation) and the last one's, the KD loss and gradient norm (a pass needs both finite), and the peak
memory: the device's allocated peak over build and steps and over the steps alone on CUDA, the resident peak
above the start of the section on a CPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.gpu.common import Context, Options, synchronize

_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _backend(options: Options) -> str:
    return "nccl" if options.device == "cuda" else "gloo"


def plan(options: Options) -> list[str]:
    return [f"ZeRO-3 distillation step {_backend(options)} world 1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(backend: str, device: str) -> Iterator[Any]:
    """A one-rank process group in this process and DeepSpeed's communication over it (yields ``deepspeed``);
    both are torn down after, and the rendezvous variables restored."""
    import deepspeed
    import torch
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device == "cuda":
        torch.cuda.set_device(0)
    try:
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=0, world_size=1)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend)
        yield deepspeed
    finally:
        if dist.is_initialized():
            deepspeed.comm.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _settings(parent: Path, out: Path, options: Options) -> dict[str, Any]:
    """The DistillConfig of the step (``bench_zero_memory.py``'s, one worker, ZeRO-3)."""
    cuda = options.device == "cuda"
    return {
        "teacher_uri": str(parent),
        "output_dir": str(out),
        "space": {"hidden": [64, 48, 32] if options.quick else [768, 640, 512], "experts": [8, 6]},
        "budgets": [{"name": "full", "fraction": 1.0}, {"name": "small", "fraction": 0.7}],
        "data": {"sources": [{"type": "generator", "max_steps": 4}]},
        "steps": 1 if options.quick else 2,  # the second step is the one without lazy initialisation
        "micro_batch_size": 2 if options.quick else 4,
        "seq_len": 32 if options.quick else 256,
        "num_workers": 1,
        "use_gpu": cuda,
        "zero_stage": 3,
        "bf16": cuda,
        "warmup_frac": 0.0,
    }


def run(ctx: Context) -> None:
    import torch

    from benchmarks.bench_zero_memory import make_parent
    from components.distill.config import DistillConfig
    from components.distill.heap import resident_peak_bytes, restart_resident_peak
    from model.checkpoint import read_config
    from model.elastic.params import count_params

    name = plan(ctx.options)[0]
    backend, device = _backend(ctx.options), torch.device(ctx.device)
    work = Path(ctx.options.workdir) / "distill"
    work.mkdir(parents=True, exist_ok=True)
    ctx.check_time("writing the parent")
    parent = make_parent(work, tiny=ctx.quick)
    cfg = DistillConfig(**_settings(parent, work / "out", ctx.options))
    model_config = read_config(parent)[0]
    host_base = restart_resident_peak()
    with process_group(backend, ctx.device):
        from components.distill import worker as W
        from components.distill.step import ElasticSpec

        start = time.perf_counter()
        teacher = W.build_teacher(cfg, parent, model_config, device, 1)
        engine, base_lrs = W.build_engine(cfg, W.build_student(cfg, model_config, parent, device, 1), 1, model_config)
        synchronize(ctx.device)
        build_s = time.perf_counter() - start
        ctx.log(f"engines built in {build_s:.1f} s")
        if ctx.device == "cuda":
            build_peak = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        spec = ElasticSpec.from_config(cfg, model_config)
        times, kd, grad_norm = _steps(ctx, cfg, engine, teacher, base_lrs, parent, spec)
    figures: dict[str, Any] = {"backend": backend, "parent_params": count_params(model_config).total,
                               "build_s": build_s, "first_step_s": times[0], "step_s": times[-1], "kd": kd,
                               "grad_norm": grad_norm}  # fmt: skip
    if ctx.device == "cuda":
        figures["step_peak_device_gb"] = torch.cuda.max_memory_allocated() / 1e9
        figures["peak_device_gb"] = max(build_peak, figures["step_peak_device_gb"])
    else:
        figures["peak_host_gb"] = (resident_peak_bytes() - host_base) / 1e9
    finite = math.isfinite(kd) and math.isfinite(grad_norm)
    ctx.row(name, "pass" if finite else "fail", "" if finite else "non-finite KD loss or gradient norm", **figures)


def _steps(
    ctx: Context, cfg: Any, engine: Any, teacher: Any, base_lrs: list[float], parent: Path, spec: Any
) -> tuple[list[float], float, float]:
    """``cfg.steps`` optimizer steps as the worker takes them: (seconds per step, last KD loss, last grad norm)."""
    from components.data import TextTokenizer, derive_seed, make_data_batch
    from components.distill.draws import draw_budget, draw_hard_sample, lr_factor, router_generator
    from components.distill.step import elastic_loss

    tokenizer = TextTokenizer.load(parent)
    stream_seed = derive_seed("distill", cfg.seed, cfg.phase)
    times: list[float] = []
    kd_value = grad_norm = float("nan")
    for step in range(cfg.steps):
        ctx.check_time(f"step {step}")
        synchronize(ctx.device)
        start = time.perf_counter()
        factor = lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        for group, base in zip(engine.optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * factor
        g_step, g_total = cfg.router.schedule_at(step, cfg.steps)
        b_idx = draw_budget(cfg.seed, cfg.phase, step, cfg.sampling_probs)
        batch = make_data_batch(
            cfg.data, tokenizer, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=stream_seed,
            phase="distill1", step=step, rank=0, world=1,
        ).to(ctx.device)  # fmt: skip
        loss, kd, _, _ = elastic_loss(
            engine, teacher, spec, batch.input_ids, batch.loss_mask, b_idx, (g_step, g_total),
            router_generator(cfg.seed, cfg.phase, step, 0, 0),
            draw_hard_sample(cfg.seed, cfg.phase, step, 0, cfg.router.hard_sample_prob),
        )  # fmt: skip
        engine.backward(loss)
        engine.step()
        kd_value = kd.item()
        synchronize(ctx.device)
        times.append(time.perf_counter() - start)
        grad_norm = float(engine.get_global_grad_norm() or 0.0)
        ctx.log(f"step {step + 1}/{cfg.steps}: {times[-1]:.2f} s, kd {kd_value:.4f}")
    return times, kd_value, grad_norm
