"""Accounting shared by the baseline comparisons (``bench_baselines.py``): accuracy with its binomial
standard error on nested problem sets, the analytic training FLOPs of the elastic run and of a
separately distilled model, and the steps a separate run gets for a share of the elastic run's
tokens or FLOPs.

FLOPs are counted per token (every position of every row, padding included: the model runs on it):
``2 x A_teacher`` for the teacher's forward pass and ``6 x A_student`` for the student's forward and
backward passes, where ``A`` is a model's active parameters. The elastic student runs at full width
under its masks, so what it executes is charged the full model's ``A`` (``full_width``); the same run
charged as if each micro-batch ran its drawn budget sliced (``drawn``) is reported beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from components.distill.config import DistillConfig
from components.distill.draws import draw_budget
from components.lm_eval import task_accuracy


def binomial_se(correct: int, n: int) -> float:
    """Standard error ``sqrt(p (1 - p) / n)`` of an accuracy of ``correct`` out of ``n`` problems."""
    if n <= 0:
        raise ValueError(f"n must be >= 1, got {n}")
    p = correct / n
    return math.sqrt(p * (1.0 - p) / n)


def accuracy_entry(correct: int, n: int) -> dict[str, float]:
    """``{"correct", "n", "accuracy", "se"}`` of one accuracy."""
    return {"correct": correct, "n": n, "accuracy": correct / n, "se": binomial_se(correct, n)}


def difference(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """``a - b`` of two accuracies on the same problems with the unpaired standard error
    ``sqrt(se_a^2 + se_b^2)``: both models answer the same problems, so the paired error would be
    smaller; this one errs on the side of calling a difference noise."""
    return {"diff": a["accuracy"] - b["accuracy"], "se": math.hypot(a["se"], b["se"])}


def nested_accuracy(
    model: Any, tokenizer: Any, sets: dict[str, list[Any]], per_level: Sequence[int], max_new_tokens: int
) -> dict[str, dict[str, float]]:
    """Greedy accuracy with full thinking on the first ``k`` problems of every set, for each ``k`` of
    ``per_level`` (ascending), keyed by the number of problems (``str``).

    The sets are scored in slices ``[k_{i-1}, k_i)`` of every set, so each problem is decoded once and
    the larger counts include the smaller ones' problems (a held-out level's stream is a prefix of the
    same stream drawn longer).
    """
    ks = sorted(set(per_level))
    if not ks or ks[0] < 1:
        raise ValueError(f"per_level: give counts >= 1, got {list(per_level)}")
    out: dict[str, dict[str, float]] = {}
    correct = n = 0
    prev = 0
    for k in ks:
        chunk = [p for items in sets.values() for p in items[prev:k]]
        if chunk:
            score = task_accuracy(model, tokenizer, chunk, think=True, max_new_tokens=max_new_tokens)
            correct, n = correct + score.correct, n + score.n
        if n:
            out[str(n)] = accuracy_entry(correct, n)
        prev = k
    return out


def flops_per_token(teacher_active: int, student_active: int) -> int:
    """Training FLOPs of one token: teacher forward (2 A) + student forward and backward (6 A)."""
    return 2 * teacher_active + 6 * student_active


def rows_per_update(cfg: DistillConfig) -> int:
    """Rows one optimizer update of a phase sees (every worker, every micro-batch)."""
    return cfg.micro_batch_size * cfg.num_workers * cfg.grad_accum_steps


def tokens_per_update(cfg: DistillConfig) -> int:
    assert cfg.seq_len is not None  # filled in by DistillConfig's validator
    return rows_per_update(cfg) * cfg.seq_len


def elastic_flops(
    phases: Sequence[DistillConfig], full_active: int, budget_active: Sequence[int]
) -> list[dict[str, int]]:
    """Per phase: ``tokens``, ``full_width`` FLOPs (the masked student charged the full model) and
    ``drawn`` FLOPs (each micro-batch charged the active parameters of the budget drawn for it, with
    the run's own draws). ``budget_active``: active parameters per budget, in the config's order."""
    out = []
    for cfg in phases:
        assert cfg.seq_len is not None
        micro_tokens = cfg.micro_batch_size * cfg.num_workers * cfg.seq_len
        probs = cfg.sampling_probs
        drawn = 0
        for step in range(cfg.steps):
            for micro in range(cfg.grad_accum_steps):
                b = draw_budget(cfg.seed, cfg.phase, step, probs, micro)
                drawn += micro_tokens * flops_per_token(full_active, budget_active[b])
        tokens = cfg.steps * tokens_per_update(cfg)
        out.append({"tokens": tokens, "full_width": tokens * flops_per_token(full_active, full_active), "drawn": drawn})
    return out


def steps_for_tokens(tokens: float, cfg: DistillConfig) -> int:
    """Steps of ``cfg``'s batch shape that see ``tokens`` tokens (at least one)."""
    return max(1, round(tokens / tokens_per_update(cfg)))


def steps_for_flops(flops: float, cfg: DistillConfig, teacher_active: int, student_active: int) -> int:
    """Steps of ``cfg``'s batch shape that spend ``flops`` distilling a student of ``student_active``
    active parameters from a teacher of ``teacher_active`` (at least one)."""
    per_step = tokens_per_update(cfg) * flops_per_token(teacher_active, student_active)
    return max(1, round(flops / per_step))


# ---------------------------------------------------------------------- the pipeline run read
#: The stages whose outputs the comparisons read (the rest of the pipeline is not needed).
TRAIN_STAGES = ["parent", "rank", "distill_phase1", "distill_phase2", "export"]


def distill_configs(config_path: str, overrides: list[str]) -> tuple[Any, DistillConfig, DistillConfig, Any, Any]:
    """The pipeline config and the exact configs its distill, export and evaluate stages use."""
    from pipelines.config import load_pipeline_config
    from pipelines.runner import StageContext
    from pipelines.stages import build_distill1, build_distill2, build_evaluate, build_export

    cfg = load_pipeline_config(config_path, overrides)
    p1 = build_distill1(StageContext(cfg, cfg.run_dir, "distill_phase1"))
    p2 = build_distill2(StageContext(cfg, cfg.run_dir, "distill_phase2"))
    export = build_export(StageContext(cfg, cfg.run_dir, "export"))
    ev = build_evaluate(StageContext(cfg, cfg.run_dir, "evaluate"))
    return cfg, p1, p2, export, ev


def ensure_trained(config_path: str, overrides: list[str], run_missing: bool) -> None:
    """Make sure the run folder holds this config's trained stages (:data:`TRAIN_STAGES`), up to date
    with it (the pipeline's own stage keys). With ``run_missing`` the pipeline is run for the stages
    that are not (in a subprocess, so its Ray session ends with it); otherwise the call exits naming
    the command to run."""
    import subprocess
    import sys

    from pipelines.config import load_pipeline_config
    from pipelines.runner import PipelineRunner
    from pipelines.stages import pipeline_stages

    cfg = load_pipeline_config(config_path, overrides)
    plan = dict(PipelineRunner(pipeline_stages(), cfg, cfg.run_dir).plan())
    stale = [s for s in TRAIN_STAGES if plan[s] != "cached"]
    if not stale:
        return
    sets = [a for o in overrides for a in ("--set", o)]
    command = ["star-elastic", "run", config_path, *sets, *(a for s in TRAIN_STAGES for a in ("--only", s))]
    if not run_missing:
        raise SystemExit(
            f"{cfg.run_dir}: stages {stale} are not done for {config_path} (or were run with other settings); "
            f"run `{' '.join(command)}` first, or pass --run-missing"
        )
    print(f"running {stale} for {config_path}: {' '.join(command)}", flush=True)
    rc = subprocess.call([sys.executable, "-m", "pipelines.cli", *command[1:]])
    if rc:
        raise SystemExit(f"the pipeline failed (exit {rc}) for {config_path}; its log is above")
