"""The quantize stage: FP8 and NVFP4 copies of the nested checkpoint, their accuracy recovery and size.

Flow: materialize the nested checkpoint -> build calibration batches -> per format, quantize the
whole nested checkpoint ONCE (:func:`model.quant.quantize_checkpoint`; every budget stays
extractable from it) -> evaluate every budget of the quantized checkpoint -> recovery table
(quantized accuracy / unquantized accuracy per budget) and size table (bytes on disk) ->
``recovery.json`` / ``recovery.csv`` / ``sizes.json`` / ``sizes.csv`` -> log params, metrics and
artifacts.

Design choices:

* Calibration data: when the checkpoint carries the project's tokenizer, batches of the built-in
  reasoning problems (what the model is evaluated on, in the distribution it was trained on);
  otherwise seeded random token ids, which only bound activation ranges loosely. FP8 and NVFP4 W4A4
  use them (static activation scales), and any format the FP8 KV-cache scales of a preset asking for
  them; NVFP4 (W4A16) alone needs none.
* Evaluation is pluggable. ``evaluate_fn(checkpoint_dir) -> {budget: accuracy}`` is used when
  given (tests pass a stub; any harness can be plugged in); otherwise the ``evaluate`` section is
  passed to :func:`components.evaluate.run_evaluate` with ``checkpoint_uri`` (and ``output_dir``)
  overridden, and the accuracy of each budget with full thinking is read from its results. With
  neither, no accuracy is measured and the recovery table is empty (sizes are still reported).
* The baseline is the unquantized checkpoint's accuracy from the evaluate stage
  (``baseline_accuracy``); when it is missing and an evaluator exists, the source checkpoint is
  evaluated here with the same evaluator so the ratio compares like with like.
* Tensors kept in high precision are written in bfloat16 by default (``dense_dtype``), as in the
  checkpoints serving engines load, so the recovery compares against a bf16-like baseline and the
  sizes are those a deployment would store.
* In the pipeline the stage runs as one Ray task with ``resources`` (:mod:`components.stage_task`):
  quantizing loads the whole checkpoint and evaluating runs it, so the task carries the model's
  memory and, to evaluate on cuda in bfloat16, a GPU; the evaluation runs inside that task. The FP8
  calibration forwards run on that GPU too when the task reserves one (:func:`calibration_device`);
  quantizing and writing stay on the CPU.
* Sizes: bytes of the safetensors files actually on disk (all budgets in one file), next to the
  source checkpoint's bytes and the bf16 size of the same tensors (the usual reference), with
  bits per parameter. The reported method lands at 97-100% recovery; a tiny demo model quantizes
  worse (few, narrow weights), so no threshold is enforced here: the promotion gate decides.
"""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open

from components.data import DataConfig, ReasoningMarkers
from components.progress import progress_bar
from components.stage_task import TaskResources
from components.tracking import NullTracker, Tracker

EvaluateFn = Callable[[str], dict[str, float]]
"""``evaluate_fn(checkpoint_dir) -> {budget name: accuracy}``."""

RECOVERY_JSON = "recovery.json"
RECOVERY_CSV = "recovery.csv"
SIZES_JSON = "sizes.json"
SIZES_CSV = "sizes.csv"


class QuantCalibrationConfig(BaseModel):
    """Data the FP8 activation scales are calibrated on."""

    model_config = ConfigDict(extra="forbid")

    num_batches: int = Field(4, ge=1, description="Calibration forward passes (per budget when per_budget).")
    batch_size: int = Field(8, ge=1, description="Sequences per calibration batch.")
    seq_len: int = Field(128, ge=8, description="Tokens per calibration sequence.")
    seed: int = Field(4321, description="Seed of the calibration data (kept apart from training seeds).")
    per_budget: bool = Field(
        True, description="Also calibrate under every budget's mask; the per-tensor scale covers all budgets."
    )
    data: DataConfig = Field(
        default_factory=lambda: DataConfig(pack=True),
        description="Calibration mixture (same format as distillation), rendered with the checkpoint's tokenizer.",
    )
    markers: ReasoningMarkers = Field(default_factory=ReasoningMarkers, description="Reasoning markers.")


