"""What a plan is computed from: the cluster (:class:`PlanHardware`) and each phase's settings (:class:`PhaseShape`).

Both sides of a plan read them, the memory side (:mod:`components.plan`) and the time side
(:mod:`components.plan_time`), so they live below both.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanHardware(_Strict):
    """The cluster a plan is checked against."""

    gpus: int | None = Field(None, ge=1, description="Data-parallel ranks (one accelerator each); None: num_workers.")
    gpu_mem_gb: float = Field(80.0, gt=0, description="Memory of one accelerator in GB (1e9 bytes).")
    host_mem_gb: float = Field(960.0, gt=0, description="Host memory of one node in GB, shared by its ranks.")
    gpus_per_node: int = Field(8, ge=1, description="Ranks per node (host memory is shared between them).")
    peak_tflops: float = Field(989.0, gt=0, description="Dense bf16 peak of one accelerator (H100 SXM: 989).")
    utilization: float = Field(0.4, gt=0, le=1, description="Fraction of the peak the step sustains (MFU).")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cuda: fused mamba-ssm scan with the config's chunk; cpu: the chunked PyTorch scan."
    )
    host_overhead_gb: float = Field(
        6.0, ge=0, description="Host memory of one rank's process before any model (CUDA context, torch, Ray)."
    )
    interconnect_gbps: float = Field(
        400.0,
        gt=0,
        description="Network bandwidth of one rank in Gb/s for ZeRO's collectives (400: one InfiniBand NDR "
        "adapter per GPU, as in H100 nodes; ranks of one node share NVLink, but a ring over every node runs at "
        "the slowest link).",
    )


class PhaseShape(_Strict):
    """What one distillation phase trains with (the fields of a DistillConfig a plan needs)."""

    name: str = Field(description="Phase name in tables and metric keys, e.g. 'distill_phase1'.")
    steps: int = Field(ge=1, description="Optimizer steps.")
    seq_len: int = Field(ge=1, description="Tokens per row.")
    micro_batch_size: int = Field(ge=1, description="Rows per rank per micro-batch.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step (memory is per micro-batch).")
    num_workers: int = Field(ge=1, description="Data-parallel ranks the phase asks for.")
    zero_stage: Literal[0, 1, 2, 3] = Field(description="DeepSpeed ZeRO stage.")
    bf16: bool = Field(description="bf16 weights and activations (else float32).")
    activation_checkpointing: bool = Field(False, description="Per-block activation checkpointing.")
    kd_chunk_tokens: int = Field(
        1024, ge=0, description="Token rows per chunk of the KD loss (0: the reference loss on full logits)."
    )
    live_layers: int = Field(
        2, ge=1, description="Gathered layers one ZeRO-3 engine holds at once (the computing one + prefetch)."
    )

    @classmethod
    def of(cls, name: str, config: Any) -> PhaseShape:
        """The shape of ``config`` (a DistillConfig, or anything with its field names) under ``name``."""
        return cls(name=name, **{f: getattr(config, f) for f in cls.model_fields if f not in ("name", "live_layers")})
