"""The Ray Train worker of elastic distillation: one data-parallel rank of a DeepSpeed engine.

One step is ``grad_accum_steps`` micro-batches, then one update. Per micro-batch ``m``:

1. draw the budget from a generator seeded by ``(seed, phase, step, m)`` (same draw on every rank, so
   one update mixes budgets as the method's per-micro-batch draw does);
2. build this rank's shard of the step's global batch: ``make_data_batch`` at ``(seed, phase, step, rank)``
   (the data mixture rendered through the teacher's chat template);
3. teacher forward (frozen permuted parent, no grad) -> its final hidden states (batch, seq, hidden);
4. engine forward of :class:`ElasticStudent`: router sample for the budget one-hot (Gumbel noise
   from a generator seeded by ``(seed, phase, step, m, rank)``: each rank its own, as in the
   method; the rare hard-sample coin is shared by every rank) at the router schedule's GLOBAL step
   (:meth:`RouterConfig.schedule_at`: phase 2 continues phase 1's anneal) -> ``soft_mask`` ->
   masked student forward;
5. the KD loss (forward KL on target tokens) from both models' hidden states and ``lm_head`` weights, chunk by
   chunk over the tokens (:func:`~model.elastic.kd_chunked.chunked_kd_loss`; no (tokens x vocabulary)
   float32 tensor), ``+ alpha * budget_loss``; DeepSpeed backward (scaled
   by ``1 / grad_accum_steps``). After the last micro-batch: grad clip and AdamW step with two
   learning rates (weights, router ~100x), warmup + cosine.

Design choices:

* The module DeepSpeed wraps holds the student AND the router, and the router runs inside its
  ``forward``: under ZeRO-3 DeepSpeed only gathers parameters of modules called through the
  engine, and both sets of parameters then share one optimizer, one clip and one reduction.
* DeepSpeed is imported inside the worker (it is heavy and probes the accelerator at import), its
  shared-memory comm op is marked incompatible before ``initialize`` (otherwise it is compiled on
  first use, ~2 min on a CPU), and the client optimizer is torch's AdamW: DeepSpeed's fused and
  CPU Adam are C++ extensions compiled on first use.
* ZeRO-3 partitions everything a rank would otherwise hold whole: the student is built under
  ``zero.Init`` and each rank loads only its slices of the checkpoint (:mod:`.zero3`); the frozen teacher
  is its own ZeRO-3 engine without an optimizer (DeepSpeed gathers one layer at a time for its forward,
  the design DeepSpeed's own RLHF recipes use for frozen reference models). Below ZeRO-3 the teacher is
  replicated like the student's weights. The student's ``lm_head`` is used by the loss, not called as a
  module, so it is registered as an external parameter of the trained module (DeepSpeed then gathers it
  for that module's forward and backward); the teacher's is gathered around the loss only.
* A CPU worker at ZeRO-3 first pins glibc's mmap threshold (:func:`configure_host_memory`, :mod:`.heap`) and
  gathers each parameter straight into its own buffer (:func:`.zero3.per_parameter_gathers`): otherwise glibc keeps
  the freed gathered layers resident and the resident peak loses most of what partitioning saves. GPU
  workers leave the host heap and DeepSpeed's gathers as they are.
* The loop reads top to bottom: :func:`start_run` (process group, models, engine, resume, tracker), then per
  step :func:`train_step`, :func:`log_row` and :func:`save_and_report`. What they share is one frozen
  :class:`WorkerRun`; what stays the same for the loss over the run (model config, space, budgets, depth
  order, dead zone, parameter counts) is one frozen :class:`~components.distill.step.ElasticSpec`, and the
  loss itself (:func:`~components.distill.step.elastic_loss`) needs neither Ray nor DeepSpeed (:mod:`.step`).
* The loop holds no test code: ``step_callback`` (an import path in the config) is the one way into it.
* Every rank calls ``ray.train.report`` at the same steps (it is a barrier), each with its own
  checkpoint folder: its shard written by DeepSpeed's ``save_checkpoint`` (rank 0 adds the state); Ray
  merges the folders (:mod:`.ckpt`). A restart reads only this rank's files.
  Reports happen only at checkpoint steps: each one costs a second or two. A checkpoint report is
  followed by a metrics-only report that returns once Ray has registered the checkpoint (see
  ``save_and_report``), so a crash right after a checkpoint resumes from it, not from the one before.
* The step counter is the whole data position: batch, budget draw and router noise of step ``s``
  are functions of ``(seed, phase, s)`` (and the micro-batch and rank), so a resumed run sees
  exactly what it would have seen. Micro-batch ``m`` of step ``s`` reads data step
  ``s * grad_accum_steps + m``; without accumulation every draw is what it was before it existed.
* Rank 0 alone talks to MLflow. Losses are averaged over ranks (one small all-reduce per logged
  step) so the logged KD loss is the global one, not rank 0's shard.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import Tensor, nn

from components.data import TextTokenizer, derive_seed, make_data_batch
from components.distill import ckpt, heap, zero3
from components.distill.config import DistillConfig, resolve_step_callback
from components.distill.draws import draw_budget, draw_hard_sample, lr_factor, router_generator
from components.distill.step import ElasticSpec, ElasticStudent, elastic_loss, router_report
from components.progress import progress_bar
from model.checkpoint import read_config
from model.config import HybridConfig
from model.elastic.router import BudgetRouter, RouterSample
from model.hybrid import HybridLM

if TYPE_CHECKING:
    from components.tracking import Tracker


# ---------------------------------------------------------------------- the engine and its models
def param_groups(model: ElasticStudent, cfg: DistillConfig) -> list[dict[str, Any]]:
    """AdamW groups: decayed student matrices, undecayed student vectors/norms, router (router_lr, no decay)."""
    decay, no_decay = [], []
    for name, p in model.student.named_parameters():
        ndim = len(p.ds_shape) if zero3.is_partitioned(p) else p.ndim  # a ZeRO-3 parameter's data is a 1-D stub
        (decay if ndim >= 2 and "norm" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": "weights"},
        {"params": no_decay, "lr": cfg.lr, "weight_decay": 0.0, "name": "weights_no_decay"},
        {"params": list(model.router.parameters()), "lr": cfg.router_lr, "weight_decay": 0.0, "name": "router"},
    ]
    return [g for g in groups if g["params"]]


def deepspeed_config(cfg: DistillConfig, world_size: int, model_config: HybridConfig | None = None) -> dict[str, Any]:
    """DeepSpeed engine settings: ``grad_accum_steps`` micro-batches per update, ZeRO stage and bf16 from the config,
    clip by norm. At ZeRO-3 with ``model_config``, buckets of one layer (:func:`zero3.zero3_settings`), gathered
    per parameter or coalesced (:func:`zero3.per_parameter_gathers`)."""
    zero = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3 and model_config is not None:
        per_parameter = zero3.per_parameter_gathers(cfg.zero3_gathers, cfg.use_gpu)
        zero = zero3.zero3_settings(model_config, per_parameter=per_parameter)
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "train_batch_size": cfg.micro_batch_size * world_size * cfg.grad_accum_steps,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.bf16},
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def configure_host_memory(cfg: DistillConfig) -> dict[str, bool]:
    """Apply this worker's glibc heap settings to its own process (:func:`heap.policy_for`: ``cfg.host_heap``, or
    by default, on a CPU at ZeRO-3, freed gathered layers returned to the system; nothing on a GPU, whose tensors
    live in the CUDA caching allocator). Returns the settings that took effect. Call it before the models are
    built: a threshold governs only the blocks allocated after it is set."""
    return heap.apply(heap.policy_for(cfg.host_heap, cfg.zero_stage, cfg.use_gpu))


def training_dtype(cfg: DistillConfig) -> torch.dtype:
    """bfloat16 when ``cfg.bf16``, else float32: the dtype of the weights, the teacher and the phase output."""
    return torch.bfloat16 if cfg.bf16 else torch.float32


def build_teacher(
    cfg: DistillConfig, teacher_dir: Path, model_config: HybridConfig, device: torch.device, world_size: int
) -> nn.Module:
    """The frozen teacher in the training dtype. ZeRO-3: partitioned as it is built and run as its own ZeRO-3
    engine without an optimizer (a rank holds ``1 / world_size`` of it plus the layers being computed);
    below ZeRO-3 every rank holds it whole (the student's weights are replicated there too)."""
    dtype = training_dtype(cfg)
    if cfg.zero_stage < 3:
        return HybridLM.from_pretrained(teacher_dir, dtype=dtype).requires_grad_(False).eval().to(device)
    ds = deepspeed_config(cfg, world_size, model_config)
    return zero3.teacher_engine(zero3.load_hybrid(teacher_dir, model_config, dtype, ds), ds)


def build_student(
    cfg: DistillConfig, model_config: HybridConfig, init_dir: Path, device: torch.device, world_size: int
) -> ElasticStudent:
    """The trained module from ``init_dir`` (the teacher in phase 1, phase 1's output in phase 2), in the training
    dtype. ZeRO-3: the student is built under ``zero.Init`` and each rank loads its slices (no rank holds it
    whole), and its ``lm_head`` is registered with the module that uses it in the loss; the small router is
    built whole and partitioned by ``deepspeed.initialize``."""
    dtype = training_dtype(cfg)
    ds = deepspeed_config(cfg, world_size, model_config) if cfg.zero_stage == 3 else None
    student = zero3.load_hybrid(init_dir, model_config, dtype, ds)
    student.gradient_checkpointing = cfg.activation_checkpointing
    if ds is None:
        student.to(device)
    router = BudgetRouter(model_config, cfg.space, cfg.budget_set, cfg.router)
    if cfg.init_from:
        router.load_state_dict(load_file(str(Path(init_dir) / ckpt.ROUTER_FILE)))
    model = ElasticStudent(student, router.to(device=device, dtype=dtype), cfg.depth_order)
    if ds is not None:
        import deepspeed

        deepspeed.zero.register_external_parameter(model, student.lm_head.weight)
    return model


def build_engine(
    cfg: DistillConfig, model: ElasticStudent, world_size: int, model_config: HybridConfig
) -> tuple[Any, list[float]]:
    """(DeepSpeed engine around ``model`` with torch AdamW over :func:`param_groups`, the groups' peak lrs).
    The engine loads checkpoints without pickles (:func:`ckpt.install_safe_loader`)."""
    import deepspeed

    groups = param_groups(model, cfg)
    base_lrs = [g["lr"] for g in groups]
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    ds = deepspeed_config(cfg, world_size, model_config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    zero3.share_fp32_master(engine)  # float32 ZeRO-3: no second copy of the weight partitions
    ckpt.install_safe_loader(engine)
    heap.trim()  # the copies made while building and loading are freed; give them back
    return engine, base_lrs


def memory_peaks(device: torch.device, host_baseline: int) -> dict[str, float]:
    """Largest over ranks, GB: the host's resident peak above ``host_baseline`` and the accelerator's allocated
    peak (0 on CPU), for comparing a run with ``star-elastic plan``. One small all-reduce: call on every rank."""
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    peaks = torch.tensor([heap.resident_peak_bytes() - host_baseline, device_peak], dtype=torch.float64)
    peaks = peaks.to(device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {"memory/host_peak_gb": peaks[0].item() / 1e9, "memory/device_peak_gb": peaks[1].item() / 1e9}


# ---------------------------------------------------------------------- the Ray Train loop
@dataclass(frozen=True)
class WorkerRun:
    """One rank's training run as :func:`start_run` sets it up: what the step, log and checkpoint functions share.
    Only ``state`` changes as the run goes (it is what a checkpoint saves)."""

    cfg: DistillConfig
    spec: ElasticSpec
    engine: Any
    """The DeepSpeed engine around the :class:`ElasticStudent`."""
    teacher: nn.Module
    """The frozen teacher (its own ZeRO-3 engine at ZeRO-3)."""
    tokenizer: TextTokenizer
    tracker: Tracker
    """Rank 0's MLflow run; a null tracker on the other ranks."""
    state: ckpt.TrainState
    """Next step, tokens seen, training seconds, logged rows: updated in place every step."""
    base_lrs: list[float]
    """Peak learning rate of each optimizer group (the schedule scales them)."""
    rank: int
    world: int
    device: torch.device
    host_baseline: int
    """Resident bytes before the models were built (the memory peaks are reported above it)."""
    stream_seed: int
    """Seed of this phase's data stream."""
    excluded: set[str] | None
    """The evaluate stage's held-out prompts, never trained on."""
    start_step: int
    """The step this attempt starts at (0, or where the checkpoint it resumed from ended)."""
    loop_start: float
    """``time.perf_counter()`` when this attempt's steps began."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over every rank and micro-batch."""
        return self.cfg.micro_batch_size * self.cfg.seq_len * self.world * self.cfg.grad_accum_steps


@dataclass
class Window:
    """What this rank gathered since the last log row (``sums``) and since its attempt started (rows cut)."""

    sums: Tensor
    """(n_budgets, 3) float64, per budget: summed KD loss, summed budget loss, micro-batches."""
    truncated: int = 0
    """Overlong rows truncated since the attempt started."""
    dropped: int = 0
    """Overlong rows dropped since the attempt started."""
    last_loss: float = float("nan")
    """The loss of the latest log row (what a checkpoint report carries)."""


def resume_state(cfg: DistillConfig, engine: Any, rank: int, world: int) -> ckpt.TrainState:
    """A fresh train state, or after a worker-group restart the latest checkpoint's (attempt counted up), with
    this rank's shard (weights, float32 master weights, optimizer moments) loaded into ``engine``."""
    import ray.train

    resume = ray.train.get_checkpoint()  # the latest checkpoint after a worker-group restart, else None
    if resume is None:
        return ckpt.TrainState(world_size=world, zero_stage=cfg.zero_stage, phase=cfg.phase)
    with ckpt.fetch(resume, lambda relative: ckpt.rank_needs(relative, rank)) as folder:
        saved = ckpt.load_checkpoint(engine, folder, world, cfg.zero_stage)
    return saved.model_copy(update={"attempt": saved.attempt + 1})


def start_run(cfg: DistillConfig) -> WorkerRun:
    """This rank's process group, teacher, engine (resumed from Ray Train's latest checkpoint if any) and tracker;
    rank 0 logs the config on a first attempt, the resume point on a later one."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device() if cfg.use_gpu else torch.device("cpu")

    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cfg.use_gpu else "gloo")
    host_baseline = heap.restart_resident_peak()  # after imports and process-group setup: the run adds the rest

    from components.storage import materialize
    from components.tracking import NullTracker, tracker_for_worker

    teacher_dir = materialize(cfg.teacher_uri)
    tokenizer = TextTokenizer.load(teacher_dir, cfg.markers)
    model_config = read_config(teacher_dir)[0]
    spec = ElasticSpec.from_config(cfg, model_config)
    teacher = build_teacher(cfg, teacher_dir, model_config, device, world)
    init_dir = materialize(cfg.init_from) if cfg.init_from else teacher_dir
    engine, base_lrs = build_engine(cfg, build_student(cfg, model_config, init_dir, device, world), world, model_config)
    state = resume_state(cfg, engine, rank, world)

    tracker = tracker_for_worker(cfg.tracking_uri, cfg.run_id, cfg.experiment) if rank == 0 else NullTracker()
    if rank == 0 and state.attempt == 0:
        tracker.log_params(
            {"distill": cfg.model_dump(mode="json"), "world_size": world, "full_active": spec.full_active}
        )
    if rank == 0 and state.attempt > 0:
        tracker.log_metrics({"resume/from_step": state.next_step, "resume/attempt": state.attempt}, state.next_step)
        print(f"[distill p{cfg.phase}] attempt {state.attempt}: resumed at step {state.next_step}", flush=True)
    stream_seed = derive_seed("distill", cfg.seed, cfg.phase)
    excluded = cfg.excluded_prompts()  # the evaluate stage's held-out problems are never trained on
    return WorkerRun(
        cfg, spec, engine, teacher, tokenizer, tracker, state, base_lrs, rank, world, device, host_baseline,
        stream_seed, excluded, start_step=state.next_step, loop_start=time.perf_counter(),
    )  # fmt: skip


def train_step(run: WorkerRun, step: int, window: Window) -> tuple[float, RouterSample]:
    """Optimizer step ``step``: the scheduled learning rates, then ``grad_accum_steps`` micro-batches, each with
    its own budget draw (an update mixes budgets), DeepSpeed updating at the last one. Adds every micro-batch's
    losses to ``window``; returns the step's lr factor and the last micro-batch's router sample."""
    cfg, accum = run.cfg, run.cfg.grad_accum_steps
    factor = lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
    for group, base in zip(run.engine.optimizer.param_groups, run.base_lrs, strict=True):
        group["lr"] = base * factor
    schedule = cfg.router.schedule_at(step, cfg.steps)  # the router schedule spans both phases
    for micro in range(accum):
        b_idx = draw_budget(cfg.seed, cfg.phase, step, cfg.sampling_probs, micro)
        batch = make_data_batch(
            cfg.data, run.tokenizer, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=run.stream_seed,
            phase=f"distill{cfg.phase}", step=step * accum + micro, rank=run.rank, world=run.world,
            exclude=run.excluded,
        )  # fmt: skip
        window.truncated += batch.n_truncated
        window.dropped += batch.n_dropped
        batch = batch.to(run.device)
        loss, kd, bl, sample = elastic_loss(
            run.engine, run.teacher, run.spec, batch.input_ids, batch.loss_mask, b_idx, schedule,
            router_generator(cfg.seed, cfg.phase, step, micro, run.rank),
            draw_hard_sample(cfg.seed, cfg.phase, step, micro, cfg.router.hard_sample_prob),
        )  # fmt: skip
        run.engine.backward(loss)  # scaled by 1 / accum; the update happens at the last micro-batch
        run.engine.step()
        window.sums[b_idx] += torch.tensor([kd.item(), bl.loss.item(), 1.0], dtype=torch.float64)
    return factor, sample


def log_row(run: WorkerRun, window: Window, step: int, factor: float, sample: RouterSample) -> dict[str, float]:
    """The metrics of the steps since the last row, ending with step ``step``: KD and budget losses averaged over
    every rank's micro-batches (one all-reduce; per budget too), the router's report, learning rates, rate and
    memory peaks. Rank 0 logs them and keeps the row in the train state's history. Call on every rank."""
    cfg, acc, world, done = run.cfg, window.sums, run.world, run.state.next_step
    reduced = acc.to(run.device)  # NCCL reduces device tensors only
    dist.all_reduce(reduced)  # sums over ranks; counts are identical on every rank
    acc.copy_(reduced.cpu())
    router = run.engine.module.router
    with zero3.gathered(router.parameters()):
        routed = router_report(router, run.spec, cfg.router.schedule_at(step, cfg.steps))
    count = acc[:, 2].clamp_min(1.0)
    n_steps = acc[:, 2].sum().item() / world
    elapsed = time.perf_counter() - run.loop_start
    row: dict[str, float] = {
        "kd": acc[:, 0].sum().item() / max(n_steps * world, 1.0),
        "budget_loss": acc[:, 1].sum().item() / max(n_steps * world, 1.0),
        "tau": sample.tau,
        "scale": sample.scale,
        "lr": run.base_lrs[0] * factor,
        "router_lr": run.base_lrs[-1] * factor,
        "grad_norm": float(run.engine.get_global_grad_norm() or 0.0),
        "tokens_per_s": run.tokens_per_step * (done - run.start_step) / max(elapsed, 1e-9),
        "tokens_seen": float(run.state.tokens_seen),
        "attempt": float(run.state.attempt),
        "data/truncated_rows_rank0": float(window.truncated),
        "data/dropped_rows_rank0": float(window.dropped),
    }
    row["loss"] = row["kd"] + run.spec.alpha * row["budget_loss"]
    row.update(memory_peaks(run.device, run.host_baseline))
    for i, b in enumerate(run.spec.budgets.budgets):
        if acc[i, 2] > 0:
            row[f"kd/{b.name}"] = acc[i, 0].item() / count[i].item()
            row[f"budget_loss/{b.name}"] = acc[i, 1].item() / count[i].item()
    acc.zero_()
    window.last_loss = row["loss"]
    if run.rank == 0:
        run.tracker.log_metrics({**row, **routed}, step=done)
        run.state.history.append({"step": done, **row})
    return row


def save_and_report(run: WorkerRun, window: Window, commit: bool) -> None:
    """Checkpoint this rank's shard (DeepSpeed's files; rank 0 adds the train state) and report it to Ray Train
    with the step, the latest logged loss and the attempt. Every rank calls it at the same steps (a barrier).

    ``commit``: then report once more: Ray Train registers a checkpoint only when its controller polls the
    report (every ~2 s) from EVERY rank; a rank that dies before that poll loses the checkpoint, and the restart
    falls back to an older one. Each rank's report queue holds one entry, so this second report returns only
    once the first has been taken: after it, the checkpoint is registered.
    """
    import ray.train

    state = run.state
    metrics = {"step": float(state.next_step), "loss": window.last_loss, "attempt": float(state.attempt)}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt.save_checkpoint(run.engine, Path(tmp), run.rank, state)  # every rank its own shard; nothing gathered
        checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"step_{state.next_step:08d}")
    if commit:
        ray.train.report({**metrics, "committed": 1.0})


def train_loop_per_worker(raw_config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker (``train_loop_config`` is the dumped :class:`DistillConfig`):
    :func:`start_run`, then every step :func:`train_step`, every ``log_every`` steps :func:`log_row` and every
    ``checkpoint_every`` steps :func:`save_and_report` (both at the last step too)."""
    import logging

    logging.getLogger().setLevel(logging.WARNING)  # Ray Train's INFO report lines would repeat on every rank

    cfg = DistillConfig.model_validate(raw_config)
    configure_host_memory(cfg)
    step_callback = resolve_step_callback(cfg.step_callback)
    run = start_run(cfg)
    state, seconds_before = run.state, run.state.train_seconds
    window = Window(torch.zeros(len(run.spec.budgets), 3, dtype=torch.float64))
    bar = progress_bar(cfg.steps, f"distill p{cfg.phase}", unit="step", disable=run.rank != 0, initial=run.start_step)
    for step in range(run.start_step, cfg.steps):
        if step_callback is not None:
            step_callback(cfg, step, run.rank, run.world)
        factor, sample = train_step(run, step, window)
        state.next_step = done = step + 1
        bar.update(1)
        state.tokens_seen += run.tokens_per_step
        state.train_seconds = seconds_before + time.perf_counter() - run.loop_start
        if done % cfg.log_every == 0 or done == cfg.steps:
            row = log_row(run, window, step, factor, sample)
            if run.rank == 0:
                shown = {"loss": row["loss"], "kd": row["kd"], "budget": row["budget_loss"]}
                bar.set_postfix({**{k: f"{v:.4f}" for k, v in shown.items()}, "tok/s": f"{row['tokens_per_s']:,.0f}"})
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            save_and_report(run, window, commit=done < cfg.steps)  # the final report is drained before fit() returns
    bar.close()

    if run.start_step >= cfg.steps:  # restored from a finished run: report the final state again
        save_and_report(run, window, commit=False)
