"""The rank stage: calibrate the parent, rank every elastic axis, and write the permuted parent.

Flow: check the calibration data against the parent's tokenizer and ``config.json`` -> calibration as
Ray tasks, each over its share of the batches -> sum the additive accumulators on the driver -> one
Ray task with ``resources`` (:func:`rank_and_permute`): load the parent, (optionally) greedy depth
ranking, rankings, permute, check against the parent on a few rows, save the checkpoint and
``rankings.json`` -> the plot and the log on the driver. The driver never builds a model. Only batch
indices travel to a calibration task (batches are rebuilt from ``(seed, index)``); the result does
not depend on how the work was split.

Design notes: docs/stages.md ("The rank stage").
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from components.data import (
    DataConfig,
    GeneratorSource,
    ReasoningMarkers,
    TextTokenizer,
    held_out_prompts,
    make_data_batch,
)
from components.data.checks import check_data
from components.progress import Bar, progress_bar
from components.stage_task import TaskInfo, TaskResources, check_feasible, ray_runtime, run_task
from components.tracking import Tracker
from model.elastic.importance import AXES, ImportanceAccumulator, Rankings, calibrate, rankings_from_accumulator

RANKINGS_FILE = "rankings.json"
PLOT_FILE = "importance.png"


class CalibrationConfig(BaseModel):
    """Which calibration data the parent is run on."""

    model_config = ConfigDict(extra="forbid")

    num_samples: int = Field(256, ge=1, description="Calibration sequences (rows); rounded up to whole batches.")
    seq_len: int = Field(128, ge=8, description="Tokens per calibration sequence.")
    batch_size: int = Field(16, ge=1, description="Sequences per forward pass.")
    seed: int = Field(1234, description="Seed of the calibration data stream (keep it apart from training seeds).")
    data: DataConfig = Field(
        default_factory=lambda: DataConfig(pack=True),
        description="Calibration data: the same mixture format as distillation (files, the built-in generator, "
        "reasoning-gym), rendered with the parent's tokenizer; pack it so padding never dilutes the statistics.",
    )
    markers: ReasoningMarkers = Field(
        default_factory=ReasoningMarkers, description="Reasoning markers of the parent's tokenizer."
    )
    exclude_eval_levels: list[int] = Field(
        default_factory=lambda: [1, 2, 3, 4, 5, 6], description="Held-out eval levels whose prompts are excluded."
    )
    exclude_eval_per_level: int = Field(50, ge=0, description="Held-out problems per level to exclude (0: none).")
    exclude_eval_seed: int = Field(0, description="Seed of the held-out eval sets to exclude.")

    @property
    def num_batches(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)


class RankConfig(BaseModel):
    """Settings of the rank stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # resolved once, then only read

    parent_uri: str = Field(description="Parent checkpoint folder (nemotron_h safetensors + tokenizer files).")
    output_dir: str = Field(description="Folder for the permuted checkpoint, rankings.json and the plot.")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig, description="Calibration data.")
    axes: list[str] = Field(default_factory=lambda: list(AXES), description=f"Axes to rank, from {list(AXES)}.")
    depth: bool = Field(False, description="Also rank layers for depth (greedy, O(layers^2) forwards).")
    depth_batches: int = Field(4, ge=1, description="Calibration batches used by the depth ranking.")
    expert_score: Literal["reap", "frequency", "reap_sum"] = Field(
        "reap", description="Expert order: REAP (default), routing frequency, or REAP x frequency."
    )
    num_tasks: int = Field(2, ge=1, description="Ray tasks the calibration batches are split over.")
    cpus_per_task: int = Field(1, ge=1, description="CPUs (and torch threads) per calibration task.")
    gpus_per_task: float = Field(0.0, ge=0, description="GPUs per calibration task (0: run on CPU).")
    resources: TaskResources = Field(
        default_factory=TaskResources,
        description="What Ray reserves for the one task that loads the parent, ranks depth, permutes, checks and "
        "saves it (the calibration tasks have their own fields above). With a GPU the task works on cuda; host "
        "memory must hold the parent's weights while they are read and again while the permuted copy is written.",
    )
    progress: bool = Field(True, description="Print progress lines (rate and ETA).")

    @field_validator("axes")
    @classmethod
    def _known_axes(cls, axes: list[str]) -> list[str]:
        unknown = sorted(set(axes) - set(AXES))
        if unknown:
            raise ValueError(f"unknown axes {unknown}; choose from {list(AXES)} (depth is the 'depth' flag)")
        return axes


class RankOutputs(BaseModel):
    """What the stage produced (local paths) and its metrics."""

    permuted_uri: str
    rankings_uri: str
    plot_uri: str
    metrics: dict[str, float]
    task: TaskInfo | None = Field(None, description="Where the permutation task ran (None: not run as a task).")


