"""The Ray Train worker of elastic distillation: one data-parallel rank of a DeepSpeed engine.

One step (identical on every rank except for the data shard):

1. draw the budget from a generator seeded by ``(seed, phase, step)`` (same draw on every rank);
2. build this rank's batch: ``make_batch`` index ``step * world_size + rank``;
3. teacher forward (frozen permuted parent, no grad) -> teacher logits (batch, seq, vocab);
4. engine forward of :class:`ElasticStudent`: router sample for the budget one-hot (noise from a
   generator seeded by ``(seed, phase, step)``) -> ``soft_mask`` -> masked student forward;
5. ``kd_loss`` (forward KL on target tokens) ``+ alpha * budget_loss``; DeepSpeed backward, grad
   clip and AdamW step with two learning rates (weights, router ~100x), warmup + cosine.

Design choices:

* The module DeepSpeed wraps holds the student AND the router, and the router runs inside its
  ``forward``: under ZeRO-3 DeepSpeed only gathers parameters of modules called through the
  engine, and both sets of parameters then share one optimizer, one clip and one reduction.
* DeepSpeed is imported inside the worker (it is heavy and probes the accelerator at import), its
  shared-memory comm op is marked incompatible before ``initialize`` (otherwise it is compiled on
  first use, ~2 min on a CPU), and the client optimizer is torch's AdamW: DeepSpeed's fused and
  CPU Adam are C++ extensions compiled on first use.
* Every rank calls ``ray.train.report`` at the same steps (it is a barrier), each with its own
  checkpoint folder (its optimizer shard; rank 0 adds weights and state); Ray merges the folders.
  Reports happen only at checkpoint steps: each one costs a second or two. A checkpoint report is
  followed by a metrics-only report that returns once Ray has registered the checkpoint (see
  ``save_and_report``), so a crash right after a checkpoint resumes from it, not from the one before.
* The step counter is the whole data position: batch, budget draw and router noise of step ``s``
  are functions of ``(seed, phase, s)``, so a resumed run sees exactly what it would have seen.
* Rank 0 alone talks to MLflow. Losses are averaged over ranks (one small all-reduce per logged
  step) so the logged KD loss is the global one, not rank 0's shard.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import Tensor, nn

from components.data import CharTokenizer, derive_seed, make_batch
from components.distill import ckpt
from components.distill.config import DistillConfig
from model.config import HybridConfig
from model.elastic.budgets import BudgetSet
from model.elastic.build_masks import soft_mask
from model.elastic.losses import BudgetLossOut, budget_loss, kd_loss
from model.elastic.params import count_params
from model.elastic.router import BudgetRouter, RouterSample
from model.elastic.space import ElasticSpace
from model.hybrid import HybridLM


class ElasticStudent(nn.Module):
    """The trained module: the student HybridLM and its BudgetRouter, run together in ``forward``."""

    def __init__(self, student: HybridLM, router: BudgetRouter, depth_order: list[int] | None = None) -> None:
        super().__init__()
        self.student = student
        self.router = router
        self.depth_order = depth_order

    def forward(
        self, input_ids: Tensor, budget_vec: Tensor, step: int, total_steps: int, generator: torch.Generator
    ) -> tuple[Tensor, RouterSample]:
        """input_ids (batch, seq), budget_vec (n_budgets,) -> student logits (batch, seq, vocab) and the sample."""
        sample = self.router(budget_vec, step, total_steps, generator=generator)
        probs = {axis: p.to(self.student.lm_head.weight.dtype) for axis, p in sample.probs.items()}
        mask = soft_mask(self.student.config, probs, self.router.space, self.depth_order)
        return self.student(input_ids, mask=mask).logits, sample


# ---------------------------------------------------------------------- step pieces (no Ray, no DeepSpeed)
def draw_budget(seed: int, phase: int, step: int, probs: list[float]) -> int:
    """Index (largest budget first) of the budget trained at ``step``; the same on every rank."""
    g = torch.Generator().manual_seed(derive_seed("budget", seed, phase, step))
    return int(torch.multinomial(torch.tensor(probs, dtype=torch.float64), 1, generator=g).item())


def router_generator(seed: int, phase: int, step: int) -> torch.Generator:
    """CPU generator of the router's Gumbel noise and hard-sample coin at ``step`` (same on every rank)."""
    return torch.Generator().manual_seed(derive_seed("router", seed, phase, step))


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak lr: linear warmup over ``warmup`` steps, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


