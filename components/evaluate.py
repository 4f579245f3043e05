"""The evaluate stage: accuracy and latency of every budget, standard and elastic budget control.

Flow: :func:`prepare` (materialize the checkpoint -> load its tokenizer
(:class:`~components.data.tokenizer.TextTokenizer`, with the configured reasoning markers), the parent once
and a weight-sharing view per budget (:class:`~model.decode.budget_view.BudgetRegistry`) -> build the
evaluation sets (JSONL files, local or ``s3://``, and/or the built-in held-out levels;
:mod:`components.eval_sets`) and render every question with the tokenizer's chat template) ->
:func:`run_rows` (for every (think budget, answer budget) pair, thinking cap and table row run
:func:`~model.phases.budget_control` in batches, score, aggregate) -> :mod:`components.eval_report`
(``results.json``, ``results.csv``, ``pareto.png``, the headline metrics) -> log params, metrics and artifacts.

Design choices:

* Standard budget control runs on EVERY budget over the caps, always including the uncapped
  run (that is the per-budget accuracy with full thinking). Elastic pairs are ``"all"`` (every
  pair whose thinking budget is not larger than its answering budget, by active parameters) or
  an explicit list. A plain checkpoint without an ``elastic`` section is one budget, ``"full"``.
* Latency is measured, not modelled: problems of one set are decoded in batches of
  ``batch_size``; each problem is charged its batch's wall time divided by the batch size (both
  phases, re-prefill included). Every budget gets one untimed warm-up call first, so one-time
  costs (lazy initialisation, allocator growth) do not land on whichever pair runs first.
* Deterministic for a fixed seed: problems come from files or seeded generators, decoding is greedy
  by default, and sampling seeds each problem as a request seeded ``seed`` (:mod:`model.request_plan`'s
  rule, the server's), so its tokens do not depend on ``batch_size`` or on its place in a batch.
  Latencies are wall times and vary run to run.
* Thinking caps count tokens between the markers; a marker the tokenizer splits into several
  tokens is handled by :mod:`model.phases` (appended whole, detected as a suffix).
* An answer is read from the answer phase's text by :class:`~components.data.answers.AnswerReader`
  with the set's ``answer_format`` (``prefix "A:"`` for the demo, ``boxed``, ``hash``, ``regex``,
  ``last_number``); anything unexpected (no answer, garbage, an exception) counts as wrong.
* Defaults are sized for a real reasoning model (thousands of thinking tokens, bf16 on a GPU when
  there is one); the demo config sets its own small limits.
* In the pipeline the stage runs as a Ray task with ``resources`` (:mod:`components.stage_task`): a
  task with a GPU evaluates on cuda in bfloat16 (``device``/``dtype`` auto), a CPU task on cpu in
  float32; progress is one line the driver draws on a terminal, else plain lines (:mod:`components.progress`).
* ``carry_state_compare`` reruns every elastic pair with Mamba/KV state carried from the thinking
  budget instead of re-prefilling, and reports accuracy and latency deltas (and any fallback).
* :func:`~components.eval_plots.best_elastic_vs_standard` compares each elastic pair's curve with
  standard control on the full budget along interpolated Pareto fronts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from components.data.answers import AnswerFormat, AnswerReader
from components.data.tokenizer import ReasoningMarkers, TextTokenizer
from components.eval_report import build_results, cap_label, headline_metrics, write_results
from components.eval_sets import EvalItem, EvalSetConfig, builtin_items, load_eval_set, thinking_prompt
from components.progress import progress_bar
from components.stage_task import TaskResources
from components.tracking import NullTracker, Tracker
from model.decode.budget_view import BudgetRegistry
from model.generate import SamplingParams
from model.phases import PhaseResult, PhaseTokens, budget_control

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_LEVELS = [1, 2, 3, 4, 5, 6]


class EvalConfig(BaseModel):
    """Settings of the evaluate stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # resolved once, then only read

    checkpoint_uri: str = Field(
        description="Nested checkpoint folder or s3:// prefix: config.json (with an 'elastic' section listing the "
        "budgets; without one the checkpoint is a single budget 'full'), weights and the tokenizer files beside them."
    )
    eval_sets: list[EvalSetConfig] = Field(
        default_factory=list,
        description="JSONL evaluation sets (a path, or {path, answer_field, group_by, answer_format, ...}); "
        "rows hold prompt (str) or messages (chat) and a reference answer.",
    )
    levels: list[int] | None = Field(
        None,
        description="Built-in generator's held-out levels (reasoning steps). null: [1..6] when eval_sets is "
        "empty, none otherwise; []: none.",
    )
    n_per_level: int = Field(50, ge=1, description="Held-out built-in problems per level.")
    seed: int = Field(0, description="Seed of the built-in problems and of sampling.")
    answer_format: AnswerFormat = Field(
        default_factory=AnswerFormat,
        description="How to read the model's answer: {kind: prefix|boxed|hash|regex|last_number, prefix, pattern, "
        "fallback_last_number}; the default is the demo's 'A:' prefix. An eval set may override it.",
    )
    markers: ReasoningMarkers = Field(
        default_factory=ReasoningMarkers,
        description="Reasoning markers (think_open, think_close) as the tokenizer spells them; special tokens or "
        "token sequences.",
    )
    open_think: bool = Field(
        True,
        description="Append the think_open marker to a rendered prompt whose chat template does not end with it "
        "(budget control decodes the thinking first).",
    )
    think_caps: list[int | None] = Field(
        default_factory=lambda: [0, 256, 512, 1024, 2048, None],
        description="Thinking caps in tokens between the markers (0: answer directly; null: no cap, up to "
        "think_limit).",
    )
    elastic_pairs: Literal["all"] | list[tuple[str, str]] = Field(
        "all",
        description="(think budget, answer budget) pairs: 'all' = every pair with think <= answer, "
        "or an explicit list of [think, answer] names.",
    )
    allow_think_larger: bool = Field(False, description="Allow explicit pairs whose think budget is the larger one.")
    carry_state_compare: bool = Field(
        False, description="Also run elastic pairs carrying Mamba/KV state instead of re-prefilling, and compare."
    )
    max_answer_tokens: int = Field(1024, ge=1, description="Most tokens of the answer phase.")
    think_limit: int = Field(4096, ge=1, description="Most thinking tokens when the cap is null.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass when sampling.")
    batch_size: int = Field(32, ge=1, description="Problems decoded together; latency = batch wall time / batch.")
    output_dir: str = Field("runs/evaluate", description="Local folder for results.json, results.csv and the plot.")
    device: str = Field("auto", description="torch device of the model; auto: cuda when present, else cpu.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype; auto: bfloat16 on CUDA, float32 otherwise."
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: leave as is).")
    progress: bool = Field(True, description="Show a progress bar.")
    resources: TaskResources = Field(
        default_factory=TaskResources,
        description="The Ray task the pipeline's evaluate stage runs in (components.stage_task.TaskResources): a GPU "
        "(num_gpus: 1) with device auto evaluates on cuda in bfloat16; a CPU task (the default) on cpu in float32. "
        "A direct run_evaluate call runs in its own process and ignores it.",
    )

    @field_validator("eval_sets", mode="before")
    @classmethod
    def _paths(cls, sets: Any) -> Any:
        # a bare string is a path with the default field names
        return [{"path": s} if isinstance(s, str) else s for s in sets] if isinstance(sets, list) else sets

    @field_validator("think_caps")
    @classmethod
    def _caps(cls, caps: list[int | None]) -> list[int | None]:
        if not caps:
            raise ValueError("think_caps: give at least one cap (null = no cap)")
        for i, c in enumerate(caps):
            if c is not None and c < 0:
                raise ValueError(f"think_caps[{i}]: a thinking cap must be >= 0 or null, got {c}")
        if len(set(caps)) != len(caps):
            raise ValueError(f"think_caps: repeated caps in {caps}")
        return caps

    @field_validator("levels")
    @classmethod
    def _levels(cls, levels: list[int] | None) -> list[int] | None:
        bad = [lv for lv in levels or [] if lv < 1]
        if bad:
            raise ValueError(f"levels: every level is a number of steps >= 1, got {bad}")
        return levels

    @model_validator(mode="after")
    def _some_problems(self) -> EvalConfig:
        if not self.builtin_levels and not self.eval_sets:
            raise ValueError("levels / eval_sets: nothing to evaluate; give JSONL eval_sets or built-in levels")
        return self

    @property
    def builtin_levels(self) -> list[int]:
        """The built-in levels evaluated (``levels`` null: the default levels when no eval_sets)."""
        if self.levels is None:
            return [] if self.eval_sets else list(DEFAULT_LEVELS)
        return list(self.levels)

    def resolved_device(self) -> str:
        """``device`` with auto resolved: cuda when available, else cpu."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> torch.dtype:
        """``dtype`` with auto resolved: bfloat16 on a CUDA device, float32 otherwise."""
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(self.resolved_device()).type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


class EvalOutputs(BaseModel):
    """What the stage produced (local paths), its headline metrics and the elastic-vs-standard comparison."""

    results_json: str
    results_csv: str
    plot_png: str
    metrics: dict[str, float]
    comparison: dict[str, Any]


# ---------------------------------------------------------------------- inputs
def problem_sets(config: EvalConfig) -> dict[str, list[EvalItem]]:
    """Table label -> items: JSONL sets (by name, or ``name/group`` per group) and built-in levels
    (``"1"``, ``"2"``, ...); see :mod:`components.eval_sets` for labels and row layouts."""
    levels = config.builtin_levels
    single = len(config.eval_sets) + (1 if levels else 0) == 1
    sets: dict[str, list[EvalItem]] = {}
    for i, cfg in enumerate(config.eval_sets):
        for label, items in load_eval_set(cfg, config.answer_format, prefix=not single, index=i).items():
            if label in sets:
                raise ValueError(f"eval_sets[{i}]: label {label!r} is used twice; give the set another name")
            sets[label] = items
    for label, items in builtin_items(levels, config.n_per_level, config.seed, config.answer_format).items():
        if label in sets:
            raise ValueError(f"levels: label {label!r} is also an eval set's label; give the set another name")
        sets[label] = items
    return sets


def resolve_pairs(config: EvalConfig, registry: BudgetRegistry) -> list[tuple[str, str]]:
    """Standard pairs (b, b) for every budget, then the elastic pairs; clear errors for bad names."""
    names = registry.names
    size = registry.active_params
    pairs = [(b, b) for b in names]
    if config.elastic_pairs == "all":
        pairs += [(t, a) for a in names for t in names if t != a and size[t] <= size[a]]
        return pairs
    for i, (think, answer) in enumerate(config.elastic_pairs):
        for j, name in ((0, think), (1, answer)):
            if name not in registry:
                role = "think" if j == 0 else "answer"
                raise ValueError(f"elastic_pairs[{i}][{j}]: unknown {role} budget {name!r}; valid budgets {names}")
        if size[think] > size[answer] and not config.allow_think_larger:
            raise ValueError(
                f"elastic_pairs[{i}]: think budget {think!r} is larger than answer budget {answer!r}; "
                "set allow_think_larger: true to evaluate it"
            )
        if (think, answer) not in pairs:
            pairs.append((think, answer))
    return pairs


# ---------------------------------------------------------------------- scoring
def score(item: EvalItem, result: PhaseResult, reader: AnswerReader | None = None) -> bool:
    """Whether the answer phase holds the reference answer; never raises (anything odd is wrong).

    ``reader``: markers and stop tokens (a tokenizer's, :meth:`AnswerReader.for_tokenizer`); its
    format is replaced by the item's ``answer_format``. Default: the demo's special tokens.
    """
    try:
        base = reader or AnswerReader()
        return base.with_format(getattr(item, "answer_format", None)).is_correct(result.answer_text, item.answer)
    except Exception:  # a scorer must not stop an evaluation over one odd output
        return False


def _aggregate(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    n = sum(p["n"] for p in parts)
    out: dict[str, Any] = {"n": n}
    for key in ("accuracy", "mean_latency_s", "mean_weight_passes", "mean_think_tokens", "mean_answer_tokens",
                "mean_think_generated", "mean_answer_fed"):  # fmt: skip
        out[key] = sum(p[key] * p["n"] for p in parts) / n if n else 0.0
    return out


def weight_passes(result: PhaseResult, think_share: float, answer_share: float) -> float:
    """Latency proxy of one request where reading the weights dominates (large models, small batches):
    forward passes weighted by the active-parameter share of the budget that runs them, in full-model
    passes. The thinking phase runs ``1 + think_generated`` passes (a prefill, then one per decoded
    token) on the think budget; the answer phase one pass for what it has to feed (a re-prefill or the
    rest of a continued row), then one per answer token except the first, on the answer budget.
    """
    answer_passes = (1 if result.answer_fed else 0) + max(len(result.answer_tokens) - 1, 0)
    return (1 + result.think_generated) * think_share + answer_passes * answer_share


def _summarize(
    items: Sequence[EvalItem],
    results: Sequence[PhaseResult],
    think_share: float = 1.0,
    answer_share: float = 1.0,
    reader: AnswerReader | None = None,
) -> dict[str, Any]:
    n = len(results)
    return {
        "n": n,
        "accuracy": sum(score(p, r, reader) for p, r in zip(items, results, strict=True)) / n,
        "mean_latency_s": sum(r.seconds for r in results) / n,
        "mean_weight_passes": sum(weight_passes(r, think_share, answer_share) for r in results) / n,
        "mean_think_tokens": sum(len(r.think_tokens) for r in results) / n,
        "mean_answer_tokens": sum(len(r.answer_tokens) for r in results) / n,
        "mean_think_generated": sum(r.think_generated for r in results) / n,
        "mean_answer_fed": sum(r.answer_fed for r in results) / n,
    }


# ---------------------------------------------------------------------- the stage
def load_tokenizer(folder: Path, markers: ReasoningMarkers) -> TextTokenizer:
    """The checkpoint's tokenizer; a clear error naming ``checkpoint_uri`` when it cannot be loaded."""
    try:
        return TextTokenizer.load(folder, markers)
    except Exception as err:  # transformers raises OSError, ValueError, ...: say where and what
        raise ValueError(
            f"checkpoint_uri: cannot load the tokenizer beside the checkpoint in {folder} "
            f"({type(err).__name__}: {err}); write tokenizer.json and tokenizer_config.json there"
        ) from None


@dataclass(frozen=True)
class EvalSetup:
    """What every run of the stage reads (:func:`prepare`): budgets, problems, rendered prompts, decoding settings."""

    registry: BudgetRegistry
    """The parent once and a weight-sharing view per budget, largest first."""
    pairs: list[tuple[str, str]]
    """(think budget, answer budget): the standard pairs first, then the elastic ones."""
    sets: dict[str, list[EvalItem]]
    """Table label -> problems."""
    prompts: dict[str, list[list[int]]]
    """Table label -> each problem rendered with the chat template (token ids)."""
    tokens: PhaseTokens
    reader: AnswerReader
    sampling: SamplingParams
    resolved: dict[str, str]
    """The device and dtype ``auto`` resolved to (logged beside the config)."""


@dataclass(frozen=True)
class EvalRun:
    """One run of the table: a pair, a thinking cap (None: up to ``think_limit``), carried state or re-prefill."""

    think: str
    answer: str
    cap: int | None
    carry: bool


def prepare(config: EvalConfig) -> EvalSetup:
    """Materialize the checkpoint, load its tokenizer, build the problem sets (before the weights: a bad eval set
    fails in seconds), load the budgets and resolve the pairs."""
    from components.storage import materialize

    folder = materialize(config.checkpoint_uri)
    tok = load_tokenizer(folder, config.markers)
    sets = problem_sets(config)
    device, dtype = config.resolved_device(), config.resolved_dtype()
    registry = BudgetRegistry.from_checkpoint(folder, dtype=dtype, device=device)
    prompts = {
        label: [thinking_prompt(tok, it.messages, config.open_think) for it in items] for label, items in sets.items()
    }
    return EvalSetup(
        registry=registry,
        pairs=resolve_pairs(config, registry),
        sets=sets,
        prompts=prompts,
        tokens=PhaseTokens.from_tokenizer(tok),
        reader=AnswerReader.for_tokenizer(config.answer_format, tok),
        sampling=SamplingParams(temperature=config.temperature, top_p=config.top_p, seed=config.seed),
        resolved={"device": device, "dtype": str(dtype).removeprefix("torch.")},
    )


def eval_runs(config: EvalConfig, pairs: Sequence[tuple[str, str]]) -> list[EvalRun]:
    """Every run of the table: each pair at each cap (a standard pair also uncapped: each budget's accuracy
    with full thinking), an elastic pair also with carried state when ``carry_state_compare``."""
    runs: list[EvalRun] = []
    for think, answer in pairs:
        caps = list(config.think_caps)
        if think == answer and None not in caps:
            caps.append(None)
        carries = [False, True] if config.carry_state_compare and think != answer else [False]
        runs += [EvalRun(think, answer, cap, carry) for cap in caps for carry in carries]
    return runs


def decode_set(config: EvalConfig, setup: EvalSetup, run: EvalRun, label: str) -> list[PhaseResult]:
    """Budget control of ``run`` on every problem of set ``label``, ``batch_size`` problems at a time."""
    prompts, outs = setup.prompts[label], []
    for s in range(0, len(prompts), config.batch_size):
        outs += budget_control(
            setup.registry, run.think, run.answer, setup.tokens, prompts[s : s + config.batch_size], run.cap,
            config.max_answer_tokens, setup.sampling, carry_state=run.carry,
            allow_think_larger=config.allow_think_larger, think_limit=config.think_limit,
        )  # fmt: skip
    return outs


def run_rows(config: EvalConfig, setup: EvalSetup) -> list[dict[str, Any]]:
    """Decode and score every run on every set: a row per (run, level) and one over all levels per run.
    Every budget first gets one untimed warm-up call, so one-time costs land on no pair's latency."""
    registry, first = setup.registry, next(iter(setup.prompts.values()))[:1]
    for name in registry.names:
        budget_control(registry, name, name, setup.tokens, first, 2, 2, setup.sampling, think_limit=config.think_limit)
    full_active = registry.active_params[registry.names[0]]
    runs = eval_runs(config, setup.pairs)
    bar = progress_bar(len(runs) * len(setup.sets), "evaluate", unit="run", disable=not config.progress)
    rows: list[dict[str, Any]] = []
    for run in runs:
        shares = (registry.active_params[run.think] / full_active, registry.active_params[run.answer] / full_active)
        per_level, notes = [], set()
        for label, problems in setup.sets.items():
            outs = decode_set(config, setup, run, label)
            notes.update(r.carry_note for r in outs if r.carry_note)
            per_level.append({"level": label, **_summarize(problems, outs, *shares, reader=setup.reader)})
            bar.update(1)
            bar.set_postfix(pair=f"{run.think}->{run.answer}", cap=cap_label(run.cap))
        key = {
            "think_budget": run.think,
            "answer_budget": run.answer,
            "control": "standard" if run.think == run.answer else "elastic",
            "carry_state": run.carry,
            "think_cap": run.cap,
        }
        note = {"carry_note": sorted(notes)[0]} if notes else {}
        rows += [{**key, **lv, **note} for lv in per_level]
        rows.append({**key, "level": "all", **_aggregate(per_level), **note})
    bar.close()
    return rows


def run_evaluate(config: EvalConfig, tracker: Tracker | None = None) -> EvalOutputs:
    """Run the stage (module docstring): :func:`prepare`, :func:`run_rows`, then the results document, its files
    and metrics (:mod:`components.eval_report`), logged through ``tracker``."""
    tracker = tracker or NullTracker()
    if config.threads:
        torch.set_num_threads(config.threads)
    setup = prepare(config)
    logged = {**config.model_dump(mode="json"), **setup.resolved}
    tracker.log_params({"evaluate": logged, "budgets": setup.registry.active_params})
    rows = run_rows(config, setup)
    levels = {label: len(items) for label, items in setup.sets.items()}
    results = build_results(logged, setup.registry.active_params, levels, rows, config.carry_state_compare)
    paths = write_results(results, Path(config.output_dir))
    metrics = headline_metrics(results)
    tracker.log_metrics(metrics)
    for kind in ("json", "csv", "plot", "proxy_plot"):
        tracker.log_artifact(paths[kind], "evaluate")
    comparison = results["comparison"]
    if comparison.get("best_pair"):
        tracker.set_tags({"evaluate.best_elastic_pair": comparison["best_pair"]})
    return EvalOutputs(
        results_json=str(paths["json"]),
        results_csv=str(paths["csv"]),
        plot_png=str(paths["plot"]),
        metrics=metrics,
        comparison=comparison,
    )