# ---------------------------------------------------------------------- calibration data
def _exclude(cal: CalibrationConfig) -> set[str] | None:
    """Held-out prompts of every generator source's evaluation levels (never calibrated on)."""
    out: set[str] = set()
    for source in cal.data.sources:
        if isinstance(source, GeneratorSource):
            levels, n, seed = cal.exclude_eval_levels, cal.exclude_eval_per_level, cal.exclude_eval_seed
            out |= held_out_prompts(levels, n, seed, source.problem_config()) or set()
    return out or None


def calibration_batch(cal: CalibrationConfig, tok: TextTokenizer, index: int, exclude: set[str] | None) -> torch.Tensor:
    """Input ids (batch_size, seq_len) of calibration batch ``index``."""
    return make_data_batch(
        cal.data, tok, batch_size=cal.batch_size, seq_len=cal.seq_len, seed=cal.seed, phase="rank", step=index,
        exclude=exclude,
    ).input_ids  # fmt: skip


def calibrate_share(
    parent_uri: str,
    cal: dict[str, Any],
    indices: list[int],
    axes: list[str],
    threads: int,
    device: str,
    tag: str,
    progress: bool = True,
) -> dict[str, Any]:
    """One Ray task: calibrate the parent on batches ``indices``; returns an accumulator state dict."""
    from components.storage import materialize
    from model.hybrid import HybridLM

    torch.set_num_threads(threads)
    cfg = CalibrationConfig.model_validate(cal)
    folder = materialize(parent_uri)
    tok = TextTokenizer.load(folder, cfg.markers)
    model = HybridLM.from_pretrained(folder).to(device)
    exclude = _exclude(cfg)
    acc = ImportanceAccumulator()
    bar = progress_bar(len(indices), f"rank calibration, {tag}", unit="batch", disable=not progress)
    for index in indices:
        calibrate(model, [calibration_batch(cfg, tok, index, exclude)], axes, progress=False, acc=acc)
        bar.update(1)
    bar.close()
    return acc.state_dict()


def _run_calibration(config: RankConfig) -> ImportanceAccumulator:
    """Deal the batches to ``num_tasks`` Ray tasks and sum their accumulators (the first task shows progress)."""
    import ray

    cal = config.calibration
    indices = list(range(cal.num_batches))
    n_tasks = min(config.num_tasks, len(indices))
    shares = [indices[t::n_tasks] for t in range(n_tasks)]
    device = "cuda" if config.gpus_per_task > 0 else "cpu"
    task = ray.remote(calibrate_share).options(num_cpus=config.cpus_per_task, num_gpus=config.gpus_per_task)
    args = (config.parent_uri, cal.model_dump(), list(config.axes), config.cpus_per_task, device)
    # the first task shows progress for all (the shares are equal and run side by side): Ray would fold
    # alike lines from several processes into one
    pending = [
        task.remote(*args[:2], share, *args[2:], tag=f"task {t + 1} of {n_tasks}", progress=config.progress and t == 0)
        for t, share in enumerate(shares)
    ]
    acc = ImportanceAccumulator()
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            acc.merge(ImportanceAccumulator.from_state_dict(ray.get(ref)))
    return acc


# ---------------------------------------------------------------------- the permutation task
def _depth_progress(total: int, desc: str, unit: str) -> Bar:
    """The depth search's progress display (``depth_ranking`` takes any maker of one)."""
    return progress_bar(total, f"rank {desc}", unit)


@torch.no_grad()
def check_permutation(model: Any, ids: torch.Tensor, permute: Callable[[Any], Any]) -> tuple[float, float]:
    """Apply ``permute(model)`` (in place) and compare the logits before and after on ``ids`` (rows, seq).

    One row at a time: a full-vocabulary logits tensor per row (seq x vocab, fp32) instead of the whole
    batch's, so a parent that nearly fills its GPU still has room for the check; the rows before the
    permutation wait on the host. Returns (max |after - before| over every row, position and vocabulary
    entry, max(1, max |before|)).
    """
    device = model.device
    before = [model(row[None].to(device)).logits.float().cpu() for row in ids]
    permute(model)
    diff = 0.0
    for row, ref in zip(ids, before, strict=True):
        after = model(row[None].to(device)).logits.float()
        diff = max(diff, after.sub_(ref.to(after.device)).abs_().max().item())  # in place: no more copies
    scale = max([1.0] + [ref.abs().max().item() for ref in before])
    return diff, scale