def elastic_loss(
    model: nn.Module,
    teacher: HybridLM,
    input_ids: Tensor,
    loss_mask: Tensor,
    budgets: BudgetSet,
    budget_index: int,
    step: int,
    total_steps: int,
    generator: torch.Generator,
    alpha: float,
    full_active: int,
    space: ElasticSpace,
    depth_order: list[int] | None = None,
    dead_zone: float = 0.05,
) -> tuple[Tensor, Tensor, BudgetLossOut, RouterSample]:
    """(total loss, KD loss, budget loss, router sample) of one elastic step; ``model`` is an
    :class:`ElasticStudent` or a DeepSpeed engine around one."""
    budget = budgets.budgets[budget_index]
    with torch.no_grad():
        teacher_logits = teacher(input_ids).logits
    vec = budgets.one_hot(budget.name)
    student_logits, sample = model(input_ids, vec, step, total_steps, generator)
    kd = kd_loss(student_logits, teacher_logits, loss_mask)
    bl = budget_loss(
        teacher.config, space, sample.probs, budget.fraction, budget_index == 0,
        dead_zone=dead_zone, depth_order=depth_order, full_active=full_active,
    )  # fmt: skip
    return kd + alpha * bl.loss.to(kd.dtype), kd, bl, sample


def param_groups(model: ElasticStudent, cfg: DistillConfig) -> list[dict[str, Any]]:
    """AdamW groups: decayed student matrices, undecayed student vectors/norms, router (router_lr, no decay)."""
    decay, no_decay = [], []
    for name, p in model.student.named_parameters():
        (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": "weights"},
        {"params": no_decay, "lr": cfg.lr, "weight_decay": 0.0, "name": "weights_no_decay"},
        {"params": list(model.router.parameters()), "lr": cfg.router_lr, "weight_decay": 0.0, "name": "router"},
    ]
    return [g for g in groups if g["params"]]


def deepspeed_config(cfg: DistillConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed engine settings: no accumulation, ZeRO stage and bf16 from the config, clip by norm."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "train_batch_size": cfg.micro_batch_size * world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.bf16},
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@torch.no_grad()
def router_report(
    router: BudgetRouter, budgets: BudgetSet, cfg: DistillConfig, config: HybridConfig, step: int, full: int
) -> dict[str, float]:
    """Noise-free router state per budget: probabilities ``softmax(scale * logits / tau)`` per axis
    (averaged over layers for per-layer choices) and the expected active / total parameters."""
    out: dict[str, float] = {}
    tau, scale = router.tau(step, cfg.steps), router.scale(step, cfg.steps)
    for i, b in enumerate(budgets.budgets):
        logits = router.logits(budgets.one_hot(b.name))
        probs = {axis: torch.softmax(scale * z.float() / tau, dim=-1) for axis, z in logits.items()}
        for axis, p in probs.items():
            row = p.reshape(-1, p.shape[-1]).mean(0)
            for k, v in enumerate(row.tolist()):
                out[f"router/{b.name}/{axis}/p{k}"] = v
        bl = budget_loss(config, cfg.space, probs, b.fraction, i == 0, depth_order=cfg.depth_order, full_active=full)
        out[f"params/{b.name}/expected_active"] = float(bl.expected_active)
        out[f"params/{b.name}/expected_total"] = float(bl.expected_total)
        out[f"params/{b.name}/active_ratio"] = float(bl.ratio)
    return out


def _maybe_fail(cfg: DistillConfig, step: int, rank: int, world: int) -> None:
    """Test hook: the last rank dies at ``fail_at_step`` on the first attempt (a marker file stops it later)."""
    if cfg.fail_at_step is None or step != cfg.fail_at_step or rank != world - 1:
        return
    marker = Path(cfg.output_dir) / ".fail_at_step.marker"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} exited at step {step}\n")
    print(f"[distill] fail_at_step: rank {rank} exits at step {step}", flush=True)
    os._exit(1)