class QuantizeConfig(BaseModel):
    """Settings of the quantize stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # resolved once, then only read

    checkpoint_uri: str = Field(description="The nested (unquantized) checkpoint folder or s3:// prefix.")
    output_dir: str = Field("runs/quantize", description="Local folder: one sub-folder per format, tables beside.")
    formats: list[Literal["fp8", "nvfp4", "nvfp4_w4a4"]] = Field(
        default_factory=lambda: ["fp8", "nvfp4", "nvfp4_w4a4"],
        min_length=1,
        description="Formats to produce: fp8 (W8A8, quant_algo FP8), nvfp4 (weight-only, W4A16_NVFP4), "
        "nvfp4_w4a4 (NVFP4 weights and activations, quant_algo NVFP4).",
    )
    preset: Literal["default", "conservative", "all", "nemotron-nano"] = Field(
        "default",
        description="default: attention projections stay high precision; conservative: Mamba in/out_proj too; "
        "all: only lm_head, embeddings, norms and routers (always kept) stay high precision; nemotron-nano: "
        "NVIDIA's published Nemotron 3 Nano NVFP4 recipe (attention and the Mamba layers feeding it kept, FP8 "
        "KV-cache scales).",
    )
    dense_dtype: Literal["bfloat16", "source"] = Field(
        "bfloat16",
        description="dtype of the tensors kept in high precision (embeddings, norms, routers, lm_head, kept "
        "projections): bfloat16 as serving engines load them, or the source checkpoint's dtype.",
    )
    calibration: QuantCalibrationConfig = Field(
        default_factory=QuantCalibrationConfig, description="FP8 activation calibration data."
    )
    evaluate: dict[str, Any] | None = Field(
        None,
        description="An evaluate-stage section (components.evaluate.EvalConfig fields); checkpoint_uri and "
        "output_dir are set per format. null: no accuracy unless an evaluate_fn is passed.",
    )
    baseline_accuracy: dict[str, float] = Field(
        default_factory=dict, description="Budget -> accuracy of the unquantized checkpoint (from the evaluate stage)."
    )
    evaluate_baseline: bool = Field(
        True, description="Evaluate the unquantized checkpoint here when baseline_accuracy misses a budget."
    )
    resources: TaskResources = Field(
        default_factory=TaskResources,
        description="The Ray task the pipeline's quantize stage runs in (components.stage_task.TaskResources). It "
        "loads the checkpoint and runs the FP8 calibration and the evaluation of every format, so it needs the "
        "model's memory, and a GPU (num_gpus: 1) to evaluate on cuda.",
    )


class QuantizeOutputs(BaseModel):
    """What the stage produced (local paths) and its headline figures."""

    checkpoints: dict[str, str] = Field(description="Format -> quantized nested checkpoint folder.")
    recovery: list[dict[str, Any]] = Field(description="Rows: format, budget, baseline, quantized, recovery.")
    recovery_by_format: dict[str, dict[str, float | None]] = Field(
        description="Format -> budget -> recovery (quantized / baseline accuracy); the table's last column."
    )
    sizes: list[dict[str, Any]] = Field(description="Rows: name, bytes, ratio_to_bf16, bits_per_param.")
    recovery_json: str
    recovery_csv: str
    sizes_json: str
    sizes_csv: str
    metrics: dict[str, float]


# ---------------------------------------------------------------------- inputs
def calibration_device(resources: TaskResources, cuda_available: bool) -> str:
    """Where the FP8 calibration forwards run: ``"cuda"`` when the stage's task reserves a GPU
    (``resources.num_gpus > 0``) and one is visible (``cuda_available``: ``torch.cuda.is_available()`` inside
    the task), else ``"cpu"``. A task without a reserved GPU never uses one that happens to be on its node; a
    reserved GPU that torch cannot see falls back to the CPU with a warning naming ``quantize.resources``."""
    if resources.num_gpus <= 0:
        return "cpu"
    if not cuda_available:
        warnings.warn(
            f"quantize.resources reserves {resources.num_gpus} GPU(s) but torch sees none "
            "(torch.cuda.is_available() is False): calibrating on the CPU",
            stacklevel=2,
        )
        return "cpu"
    return "cuda"


def calibration_batches(folder: Path, vocab_size: int, cfg: QuantCalibrationConfig) -> list[torch.Tensor]:
    """Token batches (batch_size, seq_len) of ``cfg.data`` rendered with the checkpoint's tokenizer.

    A checkpoint without tokenizer files (a bare test checkpoint) calibrates on random ids, with a
    warning: its scales then only cover the weights' own range.
    """
    from components.data import make_data_batch
    from components.data.checks import check_data
    from model.layout import tokenizer_files

    if tokenizer_files(folder):
        tok = check_data(cfg.data, folder, cfg.markers, vocab_size, "quantize.calibration.data")
        return [
            make_data_batch(
                cfg.data, tok, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, phase="quantize", step=i
            ).input_ids
            for i in range(cfg.num_batches)
        ]
    warnings.warn(f"{folder} has no tokenizer files: FP8 activation scales are calibrated on random ids", stacklevel=2)
    g = torch.Generator().manual_seed(cfg.seed)
    return [torch.randint(0, vocab_size, (cfg.batch_size, cfg.seq_len), generator=g) for _ in range(cfg.num_batches)]


def _default_evaluator(section: dict[str, Any], out_root: Path, tracker: Tracker) -> EvaluateFn:
    """``run_evaluate`` on a checkpoint folder; accuracy per budget with full thinking."""

    def evaluate(checkpoint_dir: str) -> dict[str, float]:
        from components.evaluate import EvalConfig, run_evaluate

        name = Path(checkpoint_dir).name
        cfg = EvalConfig(**{**section, "checkpoint_uri": checkpoint_dir, "output_dir": str(out_root / f"eval-{name}")})
        with tracker.child(f"evaluate-{name}") as sub:
            outputs = run_evaluate(cfg, sub)
        results = json.loads(Path(outputs.results_json).read_text(encoding="utf-8"))
        return {b: float(acc["all"]) for b, acc in results["accuracy_per_budget"].items()}

    return evaluate


# ---------------------------------------------------------------------- tables
def safetensors_bytes(folder: Path) -> int:
    """Bytes of the weight files on disk (every budget lives in these files)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _tensor_stats(folder: Path) -> tuple[int, int]:
    """(bf16 bytes of the tensors: 2 per floating element, own size otherwise; parameter count)."""
    bf16, params = 0, 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                t = fh.get_slice(key)
                numel = 1
                for n in t.get_shape():
                    numel *= n
                floating = t.get_dtype() in ("F64", "F32", "F16", "BF16")
                bf16 += 2 * numel if floating else numel * _itemsize(t.get_dtype())
                if not key.endswith("e_score_correction_bias"):
                    params += numel
    return bf16, params