def rank_and_permute(config: RankConfig, acc_state: dict[str, Any], device: str) -> dict[str, Any]:
    """The rank stage's model work, run as one Ray task: load the parent on ``device``, rank depth (if
    asked), turn the summed calibration statistics ``acc_state`` into rankings, permute, check the
    permuted parent against the parent, and write ``rankings.json`` and the permuted checkpoint.

    Returns ``{"permuted_uri", "rankings_uri", "rankings": Rankings.to_dict(), "permute_max_abs_logit_diff",
    "depth_seconds"}``; raises ``RuntimeError`` when the permuted parent computes something else.
    """
    from components.storage import materialize
    from model.elastic.depth import depth_ranking
    from model.elastic.permute import apply_rankings
    from model.hybrid import HybridLM
    from model.layout import tokenizer_files

    cal = config.calibration
    parent_dir = materialize(config.parent_uri)
    tok = TextTokenizer.load(parent_dir, cal.markers)
    model = HybridLM.from_pretrained(parent_dir).to(device)
    exclude = _exclude(cal)
    acc = ImportanceAccumulator.from_state_dict(acc_state)

    depth, depth_s = None, 0.0
    if config.depth:
        t_depth = time.perf_counter()
        batches = [calibration_batch(cal, tok, i, exclude) for i in range(min(config.depth_batches, cal.num_batches))]
        depth = depth_ranking(model, batches, progress=_depth_progress if config.progress else False)
        depth_s = time.perf_counter() - t_depth
    rankings = rankings_from_accumulator(acc, model.config, config.axes, config.expert_score, depth)
    if depth is not None:
        rankings.axes.append("depth")

    # the permuted model must compute what the parent did: check on a few rows before saving
    check_ids = calibration_batch(cal, tok, 0, exclude)[:4]
    diff, scale = check_permutation(model, check_ids, lambda m: apply_rankings(m, rankings))
    exact_dtype = model.lm_head.weight.dtype == torch.float32
    if not math.isfinite(diff) or (exact_dtype and diff > 1e-4 * scale):
        raise RuntimeError(f"permuted parent differs from the parent by {diff:.3g} in logits (scale {scale:.3g})")

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)  # on a shared runs volume the driver made it already
    rankings_path = out / RANKINGS_FILE
    rankings_path.write_text(json.dumps(rankings.to_dict(), indent=1) + "\n")
    extra = tokenizer_files(parent_dir)  # tokenizer, chat template and generation config travel on
    extra[RANKINGS_FILE] = rankings_path
    permuted = model.save_pretrained(out / "permuted", extra_files=extra)
    return {
        "permuted_uri": str(permuted.resolve()),
        "rankings_uri": str(rankings_path.resolve()),
        "rankings": rankings.to_dict(),
        "permute_max_abs_logit_diff": diff,
        "depth_seconds": depth_s,
    }


