"""Validated configuration of one distillation phase (phase 1: short context, phase 2: long context).

Design choices:

* One flat pydantic model, every field documented, ``extra="forbid"``: the same definition feeds
  the YAML files, the command line and the Kubeflow parameters, and a typo is an error.
* Everything that can be checked without reading files is checked here (budget probabilities,
  phase-2 needs ``init_from``, the router config, the elastic space's own rules). Checks that read
  the teacher's ``config.json`` or the file system (does ``init_from`` exist, are the budgets
  reachable in the space) live in :func:`preflight`, which the stage runs on the driver before any
  Ray worker starts, so a bad config fails in seconds with a message that names the field.
* ``budget_probs`` is aligned with the budgets sorted LARGEST FIRST (the order
  :class:`~model.elastic.budgets.BudgetSet` stores them in, whatever order they were written in).
* The training loop carries no test code: a test that needs to act inside it (kill a worker mid-run)
  names its own function in ``step_callback`` (an import path), which the loop calls at every step.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from components.data import DataConfig, GeneratorSource, ReasoningMarkers, held_out_prompts
from components.data.checks import check_data
from components.distill.heap import HostHeapConfig
from components.stage_task import TaskResources
from model.config import HybridConfig
from model.elastic.budgets import Budget, BudgetSet
from model.elastic.router import RouterConfig
from model.elastic.space import ElasticSpace

PHASE2_DEFAULT_PROBS: tuple[float, ...] = (0.5, 0.3, 0.2)
"""Phase-2 budget sampling, largest budget first (the method's skew towards the full model)."""

_BOOKKEEPING = {
    "output_dir", "storage_path", "run_name", "tracking_uri", "run_id", "experiment", "log_every",
    "checkpoint_every", "max_failures", "step_callback", "kd_chunk_tokens", "activation_checkpointing", "host_heap",
    "zero3_gathers",
    "consolidation", "consolidation_dir",
}  # fmt: skip
"""Fields that do not change what is trained (left out of :meth:`DistillConfig.run_key`)."""

PHASE_SEQ_LEN: dict[int, int] = {1: 64, 2: 256}
"""Default tokens per row of each phase for the demo task (a demo problem is ~30-60 tokens)."""


class DistillConfig(BaseModel):
    """One distillation phase: teacher, student initialisation, elastic space, budgets, schedule, cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # resolved once, then only read

    # ------------------------------------------------------------------ what is trained
    phase: Literal[1, 2] = Field(1, description="1: short context, uniform budgets; 2: long context, skewed budgets.")
    teacher_uri: str = Field(
        description="The permuted parent checkpoint folder (nemotron_h safetensors + config.json); the tokenizer "
        "files lie beside the weights. Local path or s3:// URI."
    )
    init_from: str | None = Field(
        None,
        description="Phase 2 only (required there): the phase-1 output folder (student weights + router.safetensors). "
        "Phase 1 starts the student from the teacher.",
    )
    output_dir: str = Field(
        description="Local folder written at the end: the student as a nemotron_h checkpoint, router.safetensors, "
        "distill.json, history.json and the tokenizer files."
    )
    space: ElasticSpace = Field(description="Elastic axes and their candidate sizes (ElasticSpace fields).")
    budgets: list[Budget] = Field(
        min_length=1,
        description="Trained budgets as {name, total, active}: target fractions of the parent's total and / or active "
        "parameters ('fraction' is the active target); the full budget (1.0) is required.",
    )
    budget_probs: list[float] | None = Field(
        None,
        description="Sampling probability of each budget, largest budget first; must sum to 1. None: uniform in "
        "phase 1, 0.5/0.3/0.2 in phase 2 (three budgets).",
    )
    depth_order: list[int] | None = Field(
        None, description="Layers in the order depth drops them (from the rank stage); None: deepest layers first."
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="Router MLP and sampling schedules.")
    alpha: float = Field(1.0, ge=0, description="Weight of the budget loss against the KD loss.")
    dead_zone: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Relative deviation from a budget's target under which the budget loss is 0 (the method: 0.05).",
    )

    # ------------------------------------------------------------------ data and schedule
    data: DataConfig = Field(
        default_factory=DataConfig,
        description="The training mixture (files, the built-in generator, reasoning-gym tasks), rendered with the "
        "teacher's tokenizer and chat template; see components.data.sources.",
    )
    markers: ReasoningMarkers = Field(
        default_factory=ReasoningMarkers, description="Reasoning markers of the tokenizer (default <think> / </think>)."
    )
    exclude_eval_levels: list[int] = Field(
        default_factory=lambda: [1, 2, 3, 4, 5, 6],
        description="Held-out eval levels whose prompts never enter training (the evaluate stage's problems).",
    )
    exclude_eval_per_level: int = Field(50, ge=0, description="Held-out problems per level to exclude (0: none).")
    exclude_eval_seed: int = Field(0, description="Seed of the held-out eval sets to exclude.")
    steps: int = Field(200, ge=1, description="Optimizer steps of this phase.")
    micro_batch_size: int = Field(8, ge=1, description="Rows per worker per micro-batch.")
    grad_accum_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step, each with its own budget draw, so one update mixes budgets as "
        "the method's per-micro-batch draw does; rows per update = micro_batch_size * num_workers * grad_accum_steps.",
    )
    seq_len: int | None = Field(
        None,
        ge=8,
        description="Tokens per row; phase 2 uses several times the phase-1 length (reported 8k then 49k). "
        f"None: {PHASE_SEQ_LEN[1]} in phase 1, {PHASE_SEQ_LEN[2]} in phase 2 (the demo's lengths).",
    )
    lr: float = Field(
        1e-3, gt=0, description="Peak learning rate of the student weights (~1e-4 at real scale; the demo uses more)."
    )
    router_lr: float = Field(1e-1, gt=0, description="Peak learning rate of the router (~100x the weights' lr).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak (cosine decay).")
    warmup_frac: float = Field(0.01, ge=0, lt=1, description="Share of the steps with a linear lr warmup.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay of matrices (not norms, not the router).")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient norm clip (DeepSpeed gradient_clipping).")
    seed: int = Field(0, ge=0, description="Seeds the data stream, the budget draws and the router noise.")

    # ------------------------------------------------------------------ cluster
    num_workers: int = Field(2, ge=1, description="Ray Train workers (data-parallel ranks).")
    use_gpu: bool = Field(False, description="One GPU per worker and NCCL; CPU workers use gloo.")
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed ZeRO stage (0: plain data parallel).")
    bf16: bool = Field(False, description="Train in bfloat16 (DeepSpeed bf16 with fp32 master weights).")
    kd_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Token rows per chunk of the KD loss, computed from hidden states and the lm_head weights "
        "(model.elastic.kd_chunked): the float32 working set is about 5 x chunk x vocabulary x 4 bytes instead of "
        "several full (tokens x vocabulary) tensors. 0: the reference loss on full logits (same value).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each student block's activations in the backward instead of keeping them "
        "(HybridLM.gradient_checkpointing): same gradients, one more block forward per block.",
    )
    host_heap: HostHeapConfig | None = Field(
        None,
        description="glibc heap settings a CPU worker applies to itself when it starts (components.distill.heap; "
        "GPU workers ignore them). None: at ZeRO-3 the freed gathered layers are returned to the system "
        "(mmap_threshold 131072), below ZeRO-3 glibc's defaults; {}: glibc's defaults at every stage.",
    )
    zero3_gathers: Literal["auto", "coalesced", "per_parameter"] = Field(
        "auto",
        description="How ZeRO-3 gathers a layer: 'coalesced' (DeepSpeed's default: one collective into a flat "
        "buffer, then a copy per parameter) or 'per_parameter' (one collective per parameter, straight into its "
        "buffer: half the memory traffic, more collectives). auto: per_parameter on CPU workers, coalesced on GPUs.",
    )
    checkpoint_every: int = Field(50, ge=1, description="Steps between Ray Train checkpoints (each costs ~1-2 s).")
    max_failures: int = Field(1, ge=-1, description="Worker-group restarts from the last checkpoint (-1: forever).")
    consolidation: TaskResources = Field(
        default_factory=TaskResources,
        description="Resources of the Ray task that consolidates the final checkpoint's shards into output_dir "
        "(components.stage_task.TaskResources: num_cpus, num_gpus, memory_gib, accelerator_type); it reads every "
        "rank's shard tensor by tensor, so size memory_gib for the largest tensor, not the model.",
    )
    consolidation_dir: str | None = Field(
        None,
        description="Local folder on the consolidation task's node that the final checkpoint's files are downloaded "
        "into when storage_path is s3:// (removed after). At ZeRO-3 that is every rank's optimizer file, float32 "
        "weights and both Adam moments together (~12 bytes per parameter: ~380 GB for 31.6B parameters); the task "
        "checks the free disk before downloading. None: the system temporary folder (TMPDIR).",
    )
    storage_path: str | None = Field(
        None,
        description="Ray Train storage for checkpoints: a local folder or s3://bucket/prefix (AWS_* variables and "
        "AWS_ENDPOINT_URL(_S3) are honoured). None: '<output_dir>.ray' beside the output.",
    )
    run_name: str | None = Field(
        None,
        description="Ray Train run name (folder under storage_path; a folder with checkpoints is resumed). "
        "None: 'distill-phase<phase>-<hash of the training fields>'.",
    )

    # ------------------------------------------------------------------ tracking and logs
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI rank 0 logs to (None: taken from the stage's tracker, if any)."
    )
    run_id: str | None = Field(None, description="MLflow run rank 0 logs into (None: the stage tracker's run).")
    experiment: str = Field("star-elastic", description="MLflow experiment of that run.")
    log_every: int = Field(
        10, ge=1, description="Steps between MLflow metric rows (progress lines show the latest row's losses)."
    )

    # ------------------------------------------------------------------ hooks
    step_callback: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="Import path 'package.module:function' of a function every worker calls at the start of every "
        "step as function(config, step, rank, world_size), before the step's work (e.g. a test that kills a "
        "worker mid-run). None: nothing is called.",
    )

    # ------------------------------------------------------------------ validation
    @model_validator(mode="before")
    @classmethod
    def _phase_seq_len(cls, data: Any) -> Any:
        # The phase's default length is filled in before validation (a frozen config is never assigned to);
        # an unknown phase is left for the field's own error.
        if isinstance(data, dict) and data.get("seq_len") is None and data.get("phase", 1) in PHASE_SEQ_LEN:
            return {**data, "seq_len": PHASE_SEQ_LEN[data.get("phase", 1)]}
        return data

    @field_validator("budget_probs")
    @classmethod
    def _probs_valid(cls, probs: list[float] | None) -> list[float] | None:
        if probs is None:
            return None
        if any(p < 0 for p in probs):
            raise ValueError(f"budget_probs must be non-negative, got {probs}")
        if not math.isclose(sum(probs), 1.0, abs_tol=1e-6):
            raise ValueError(f"budget_probs must sum to 1, got {probs} (sum {sum(probs):.6g})")
        return probs

    @model_validator(mode="after")
    def _check(self) -> DistillConfig:
        budget_set = self.budget_set  # sorts and checks names / fractions / the full budget
        if self.budget_probs is not None and len(self.budget_probs) != len(budget_set):
            raise ValueError(
                f"budget_probs has {len(self.budget_probs)} entries but there are {len(budget_set)} budgets "
                f"{budget_set.names} (largest first)"
            )
        if self.phase == 2 and self.budget_probs is None and len(budget_set) not in (1, len(PHASE2_DEFAULT_PROBS)):
            raise ValueError(
                f"phase 2 has a default budget_probs only for {len(PHASE2_DEFAULT_PROBS)} budgets "
                f"({list(PHASE2_DEFAULT_PROBS)}, largest first); set budget_probs for the {len(budget_set)} budgets "
                f"{budget_set.names}"
            )
        if self.phase == 2 and not self.init_from:
            raise ValueError(
                "phase 2 needs init_from: the phase-1 output folder (student weights + router.safetensors); "
                "phase 2 continues phase 1 and never starts from the teacher"
            )
        if self.phase == 1 and self.init_from:
            raise ValueError("init_from is only for phase 2; phase 1 starts the student from teacher_uri")
        if self.router.per_layer and not self.space.per_layer:
            raise ValueError("router.per_layer=True needs space.per_layer=True")
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def budget_set(self) -> BudgetSet:
        """The budgets, sorted largest first (index 0 is the full model)."""
        return BudgetSet(budgets=self.budgets)

    @property
    def sampling_probs(self) -> list[float]:
        """Probability of drawing each budget, largest first (defaults resolved)."""
        n = len(self.budgets)
        if self.budget_probs is not None:
            return list(self.budget_probs)
        if self.phase == 2 and n == len(PHASE2_DEFAULT_PROBS):
            return list(PHASE2_DEFAULT_PROBS)
        return [1.0 / n] * n

    def excluded_prompts(self) -> set[str] | None:
        """Prompts of the generator's held-out eval sets (for every generator source), never trained on;
        None when nothing is excluded."""
        levels, n, seed = self.exclude_eval_levels, self.exclude_eval_per_level, self.exclude_eval_seed
        out: set[str] = set()
        for source in self.data.sources:
            if isinstance(source, GeneratorSource):
                out |= held_out_prompts(levels, n, seed, source.problem_config()) or set()
        return out or None

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup_frac * self.steps))

    @property
    def name(self) -> str:
        """The Ray Train run name: ``run_name``, or ``distill-phase<phase>-<run_key()>``."""
        return self.run_name or f"distill-phase{self.phase}-{self.run_key()}"

    def run_key(self, inputs: str = "") -> str:
        """Hash of every field that changes what is trained (not tracking, logging or storage fields),
        plus ``inputs`` (a fingerprint of the input checkpoints, see :func:`input_fingerprint`).

        Ray Train resumes a run whose folder (storage_path/name) already holds checkpoints. Keying the
        default name by config and inputs makes a re-run of the same phase after a crash resume, and a
        run with changed settings or changed input weights start fresh instead of continuing the old one.
        """
        payload = json.dumps({"config": self.model_dump(mode="json", exclude=_BOOKKEEPING), "inputs": inputs})
        return hashlib.sha256(payload.encode()).hexdigest()[:10]

    def resolved_storage_path(self) -> str:
        """``storage_path``, or an absolute ``<output_dir>.ray`` folder beside the output."""
        if self.storage_path:
            return self.storage_path
        out = Path(self.output_dir).expanduser().resolve()
        return str(out.parent / f"{out.name}.ray")


StepCallback = Callable[["DistillConfig", int, int, int], None]
"""``(config, step, rank, world_size) -> None``, called by every worker at the start of every step."""


def resolve_step_callback(path: str | None) -> StepCallback | None:
    """The function ``DistillConfig.step_callback`` names (``'package.module:function'``); None for None.
    Raises ``ValueError`` naming the field when the module or the function cannot be found."""
    if path is None:
        return None
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"step_callback={path!r}: {err}; name an importable 'package.module:function'") from err
    if not callable(fn):
        raise ValueError(f"step_callback={path!r} is not callable")
    return fn


def preflight(config: DistillConfig) -> HybridConfig:
    """Checks that read files, run on the driver before any worker starts; returns the teacher's config.

    * phase 2: ``init_from`` must exist and hold a student checkpoint with a router;
    * the teacher checkpoint must have a readable ``config.json``;
    * the elastic space must fit the teacher and every budget must be reachable in it;
    * ``step_callback`` must name an importable function.
    """
    resolve_step_callback(config.step_callback)
    from components.storage import fetch_metadata, is_s3

    if config.init_from is not None and not is_s3(config.init_from):
        src = Path(config.init_from)
        if not src.is_dir():
            raise FileNotFoundError(
                f"init_from={config.init_from!r} does not exist; phase 2 starts from the phase-1 output folder"
            )
        missing = [n for n in ("config.json", "router.safetensors") if not (src / n).exists()]
        if missing:
            raise FileNotFoundError(
                f"init_from={config.init_from!r} is not a distillation output (missing {missing}); "
                "pass the phase-1 output_dir"
            )
    try:  # config.json and the tokenizer files only: the weights are the workers' to read
        teacher_dir = fetch_metadata(config.teacher_uri)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"teacher_uri={config.teacher_uri!r}: {err}") from None
    if not (teacher_dir / "config.json").exists():
        raise FileNotFoundError(f"teacher_uri={config.teacher_uri!r} has no config.json (a nemotron_h checkpoint?)")
    model_config = HybridConfig.from_json_file(teacher_dir / "config.json")
    config.space.validate_against(model_config)
    config.budget_set.check_reachable(model_config, config.space, config.depth_order)
    check_data(config.data, teacher_dir, config.markers, model_config.vocab_size, "data")
    return model_config


def _manifest_bytes(uri: str | Path) -> bytes | None:
    """The ``manifest.json`` of the checkpoint at ``uri`` (a folder or an ``s3://`` prefix), read by itself:
    no weight file is downloaded. None when there is none."""
    from components.storage import is_s3, s3_client, split_s3

    if not is_s3(uri):
        path = Path(uri) / "manifest.json"
        return path.read_bytes() if path.exists() else None
    bucket, prefix = split_s3(str(uri))
    client = s3_client()
    try:
        return client.get_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/manifest.json".lstrip("/"))["Body"].read()
    except client.exceptions.NoSuchKey:
        return None


def input_fingerprint(teacher: str | Path, init: str | Path | None) -> str:
    """SHA-256 of the ``manifest.json`` files (per-file hashes) of the teacher and of ``init_from``, folders or
    ``s3://`` prefixes; a copy of a checkpoint has the fingerprint of the original."""
    h = hashlib.sha256()
    for uri in (teacher, init):
        manifest = _manifest_bytes(uri) if uri is not None else None
        if manifest is not None:
            h.update(manifest)
    return h.hexdigest()


def with_run_name(config: DistillConfig) -> DistillConfig:
    """``config`` with ``run_name`` filled in (config and input weights keyed) unless it is set."""
    if config.run_name:
        return config
    key = config.run_key(input_fingerprint(config.teacher_uri, config.init_from))
    return config.model_copy(update={"run_name": f"distill-phase{config.phase}-{key}"})


def with_router_schedule(config: DistillConfig) -> DistillConfig:
    """``config`` with the router schedule's global position filled in, so phase 2 continues phase 1's anneal.

    Phase 1: ``router.schedule_steps`` defaults to ``step_offset + steps`` (the anneal ends with the
    phase unless the config spans both phases). Phase 2: ``router.step_offset`` left at 0 becomes
    where phase 1 ended (its offset + its steps) and an unset ``router.schedule_steps`` becomes phase
    1's, both read from the ``distill.json`` in ``init_from``. The resolved values are what the
    workers use and what this phase's ``distill.json`` records. Runs on the driver.
    """
    rc = config.router
    if config.phase == 2 and config.init_from and (rc.step_offset == 0 or rc.schedule_steps is None):
        from components.storage import fetch_files

        try:  # distill.json only, not the phase-1 weights
            summary = fetch_files(config.init_from, ["distill.json"]) / "distill.json"  # written by the distill stage
        except FileNotFoundError:
            summary = Path(config.init_from) / "distill.json"  # absent: reported below
        if not summary.exists():
            raise FileNotFoundError(
                f"init_from={config.init_from!r} has no distill.json to continue the router schedule from; set "
                "router.step_offset (phase 1's steps) and router.schedule_steps explicitly"
            )
        before = json.loads(summary.read_text())
        prev = RouterConfig.model_validate(before.get("router", {}))
        steps_before = int(before["steps"])
        update: dict[str, int] = {}
        if rc.step_offset == 0:
            update["step_offset"] = prev.step_offset + steps_before
        if rc.schedule_steps is None:
            update["schedule_steps"] = prev.schedule_steps or prev.step_offset + steps_before
        rc = rc.model_copy(update=update)
    if rc.schedule_steps is None:
        rc = rc.model_copy(update={"schedule_steps": rc.step_offset + config.steps})
    return config.model_copy(update={"router": rc})


def to_worker_dict(config: DistillConfig) -> dict[str, Any]:
    """The JSON-safe dict handed to Ray workers (re-validated there)."""
    return config.model_dump(mode="json")
