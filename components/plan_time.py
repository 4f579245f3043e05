"""The time side of a distillation plan: FLOPs per token, ZeRO's traffic per step, step and wall time.

FLOPs per token are ``2 N`` for the teacher's forward and ``6 N`` for the student's forward and
backward (``8 N`` with checkpointing: one more forward), ``N`` the matmul parameters one token uses
(the active count without the embedding), plus causal attention ``4 T d_attn`` per attention layer
forward and the SSD scan's state products per Mamba layer; compute time is the FLOPs of one rank over
``peak_tflops x utilization``. ZeRO's collectives add their bytes over ``interconnect_gbps``
(:func:`comm_bytes_per_step`): at ZeRO-3 every micro-step gathers the teacher once and the student twice
and reduce-scatters its gradients, 4 x the model's bytes per rank, whatever the number of tokens, which
for a sparse MoE parent (all experts gathered, few active per token) can outweigh the compute. The step
time is their sum (no overlap assumed).

The memory side, and the plan that joins both, is :mod:`components.plan`.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from components.plan_inputs import PhaseShape, PlanHardware
from model.config import HybridConfig
from model.elastic.params import count_params

GB = 1e9


class PhaseTime(BaseModel):
    """Time and traffic of one phase (the time fields of a :class:`~components.plan.PhasePlan`)."""

    model_config = ConfigDict(extra="forbid")

    flops_per_token: float = Field(description="Teacher forward + student forward and backward (+ recompute).")
    compute_time_s: float = Field(description="Seconds of FLOPs per step at the stated utilization.")
    comm_bytes_per_step: float = Field(description="Bytes one rank sends in ZeRO's collectives per step.")
    comm_time_s: float = Field(description="Seconds of those collectives per step at interconnect_gbps.")
    step_time_s: float = Field(
        description="compute_time_s + comm_time_s: no overlap assumed (DeepSpeed prefetches the next layer while "
        "one computes, so a step can be as short as the larger of the two)."
    )
    hours: float = Field(description="Wall-clock hours of the phase.")
    gpu_hours: float = Field(description="Accelerator hours of the phase.")


def flops_per_token(config: HybridConfig, seq_len: int, checkpointing: bool) -> dict[str, float]:
    """Forward FLOPs per token of the teacher, and the student's forward + backward (+ recompute)."""
    active = count_params(config).active - config.vocab_size * config.hidden_size  # the embedding is a lookup
    kinds = config.layer_kinds
    attn = kinds.count("attention") * 4 * (seq_len / 2) * config.num_attention_heads * config.head_dim
    heads, p, n = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size
    chunk = min(config.chunk_size, seq_len)
    ssd = kinds.count("mamba") * (4 * heads * p * n + 2 * chunk * (heads * p + config.n_groups * n))
    forward = 2 * active + attn + ssd
    student = forward * (4 if checkpointing else 3)
    return {"teacher": forward, "student": student, "total": forward + student}


def comm_bytes_per_step(model_bytes: float, world: int, stage: int, micro_steps: int) -> float:
    """Bytes one rank sends per optimizer step in ZeRO's collectives (ring algorithms: a rank sends
    ``(world - 1) / world`` of the full tensor in an all-gather or a reduce-scatter, twice that in an all-reduce).

    * ZeRO-3, every micro-step: the teacher's layers gathered for its forward, the student's gathered for its
      forward and again for its backward, and its gradients reduce-scattered: 4 x the model's bytes.
    * ZeRO-2, every micro-step: the gradients reduce-scattered; per step the updated weights all-gathered.
    * ZeRO-0 and 1, per step: the gradients all-reduced (ZeRO-1: reduce-scatter + all-gather of the weights).
    """
    ring = (world - 1) / world * model_bytes
    if stage == 3:
        return 4 * ring * micro_steps
    if stage == 2:
        return ring * (micro_steps + 1)
    return 2 * ring


def phase_time(config: HybridConfig, phase: PhaseShape, hw: PlanHardware, world: int) -> PhaseTime:
    """Step and wall time of ``phase`` on ``world`` ranks of ``hw``: compute plus ZeRO traffic, no overlap."""
    model_bytes = count_params(config).total * (2 if phase.bf16 else 4)
    tokens = phase.micro_batch_size * phase.seq_len * phase.grad_accum_steps  # per rank per optimizer step
    flops = flops_per_token(config, phase.seq_len, phase.activation_checkpointing)["total"]
    compute_s = flops * tokens / (hw.peak_tflops * 1e12 * hw.utilization)
    comm = comm_bytes_per_step(model_bytes, world, phase.zero_stage, phase.grad_accum_steps)
    comm_s = comm / (hw.interconnect_gbps * 1e9 / 8)
    step_s = compute_s + comm_s
    return PhaseTime(
        flops_per_token=flops,
        compute_time_s=compute_s,
        comm_bytes_per_step=comm,
        comm_time_s=comm_s,
        step_time_s=step_s,
        hours=step_s * phase.steps / 3600,
        gpu_hours=step_s * phase.steps * world / 3600,
    )


# ---------------------------------------------------------------------- output
def time_rows(phases: list[PhaseTime]) -> list[str]:
    """Rows of the plan's Markdown table for the time fields, one column per phase."""

    def row(label: str, cell: Callable[[PhaseTime], str]) -> str:
        return f"| {label} | " + " | ".join(cell(p) for p in phases) + " |"

    return [
        row("TFLOP per token", lambda p: f"{p.flops_per_token / 1e12:.4f}"),
        row("compute per step (s)", lambda p: f"{p.compute_time_s:.2f}"),
        row(
            "ZeRO traffic per step (GB per rank / s)",
            lambda p: f"{p.comm_bytes_per_step / GB:,.0f} / {p.comm_time_s:.2f}",
        ),
        row("step time (s, no overlap)", lambda p: f"{p.step_time_s:.2f}"),
        row("wall time (h) / GPU hours", lambda p: f"{p.hours:.1f} / {p.gpu_hours:,.0f}"),
    ]


def time_metrics(t: PhaseTime, key: str) -> dict[str, float]:
    """Flat metrics of one phase's time fields under ``key`` (e.g. ``plan.distill_phase1``)."""
    return {
        f"{key}.step_time_s": t.step_time_s,
        f"{key}.compute_time_s": t.compute_time_s,
        f"{key}.comm_time_s": t.comm_time_s,
        f"{key}.comm_gb_per_step": t.comm_bytes_per_step / GB,
        f"{key}.hours": t.hours,
        f"{key}.gpu_hours": t.gpu_hours,
    }
