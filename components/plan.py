"""Size a distillation cluster before launch: per-rank memory, fit verdict, time and tokens per phase.

A plan is arithmetic on the parent's config and each phase's settings; nothing is built or loaded.
The memory model is the design the distillation runs on (see DESIGN.md's scale-out path):

* **Teacher**: a frozen engine, partitioned like the student at ZeRO-3 (``bytes / world`` per rank)
  plus the layers it has gathered at once; below ZeRO-3 every rank holds it whole. It sends its final
  hidden states (tokens x hidden), not logits, to the loss.
* **Student**: weights in the training dtype, gradients in the same dtype, AdamW state of 12 bytes per
  parameter (float32 master copy, m, v) for bf16 weights or 8 (m, v) for float32 weights: the ZeRO
  paper's accounting. ZeRO-1 partitions the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also
  the weights (built under ``zero.Init``: no rank ever holds a full copy). At ZeRO-3 a rank also holds
  the layers it has gathered (forward and backward) and one gathered layer's gradient before its
  reduce-scatter.
* **Activations** per layer kind, in bytes per token, are what autograd keeps for the backward in this
  project's layers (written out in :func:`layer_activation_bytes`; the Mamba scan either as the fused
  mamba-ssm kernel on CUDA or as the chunked PyTorch scan on CPU). With per-block checkpointing a
  rank keeps each block's input and, during the backward, one block's activations twice (recomputed
  values and their gradients); without it, every block's activations plus one block's gradients.
* **KD loss** (:mod:`model.elastic.kd_chunked`): a (chunk x vocab) float32 working set of three
  tensors plus a bool and two low-precision ones, the float32 gradient accumulator of ``lm_head`` and
  its gradient, and at ZeRO-3 both gathered ``lm_head`` matrices.
* **Checkpoints**: each rank writes its own shard (weights + optimizer partition) through host memory;
  on the device nothing is gathered. Host memory per node counts, per rank, a process baseline, that
  shard and the largest single tensor (loading the parent tensor by tensor).

The peak is the sum of the items, as if all were alive together during the student's backward: the
teacher's gathered layers are counted although ZeRO-3 releases them after the teacher's forward.

Time and ZeRO traffic (FLOPs per token, collectives per step, step and wall time) are
:mod:`components.plan_time`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from components.plan_inputs import PhaseShape, PlanHardware
from components.plan_time import GB, PhaseTime, phase_time, time_metrics, time_rows
from components.tracking import Tracker
from model.config import HybridConfig
from model.elastic.params import count_params
from model.mamba import _cpu_chunk_size

ALLREDUCE_BUCKET = 500_000_000
"""Elements DeepSpeed's data-parallel engine (ZeRO-0) flattens into one buffer to all-reduce gradients."""
_KIND_CHAR = {"mamba": "M", "attention": "*", "moe": "E", "mlp": "-"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MemoryItem(_Strict):
    """One term of a rank's memory."""

    name: str = Field(description="What the bytes are.")
    bytes: float = Field(description="Bytes per rank.")
    note: str = Field(description="How the figure is computed.")


class PhasePlan(PhaseTime):
    """The plan of one phase on the given hardware: memory and tokens here, time and traffic from
    :class:`~components.plan_time.PhaseTime`."""

    name: str = Field(description="Phase name.")
    world: int = Field(description="Ranks.")
    items: list[MemoryItem] = Field(description="Device memory per rank, item by item (counted in the total).")
    not_counted: list[MemoryItem] = Field(description="Alternatives shown for comparison, not in the total.")
    total_bytes: float = Field(description="Sum of the items: the planned peak per rank.")
    device_bytes: float = Field(description="Memory of one accelerator.")
    fits: bool = Field(description="total_bytes <= device_bytes.")
    largest: str = Field(description="Name of the largest item.")
    host_items: list[MemoryItem] = Field(description="Host memory per node, item by item.")
    host_total_bytes: float = Field(description="Planned host memory per node.")
    host_fits: bool = Field(description="host_total_bytes <= the node's host memory.")
    tokens_per_step: int = Field(description="Tokens of one optimizer step over all ranks.")
    tokens: int = Field(description="Tokens of the whole phase.")


class Plan(_Strict):
    """Every phase of one run, with the model and hardware they were planned for."""

    total_params: int = Field(description="Parent (= student and teacher) total parameters.")
    active_params: int = Field(description="Parameters one token uses (embedding and lm_head included).")
    hardware: PlanHardware = Field(description="The cluster checked against.")
    phases: list[PhasePlan] = Field(description="One plan per phase, in order.")

    @property
    def fits(self) -> bool:
        return all(p.fits and p.host_fits for p in self.phases)


# ---------------------------------------------------------------------- activations
def layer_activation_bytes(
    config: HybridConfig, kind: str, act_bytes: int, seq_len: int, device: str = "cuda", masked: bool = True
) -> float:
    """Bytes per token autograd keeps for one block of ``kind`` (not counting the block's input).

    ``a = act_bytes`` (2 bf16, 4 float32); float32 router scores, statistics and scan temporaries are 4
    bytes, int64 indices 8. Every block: its RMSNorm (rstd, output, and the projection's input copy).
    ``masked``: the router's soft masks are applied (distillation): each masked product keeps its input.
    """
    c, a = config, act_bytes
    h = c.hidden_size
    norm = 4 + 2 * h * a + (2 * h * a if masked else 0)  # masked: the mixer output before and after the mask
    if kind == "mlp":
        # up output (relu^2 input) and activation; masked: the width-masked activation
        return norm + (3 if masked else 2) * c.intermediate_size * a
    if kind == "attention":
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        # q, k, v, the attention output (o_proj's input is a view of it) and the float32 logsumexp; masked:
        # o_proj's input is a copy of the head-masked output
        return norm + ((3 if masked else 2) * q + 2 * kv) * a + 4 * c.num_attention_heads
    if kind == "moe":
        k, f, e = c.num_experts_per_tok, c.moe_intermediate_size, c.n_routed_experts
        shared = c.moe_shared_expert_intermediate_size if c.n_shared_experts else 0
        # router: float32 scores (E), top-k indices and weights, their sum; grouped experts: sort order and
        # token index (int64), gathered inputs (k h), up output and activation (2 k f), outputs and weighted
        # outputs (2 k h), sorted weights; shared expert: up output and activation. Masked: the expert
        # mask's log added to the selection scores (2 E float32), the width-masked activations
        routed = 4 * e + 8 * k + 4 + 4 * k + 16 * k + 4 * k + a * (3 * k * h + 2 * k * f + 2 * shared)
        return norm + routed + ((8 * e + a * (k * f + shared)) if masked else 0)
    if kind != "mamba":
        raise ValueError(f"layer_activation_bytes: unknown layer kind {kind!r}")
    d, heads, gn = c.mamba_d_inner, c.mamba_num_heads, c.n_groups * c.ssm_state_size
    conv, rows = c.mamba_conv_dim, c.mamba_in_proj_dim
    # in_proj output (z and dt are views of it), conv input and activated output, float32 dt (softplus in and
    # out), gated norm: y, silu(z), product, output, out_proj's input copy, float32 rstd per group; masked:
    # the head-masked y and its product
    common = norm + rows * a + 2 * conv * a + 8 * heads + (7 if masked else 5) * d * a + 4 * c.n_groups
    if device == "cuda":
        # mamba_chunk_scan_combined keeps contiguous x, B, C, its output, float32 dt and dA_cumsum
        return common + (2 * d + gn) * a + 8 * heads
    # the chunked PyTorch scan in float32 (model.ssd.ssd_scan_chunked): (L, L) decay and score blocks per
    # head, C B^T per group, the discretised input and its copies, per-chunk states, and the chunk-to-chunk
    # (c + 1)^2 decay matrices; the conv's pre-activation is kept too
    L = min(_cpu_chunk_size(seq_len, c.chunk_size), seq_len)
    n_chunks = -(-seq_len // L)
    p_n = heads * c.mamba_head_dim * c.ssm_state_size
    scan = 5 * heads + 2 * gn + 3 * heads * L + c.n_groups * L + 4 * d + 2 * p_n / L
    scan += 3 * heads * (n_chunks + 1) ** 2 / seq_len if n_chunks > 1 else 0
    return common + conv * a + 4 * scan


def activation_bytes(
    config: HybridConfig, tokens: int, seq_len: int, act_bytes: int, device: str, masked: bool = True
) -> dict[str, float]:
    """Activations of one student forward over ``tokens`` tokens (rows x seq_len), in bytes.

    Returns ``inputs`` (every block's input: what checkpointing keeps), ``blocks`` (every block's
    activations), ``largest_block`` (one block of the most expensive kind) and ``head`` (final norm).
    """
    res = 4 if config.residual_in_fp32 else act_bytes
    per_kind = {
        k: layer_activation_bytes(config, k, act_bytes, seq_len, device, masked) for k in set(config.layer_kinds)
    }
    n = len(config.layer_kinds)
    return {
        "inputs": tokens * n * config.hidden_size * res,
        "blocks": tokens * sum(per_kind[k] for k in config.layer_kinds),
        "largest_block": tokens * max(per_kind.values()),
        "head": tokens * (4 + 2 * config.hidden_size * act_bytes),
    }


# ---------------------------------------------------------------------- parameters
def layer_params(config: HybridConfig) -> dict[str, int]:
    """Parameters of one block of each kind in the config (its norm included)."""
    outer = 2 * config.vocab_size * config.hidden_size + config.hidden_size
    return {
        kind: count_params(config.replace(pattern=_KIND_CHAR[kind])).total - outer for kind in set(config.layer_kinds)
    }


# ---------------------------------------------------------------------- one phase
def plan_phase(config: HybridConfig, phase: PhaseShape, hw: PlanHardware) -> PhasePlan:
    """Per-rank memory, verdict and time of one phase (the models: this module's docstring and
    :mod:`components.plan_time`'s)."""
    world = hw.gpus or phase.num_workers
    a = 2 if phase.bf16 else 4
    stage = phase.zero_stage
    p_total = count_params(config).total
    per_layer = layer_params(config)
    big_layer = max(max(per_layer.values()), config.vocab_size * config.hidden_size)
    vh = config.vocab_size * config.hidden_size
    tokens = phase.micro_batch_size * phase.seq_len
    opt = 12 if phase.bf16 else 8

    def share(n_bytes: float, partitioned: bool) -> float:
        return n_bytes / world if partitioned else n_bytes

    items: list[MemoryItem] = []

    def add(name: str, n_bytes: float, note: str) -> None:
        items.append(MemoryItem(name=name, bytes=float(n_bytes), note=note))

    sharded = stage == 3
    add(
        "teacher weights",
        share(p_total * a, sharded),
        f"{p_total:,} params x {a} B" + (f" / {world} ranks (frozen ZeRO-3 engine)" if sharded else " (whole copy)"),
    )
    if sharded:
        add(
            "teacher gathered layers",
            phase.live_layers * big_layer * a,
            f"{phase.live_layers} x largest layer ({big_layer:,} params) x {a} B",
        )
    add("student weights", share(p_total * a, stage >= 3), f"{p_total:,} params x {a} B" + _split(stage >= 3, world))
    add("student gradients", share(p_total * a, stage >= 2), f"{p_total:,} params x {a} B" + _split(stage >= 2, world))
    add(
        "optimizer state",
        share(p_total * opt, stage >= 1),
        f"{p_total:,} params x {opt} B (" + ("fp32 master + Adam m, v" if phase.bf16 else "Adam m, v") + ")"
        + _split(stage >= 1, world),
    )  # fmt: skip
    if sharded:
        add(
            "student gathered layers",
            (phase.live_layers + 1) * big_layer * a,
            f"({phase.live_layers} gathered + 1 layer's gradient before reduce-scatter) x {big_layer:,} params x {a} B",
        )
    if stage == 0:
        flat = min(p_total, ALLREDUCE_BUCKET)
        add(
            "gradient all-reduce buffer",
            flat * a,
            f"DeepSpeed flattens the gradients into buckets of up to {ALLREDUCE_BUCKET:.0e} elements to all-reduce "
            f"them: {flat:,} x {a} B",
        )
    acts = activation_bytes(config, tokens, phase.seq_len, a, hw.device)
    ckpt_bytes = acts["inputs"] + 2 * acts["largest_block"] + acts["head"]
    full_bytes = acts["inputs"] + acts["blocks"] + acts["largest_block"] + acts["head"]
    ckpt_note = f"{tokens:,} tokens: block inputs + 2 x the largest block's activations"
    full_note = f"{tokens:,} tokens: every block's activations + one block's gradients"
    used, other = (ckpt_bytes, full_bytes) if phase.activation_checkpointing else (full_bytes, ckpt_bytes)
    add(
        "activations" + (" (checkpointed)" if phase.activation_checkpointing else ""),
        used,
        ckpt_note if phase.activation_checkpointing else full_note,
    )
    not_counted = [
        MemoryItem(
            name="activations" + (" without checkpointing" if phase.activation_checkpointing else " (checkpointed)"),
            bytes=float(other),
            note=full_note if phase.activation_checkpointing else ckpt_note,
        )
    ]
    if phase.kd_chunk_tokens == 0:
        # the reference loss: student and teacher logits, then float32 log-softmaxes, probabilities and products
        kd = tokens * config.vocab_size * (2 * a + 5 * 4) + vh * a + tokens * config.hidden_size * 2 * a
        kd_note = f"reference loss: {tokens:,} x {config.vocab_size:,} logits x (2 x {a} B + 5 fp32), lm_head grad"
    else:
        chunk = min(phase.kd_chunk_tokens, tokens)
        kd = chunk * config.vocab_size * (12 + 1 + 2 * a) + vh * (4 + a) + tokens * config.hidden_size * 2 * a
        kd_note = f"{chunk} x {config.vocab_size:,} chunk, lm_head grad (fp32 + {a} B), teacher hidden + hidden grad"
    if sharded:
        kd += 2 * vh * a
        kd_note += ", both lm_heads gathered"
    add("KD logits chunk", kd, kd_note)
    add("checkpoint buffers", 0.0, "each rank writes its own shard from host memory; nothing gathered on device")
    total = sum(i.bytes for i in items)
    device_bytes = hw.gpu_mem_gb * GB

    per_node = min(hw.gpus_per_node, world)
    shard = share(p_total * a, stage >= 3) + share(p_total * opt, stage >= 1)
    big_tensor = max(
        config.n_routed_experts * config.moe_intermediate_size * config.hidden_size if "moe" in per_layer else 0, vh
    )
    host_items = [
        MemoryItem(name="rank processes", bytes=per_node * hw.host_overhead_gb * GB, note=f"{per_node} ranks"),
        MemoryItem(
            name="checkpoint shards",
            bytes=per_node * shard,
            note=f"{per_node} x (weights + optimizer partition) written per rank",
        ),
        MemoryItem(
            name="loading buffers",
            bytes=per_node * big_tensor * 4,
            note=f"{per_node} x largest tensor ({big_tensor:,}) in fp32, loaded tensor by tensor",
        ),
    ]
    host_total = sum(i.bytes for i in host_items)

    tokens_per_step = world * tokens * phase.grad_accum_steps
    return PhasePlan(
        name=phase.name,
        world=world,
        items=items,
        not_counted=not_counted,
        total_bytes=total,
        device_bytes=device_bytes,
        fits=total <= device_bytes,
        largest=max(items, key=lambda i: i.bytes).name,
        host_items=host_items,
        host_total_bytes=host_total,
        host_fits=host_total <= hw.host_mem_gb * GB,
        tokens_per_step=tokens_per_step,
        tokens=tokens_per_step * phase.steps,
        **phase_time(config, phase, hw, world).model_dump(),
    )


def _split(partitioned: bool, world: int) -> str:
    return f" / {world} ranks" if partitioned else " (replicated)"


def make_plan(config: HybridConfig, phases: list[PhaseShape], hw: PlanHardware) -> Plan:
    """Plan every phase of a run on ``hw``."""
    counts = count_params(config)
    return Plan(
        total_params=counts.total,
        active_params=counts.active,
        hardware=hw,
        phases=[plan_phase(config, p, hw) for p in phases],
    )


# ---------------------------------------------------------------------- output
def format_plan(plan: Plan) -> str:
    """Markdown tables: memory per rank by item for every phase, the verdict, host memory, time and tokens."""
    hw = plan.hardware
    lines = [
        f"parent: {plan.total_params / 1e9:.2f}B total / {plan.active_params / 1e9:.2f}B active parameters; "
        f"{hw.gpu_mem_gb:g} GB per accelerator, {hw.host_mem_gb:g} GB host per {hw.gpus_per_node}-rank node, "
        f"{hw.utilization:.0%} of {hw.peak_tflops:g} TFLOPS, {hw.interconnect_gbps:g} Gb/s per rank for ZeRO's "
        "collectives",
        "",
        "| per rank (GB) | " + " | ".join(f"{p.name} ({p.world} ranks)" for p in plan.phases) + " |",
        "|---|" + "---:|" * len(plan.phases),
    ]
    for i, item in enumerate(plan.phases[0].items):
        cells = [f"{p.items[i].bytes / GB:.2f}" for p in plan.phases]
        lines.append(f"| {item.name} | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(f"**{p.total_bytes / GB:.2f}**" for p in plan.phases) + " |")
    for i, item in enumerate(plan.phases[0].not_counted):
        cells = [f"({p.not_counted[i].bytes / GB:.2f})" for p in plan.phases]
        lines.append(f"| {item.name} (not counted) | " + " | ".join(cells) + " |")
    lines.append(
        "| verdict | "
        + " | ".join(
            f"{'fits' if p.fits else 'DOES NOT FIT'} in {p.device_bytes / GB:g} GB; largest: {p.largest}"
            for p in plan.phases
        )
        + " |"
    )
    lines.append("| host per node (GB) | " + " | ".join(_host_cell(p, hw) for p in plan.phases) + " |")
    lines.append("| tokens per step | " + " | ".join(f"{p.tokens_per_step:,}" for p in plan.phases) + " |")
    lines.append("| tokens | " + " | ".join(f"{p.tokens / 1e9:.2f}B" for p in plan.phases) + " |")
    lines += time_rows(plan.phases)
    lines.append("")
    lines.append(f"verdict: {'fits' if plan.fits else 'DOES NOT FIT'}")
    return "\n".join(lines)


def _host_cell(p: PhasePlan, hw: PlanHardware) -> str:
    return f"{p.host_total_bytes / GB:.0f} of {hw.host_mem_gb:g}" + ("" if p.host_fits else " (DOES NOT FIT)")


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-safe dict (``fits`` included)."""
    return {**plan.model_dump(mode="json"), "fits": plan.fits}


def plan_metrics(plan: Plan) -> dict[str, float]:
    """Flat metrics: ``plan.<phase>.<item>_gb``, totals, verdicts (1/0), time and tokens."""
    out: dict[str, float] = {"plan.fits": float(plan.fits)}
    for p in plan.phases:
        key = f"plan.{p.name}"
        for item in p.items:
            out[f"{key}.{_slug(item.name)}_gb"] = item.bytes / GB
        out[f"{key}.total_gb"] = p.total_bytes / GB
        out[f"{key}.fits"] = float(p.fits)
        out[f"{key}.host_total_gb"] = p.host_total_bytes / GB
        out.update(time_metrics(p, key))
        out[f"{key}.tokens"] = float(p.tokens)
    return out


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_").replace("__", "_")


def log_plan(plan: Plan, tracker: Tracker) -> None:
    """Log the plan through ``tracker`` as ``plan.json`` plus flat metrics."""
    tracker.log_dict(plan_json(plan), "plan.json")
    tracker.log_metrics(plan_metrics(plan))


def dumps(plan: Plan) -> str:
    """The plan as indented JSON text."""
    return json.dumps(plan_json(plan), indent=2)