# ---------------------------------------------------------------------- the stage
def run_rank(config: RankConfig, tracker: Tracker) -> RankOutputs:
    """Rank and permute the parent; see the module docstring for the steps and the outputs."""

    t0 = time.perf_counter()
    tracker.log_params(config.model_dump(mode="json"))
    out = Path(config.output_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _rank_into(config, tracker, out, t0)
    except BaseException:
        if created:  # a failed rank (disk full, a dead task) leaves no half-written folder to mistake for one
            shutil.rmtree(out, ignore_errors=True)
        raise


def _rank_into(config: RankConfig, tracker: Tracker, out: Path, t0: float) -> RankOutputs:
    from components.storage import fetch_metadata
    from model.checkpoint import read_config

    parent_dir = fetch_metadata(config.parent_uri)  # config.json and tokenizer: the driver reads no weight
    model_config, _ = read_config(parent_dir)
    cal = config.calibration
    check_data(cal.data, parent_dir, cal.markers, model_config.vocab_size, "rank.calibration.data")

    with ray_runtime(max(config.num_tasks * config.cpus_per_task, config.resources.num_cpus)):
        check_feasible(config.resources, "rank.resources")  # before the calibration, not after it
        t_cal = time.perf_counter()
        acc = _run_calibration(config)
        cal_s = time.perf_counter() - t_cal
        device = "cuda" if config.resources.num_gpus > 0 else "cpu"
        result, task = run_task(
            rank_and_permute, config, acc.state_dict(), device, resources=config.resources, name="rank",
            field="rank.resources", pass_tracker=False, progress=config.progress,
        )  # fmt: skip

    rankings = Rankings.from_dict(result["rankings"])
    rankings_path = Path(result["rankings_uri"])
    plot_path = plot_rankings(rankings, out / PLOT_FILE)
    metrics = {
        "calibration_batches": float(acc.num_batches),
        "calibration_sequences": float(acc.num_sequences),
        "calibration_tokens": float(acc.num_tokens),
        "calibration_seconds": cal_s,
        "calibration_tokens_per_s": acc.num_tokens / cal_s if cal_s > 0 else 0.0,
        "depth_seconds": result["depth_seconds"],
        "permute_max_abs_logit_diff": result["permute_max_abs_logit_diff"],
        "permute_task_seconds": task.seconds,
        "rank_seconds": time.perf_counter() - t0,
    }
    overlap = reap_frequency_overlap(rankings)
    if overlap is not None:
        metrics["experts_top_half_overlap_reap_vs_frequency"] = overlap
    tracker.log_metrics(metrics)
    tracker.log_artifact(rankings_path)
    tracker.log_artifact(plot_path)
    tracker.set_tags({"rank.permuted_uri": result["permuted_uri"], "rank.rankings_uri": str(rankings_path)})
    return RankOutputs(
        permuted_uri=result["permuted_uri"],
        rankings_uri=str(rankings_path),
        plot_uri=str(plot_path.resolve()),
        metrics=metrics,
        task=task,
    )


def reap_frequency_overlap(rankings: Rankings) -> float | None:
    """Mean over MoE layers of |top half by REAP & top half by frequency| / half (1: same experts kept)."""
    values = []
    for lr in rankings.layers:
        if lr.expert_reap is None or lr.expert_frequency is None:
            continue
        half = max(1, len(lr.expert_reap) // 2)
        reap = set(torch.tensor(lr.expert_reap).argsort(descending=True, stable=True)[:half].tolist())
        freq = set(torch.tensor(lr.expert_frequency).argsort(descending=True, stable=True)[:half].tolist())
        values.append(len(reap & freq) / half)
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------- plot
def plot_rankings(rankings: Rankings, path: Path) -> Path:
    """One panel per axis: per layer, the scores in storage order divided by the layer's maximum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, list[tuple[str, list[float], str]]]] = []
    if rankings.hidden is not None:
        panels.append(("hidden", [("all layers", _sorted(rankings.hidden.scores, rankings.hidden.order), "-")]))
    for axis in ("mamba_heads", "attn_heads", "mlp_ffn", "shared_ffn", "moe_ffn", "experts"):
        curves = []
        for i, lr in enumerate(rankings.layers):
            if axis == "moe_ffn" and lr.moe_ffn:
                per_expert = torch.tensor([_sorted(r.scores, r.order) for r in lr.moe_ffn])
                curves.append((f"L{i} (mean of experts)", per_expert.mean(0).tolist(), "-"))
            elif axis == "experts" and lr.experts is not None:
                curves.append((f"L{i} REAP", _sorted(lr.expert_reap or [], lr.experts.order), "-"))
                freq = lr.expert_frequency or []
                order = torch.tensor(freq).argsort(descending=True, stable=True).tolist()
                curves.append((f"L{i} frequency", _sorted(freq, order), "--"))
            elif axis not in ("moe_ffn", "experts") and getattr(lr, axis, None) is not None:
                r = getattr(lr, axis)
                curves.append((f"L{i}", _sorted(r.scores, r.order), "-"))
        if curves:
            panels.append((axis, curves))
    if rankings.depth is not None:
        panels.append(("depth", []))
    cols = min(3, max(1, len(panels)))
    rows = math.ceil(len(panels) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (name, curves) in zip(axes.flat, panels, strict=False):
        if name == "depth" and rankings.depth is not None:
            d = rankings.depth
            ax.bar(range(len(d.single_scores)), d.single_scores, color="tab:gray")
            ax.set_xlabel("layer (label: greedy removal step)")
            ax.set_ylabel("nMSE, layer removed alone")
            for step, layer in enumerate(d.removal_order):
                ax.annotate(str(step), (layer, d.single_scores[layer]), ha="center", va="bottom", fontsize=7)
        else:
            for label, values, style in curves:
                ax.plot(range(len(values)), values, style, label=label, linewidth=1.2)
            grouped = name in ("mamba_heads", "attn_heads")
            ax.set_xlabel("storage position" + (" (sorted inside each group)" if grouped else ""))
            ax.set_ylabel("score / layer max")
            if len(curves) <= 8:
                ax.legend(fontsize=6)
        ax.set_title(name)
    fig.suptitle(f"importance after ranking ({rankings.num_tokens:,} calibration tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sorted(scores: list[float], order: list[int]) -> list[float]:
    """Scores in storage order, divided by their maximum (so layers of different scale compare)."""
    values = [scores[j] for j in order]
    top = max((abs(v) for v in values), default=0.0) or 1.0
    return [v / top for v in values]