def _fmt_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


# ---------------------------------------------------------------------- the Ray Train loop
def train_loop_per_worker(raw_config: dict[str, Any]) -> None:  # noqa: C901 - one linear training loop
    """Entry point of every Ray Train worker (``train_loop_config`` is the dumped :class:`DistillConfig`)."""
    import ray.train
    import ray.train.torch

    cfg = DistillConfig.model_validate(raw_config)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device() if cfg.use_gpu else torch.device("cpu")

    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cfg.use_gpu else "gloo")

    from components.storage import materialize
    from components.tracking import NullTracker, tracker_for_worker

    teacher_dir = materialize(cfg.teacher_uri)
    tokenizer = CharTokenizer.load(teacher_dir)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    teacher = HybridLM.from_pretrained(teacher_dir).requires_grad_(False).eval().to(device=device, dtype=dtype)
    model_config = teacher.config
    budgets = cfg.budget_set
    full_active = count_params(model_config).active

    init_dir = materialize(cfg.init_from) if cfg.init_from else teacher_dir
    student = HybridLM.from_pretrained(init_dir)
    router = BudgetRouter(model_config, cfg.space, budgets, cfg.router)
    if cfg.init_from:
        router.load_state_dict(load_file(str(Path(init_dir) / ckpt.ROUTER_FILE)))
    model = ElasticStudent(student, router, cfg.depth_order)

    state = ckpt.TrainState(world_size=world, zero_stage=cfg.zero_stage, phase=cfg.phase)
    restored: ckpt.Restored | None = None
    resume = ray.train.get_checkpoint()  # the latest checkpoint after a worker-group restart, else None
    if resume is not None:
        with resume.as_directory() as folder:
            restored = ckpt.read_checkpoint(Path(folder), rank)
        state = restored.state.model_copy(update={"attempt": restored.state.attempt + 1})
        model.student.load_state_dict(restored.student)
        model.router.load_state_dict(restored.router)

    model.to(device)
    base_groups = param_groups(model, cfg)
    base_lrs = [g["lr"] for g in base_groups]
    optimizer = torch.optim.AdamW(base_groups, betas=(0.9, 0.95))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, world))
    if restored is not None:
        ckpt.restore_optimizer(engine.optimizer, restored, rank, world, cfg.zero_stage)
        restored = None  # drop the in-memory copies
    state.world_size, state.zero_stage = world, cfg.zero_stage

    tracker = tracker_for_worker(cfg.tracking_uri, cfg.run_id, cfg.experiment) if rank == 0 else NullTracker()
    if rank == 0 and state.attempt == 0:
        tracker.log_params({"distill": cfg.model_dump(mode="json"), "world_size": world, "full_active": full_active})
    if rank == 0 and state.attempt > 0:
        tracker.log_metrics({"resume/from_step": state.next_step, "resume/attempt": state.attempt}, state.next_step)
        print(f"[distill p{cfg.phase}] attempt {state.attempt}: resumed at step {state.next_step}", flush=True)

    stream_seed = derive_seed("distill", cfg.seed, cfg.phase)
    excluded = cfg.excluded_prompts()  # the evaluate stage's held-out problems are never trained on
    probs = cfg.sampling_probs
    n_b = len(budgets)
    acc = torch.zeros(n_b, 3, dtype=torch.float64)  # per budget since the last log: sum kd, sum budget loss, count
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * world
    start_step, loop_start = state.next_step, time.perf_counter()
    seconds_before = state.train_seconds

    def save_and_report(metrics: dict[str, float], commit: bool) -> None:
        with ckpt.gathered(engine.module, cfg.zero_stage), tempfile.TemporaryDirectory() as tmp:
            student_sd = ckpt.cpu_state(engine.module.student) if rank == 0 else None
            router_sd = ckpt.cpu_state(engine.module.router) if rank == 0 else None
            ckpt.save_checkpoint(Path(tmp), rank, state, student_sd, router_sd, engine.optimizer)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"step_{state.next_step:08d}")
        if commit:
            # Ray Train registers a checkpoint only when its controller polls the report (every ~2 s) from
            # EVERY rank; a rank that dies before that poll loses the checkpoint, and the restart falls
            # back to an older one. Each rank's report queue holds one entry, so this second report
            # returns only once the first has been taken: after it, the checkpoint is registered.
            ray.train.report({**metrics, "committed": 1.0})

    last = {"loss": float("nan")}
    for step in range(start_step, cfg.steps):
        _maybe_fail(cfg, step, rank, world)
        factor = lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        for group, base in zip(engine.optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * factor
        b_idx = draw_budget(cfg.seed, cfg.phase, step, probs)
        batch = make_batch(
            cfg.data, tokenizer, cfg.micro_batch_size, cfg.seq_len, stream_seed, step * world + rank,
            pack=cfg.packed, exclude=excluded,
        ).to(device)  # fmt: skip
        loss, kd, bl, sample = elastic_loss(
            engine, teacher, batch.input_ids, batch.loss_mask, budgets, b_idx, step, cfg.steps,
            router_generator(cfg.seed, cfg.phase, step), cfg.alpha, full_active, cfg.space, cfg.depth_order,
            cfg.dead_zone,
        )  # fmt: skip
        engine.backward(loss)
        engine.step()
        acc[b_idx] += torch.tensor([kd.item(), bl.loss.item(), 1.0], dtype=torch.float64)
        state.next_step = step + 1
        state.tokens_seen += tokens_per_step
        state.train_seconds = seconds_before + time.perf_counter() - loop_start

        done = state.next_step
        if done % cfg.log_every == 0 or done == cfg.steps:
            reduced = acc.to(device)  # NCCL reduces device tensors only
            dist.all_reduce(reduced)  # sums over ranks; counts are identical on every rank
            acc.copy_(reduced.cpu())
            with ckpt.gathered(engine.module.router, cfg.zero_stage):
                routed = router_report(engine.module.router, budgets, cfg, model_config, step, full_active)
            count = acc[:, 2].clamp_min(1.0)
            n_steps = acc[:, 2].sum().item() / world
            elapsed = time.perf_counter() - loop_start
            rate = tokens_per_step * (done - start_step) / max(elapsed, 1e-9)
            row: dict[str, float] = {
                "kd": acc[:, 0].sum().item() / max(n_steps * world, 1.0),
                "budget_loss": acc[:, 1].sum().item() / max(n_steps * world, 1.0),
                "tau": sample.tau,
                "scale": sample.scale,
                "lr": base_lrs[0] * factor,
                "router_lr": base_lrs[-1] * factor,
                "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                "tokens_per_s": rate,
                "tokens_seen": float(state.tokens_seen),
                "attempt": float(state.attempt),
            }
            row["loss"] = row["kd"] + cfg.alpha * row["budget_loss"]
            for i, b in enumerate(budgets.budgets):
                if acc[i, 2] > 0:
                    row[f"kd/{b.name}"] = acc[i, 0].item() / count[i].item()
                    row[f"budget_loss/{b.name}"] = acc[i, 1].item() / count[i].item()
            acc.zero_()
            last = row
            if rank == 0:
                tracker.log_metrics({**row, **routed}, step=done)
                state.history.append({"step": done, **row})
                eta = (cfg.steps - done) * elapsed / max(done - start_step, 1)
                print(
                    f"[distill p{cfg.phase}] step {done}/{cfg.steps} loss {row['loss']:.4f} kd {row['kd']:.4f} "
                    f"budget {row['budget_loss']:.4f} tok/s {rate:,.0f} eta {_fmt_eta(eta)}",
                    flush=True,
                )
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            row = {"step": float(done), "loss": last["loss"], "attempt": float(state.attempt)}
            save_and_report(row, commit=done < cfg.steps)  # the final report is drained before fit() returns

    if start_step >= cfg.steps:  # restored from a finished run: report the final state again
        save_and_report({"step": float(state.next_step), "loss": last["loss"], "attempt": float(state.attempt)}, False)