def _itemsize(dtype: str) -> int:
    return {"I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}.get(dtype, 4)


def size_table(source: Path, quantized: dict[str, Path]) -> list[dict[str, Any]]:
    """Rows: source checkpoint, bf16 reference, then each format; bytes, ratio to bf16, bits per parameter."""
    bf16, params = _tensor_stats(source)
    rows = [
        {"name": "source", "bytes": safetensors_bytes(source), "measured": True},
        {"name": "bf16", "bytes": bf16, "measured": False},
    ]
    rows += [{"name": fmt, "bytes": safetensors_bytes(path), "measured": True} for fmt, path in quantized.items()]
    for r in rows:
        r["ratio_to_bf16"] = r["bytes"] / bf16 if bf16 else None
        r["bits_per_param"] = 8 * r["bytes"] / params if params else None
    return rows


def recovery_table(baseline: dict[str, float], quantized: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Rows per (format, budget): baseline accuracy, quantized accuracy, their ratio (None if baseline is 0)."""
    rows = []
    for fmt, accs in quantized.items():
        for budget, acc in accs.items():
            base = baseline.get(budget)
            ratio = acc / base if base else None
            rows.append({"format": fmt, "budget": budget, "baseline": base, "quantized": acc, "recovery": ratio})
    return rows


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        fields = list(rows[0]) if rows else ["format", "budget", "baseline", "quantized", "recovery"]
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------- the stage
def run_quantize(
    config: QuantizeConfig, tracker: Tracker | None = None, evaluate_fn: EvaluateFn | None = None
) -> QuantizeOutputs:
    """Run the stage (module docstring); returns checkpoint folders, tables and metrics."""
    from components.storage import materialize
    from model.config import HybridConfig
    from model.quant import quantize_checkpoint

    tracker = tracker or NullTracker()
    source = materialize(config.checkpoint_uri)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tracker.log_params({"quantize": config.model_dump(mode="json")})
    model_config = HybridConfig.from_json_file(source / "config.json")
    batches = []
    from model.quant import QUANT_PRESETS

    if set(config.formats) - {"nvfp4"} or QUANT_PRESETS[config.preset].kv_cache:  # static activation / KV scales
        batches = calibration_batches(source, model_config.vocab_size, config.calibration)

    device = calibration_device(config.resources, torch.cuda.is_available()) if batches else "cpu"
    if evaluate_fn is None and config.evaluate is not None:
        evaluate_fn = _default_evaluator(config.evaluate, out, tracker)
    # one step per format quantized and per format evaluated (the source, when needed, adds one)
    bar = progress_bar(len(config.formats) * (2 if evaluate_fn is not None else 1), "quantize", unit="step")
    checkpoints: dict[str, Path] = {}
    for fmt in config.formats:
        bar.set_postfix(now=f"quantizing {fmt}")
        checkpoints[fmt] = quantize_checkpoint(
            source,
            out / fmt,
            fmt,
            config.preset,
            batches,
            calibrate_budgets=config.calibration.per_budget,
            dense_dtype=torch.bfloat16 if config.dense_dtype == "bfloat16" else None,
            device=device,
        )
        bar.update(1)

    baseline = dict(config.baseline_accuracy)
    quantized_acc: dict[str, dict[str, float]] = {}
    if evaluate_fn is not None:
        for fmt, path in checkpoints.items():
            bar.set_postfix(now=f"evaluating {fmt}")
            quantized_acc[fmt] = evaluate_fn(str(path))
            bar.update(1)
        needed = {b for accs in quantized_acc.values() for b in accs}
        if config.evaluate_baseline and not needed <= set(baseline):
            bar.set_postfix(now="evaluating the unquantized checkpoint")
            measured = evaluate_fn(str(source))
            baseline.update({b: a for b, a in measured.items() if b not in baseline})
    bar.set_postfix()
    bar.close()

    recovery = recovery_table(baseline, quantized_acc)
    sizes = size_table(source, checkpoints)
    files = {
        RECOVERY_JSON: json.dumps({"baseline": baseline, "rows": recovery}, indent=2),
        SIZES_JSON: json.dumps({"rows": sizes}, indent=2),
    }
    for name, text in files.items():
        (out / name).write_text(text + "\n", encoding="utf-8")
    _write_csv(recovery, out / RECOVERY_CSV)
    _write_csv(sizes, out / SIZES_CSV)

    metrics: dict[str, float] = {}
    for r in recovery:
        metrics[f"acc/{r['format']}/{r['budget']}"] = r["quantized"]
        if r["recovery"] is not None:
            metrics[f"recovery/{r['format']}/{r['budget']}"] = r["recovery"]
    for r in sizes:
        metrics[f"bytes/{r['name']}"] = float(r["bytes"])
        if r["bits_per_param"] is not None:
            metrics[f"bits_per_param/{r['name']}"] = r["bits_per_param"]
    tracker.log_metrics(metrics)
    for name in (RECOVERY_JSON, RECOVERY_CSV, SIZES_JSON, SIZES_CSV):
        tracker.log_artifact(out / name, "quantize")
    return QuantizeOutputs(
        checkpoints={fmt: str(p) for fmt, p in checkpoints.items()},
        recovery=recovery,
        recovery_by_format={
            fmt: {r["budget"]: r["recovery"] for r in recovery if r["format"] == fmt} for fmt in checkpoints
        },
        sizes=sizes,
        recovery_json=str(out / RECOVERY_JSON),
        recovery_csv=str(out / RECOVERY_CSV),
        sizes_json=str(out / SIZES_JSON),
        sizes_csv=str(out / SIZES_CSV),
        metrics=metrics,
    )
