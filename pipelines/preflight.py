"""Everything checked before a pipeline starts: ``star-elastic run`` and ``run --dry-run`` share it.

Design choices:

* Problems are collected, never raised one at a time, and each is one line ``yaml.path: message``
  (a ``--set`` or ``--only`` problem names the flag), so a bad config is fixed in one edit.
* After the config itself (:func:`pipelines.config.load_pipeline_config`) come, in order: every
  stage's config built from its section (the stage class's cross-field checks, e.g. budget
  probabilities against the budgets), the elastic space and budgets against the parent's
  architecture (a local parent's ``config.json``, or ``parent.train.architecture`` when the parent
  is trained here; an s3:// parent is checked by the rank stage, which reads it), the URIs, and the
  stage names given to ``--only`` / ``--from``.
* Every stage's config is built once (:func:`pipelines.runner.resolve_configs`) and handed on in a
  frozen :class:`Preflight`, so ``run`` plans and runs the very configs that were checked.
* Nothing here starts Ray, opens MLflow or writes a file.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model.config import HybridConfig
from pipelines.config import FILLED, ConfigError, PipelineConfig, describe, load_pipeline_config
from pipelines.runner import PipelineRunner, StageSpec, resolve_configs


def _yaml_location(section: str, loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A stage-config error location -> its YAML location (a field filled from another path goes there)."""
    source = FILLED.get(section, {}).get(loc[0]) if loc else None
    if source is not None and source.split(".")[0] in PipelineConfig.model_fields:
        return (*source.split("."), *loc[1:])
    return (section, *loc)


def _one_line(err: BaseException) -> str:
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


class Preflight(BaseModel):
    """What the checks found: the validated config, every stage's config built from it, and the problems."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    config: PipelineConfig | None = Field(None, description="The validated pipeline config (None: it is invalid).")
    stage_configs: dict[str, BaseModel] = Field(default_factory=dict, description="Stage name -> its config.")
    problems: list[str] = Field(default_factory=list, description="One line per problem, at its YAML path.")


def stage_configs(cfg: PipelineConfig, stages: Sequence[StageSpec]) -> tuple[dict[str, BaseModel], list[str]]:
    """Build every stage's config from its section: (the configs built, one line per problem at its YAML path)."""
    configs, errors = resolve_configs(stages, cfg, cfg.run_dir)
    problems: list[str] = []
    for name, err in errors.items():
        if isinstance(err, ValidationError):
            problems += describe(err, relocate=functools.partial(_yaml_location, name))
        else:
            problems.append(f"{name}: {_one_line(err)}")
    if "evaluate" in cfg.quantize.model_fields_set and cfg.quantize.evaluate is not None:
        from components.evaluate import EvalConfig

        try:  # merged over the evaluate section when the stage runs: its keys are EvalConfig fields
            EvalConfig(**{"checkpoint_uri": "-", "output_dir": "-", **cfg.quantize.evaluate})
        except ValidationError as err:
            problems += describe(err, ("quantize", "evaluate"), EvalConfig)
    return configs, problems


def stage_config_problems(cfg: PipelineConfig, stages: Sequence[StageSpec]) -> list[str]:
    """One line per problem in building every stage's config, at its YAML path."""
    return stage_configs(cfg, stages)[1]


def parent_architecture(cfg: PipelineConfig) -> tuple[HybridConfig | None, list[str]]:
    """The parent's architecture when it can be known without downloading anything, and the problems met."""
    from components.storage import check_reachable, is_s3

    uri = cfg.parent.uri
    if uri is None:
        arch = cfg.parent.train.architecture
        vocab, problems = _trained_vocab(cfg)
        try:
            return HybridConfig(**{"vocab_size": vocab or 256, **arch}), problems
        except ValidationError as err:
            return None, describe(err, ("parent", "train", "architecture")) + problems
    if is_s3(uri):
        try:
            check_reachable(uri)
        except ValueError as err:
            return None, [f"parent.uri: {err}"]
        return None, []
    folder = Path(uri)
    if not folder.is_dir():
        return None, [f"parent.uri: {uri} is not a folder (a nemotron_h checkpoint: config.json + safetensors)"]
    if not (folder / "config.json").is_file():
        return None, [f"parent.uri: {uri} has no config.json (a nemotron_h checkpoint?)"]
    try:
        return HybridConfig.from_json_file(folder / "config.json"), []
    except (ValueError, TypeError) as err:
        return None, [f"parent.uri: {folder / 'config.json'} is not a usable nemotron_h config ({_one_line(err)})"]


def _trained_vocab(cfg: PipelineConfig) -> tuple[int | None, list[str]]:
    """Embedding rows of a parent trained in the pipeline: its tokenizer's size rounded up to 16, as
    parent training does (None when the tokenizer is remote or missing: the budgets are then checked
    when the parent exists)."""
    from components.data import TextTokenizer, build_demo_tokenizer
    from components.storage import is_s3

    folder = cfg.parent.train.tokenizer
    if folder is None:
        size = len(build_demo_tokenizer())
    elif is_s3(folder):
        return None, []
    else:
        try:
            size = TextTokenizer.load(folder, cfg.parent.train.markers).vocab_size
        except Exception as err:  # any loader error is the user's tokenizer folder: one line
            return None, [f"parent.train.tokenizer: {folder} does not load ({_one_line(err)})"]
    return -(-size // 16) * 16, []


def elastic_problems(cfg: PipelineConfig, parent: HybridConfig, reachability: bool = True) -> list[str]:
    """The elastic space against the parent, one line per axis; then whether every budget is reachable."""
    from model.elastic.budgets import BudgetSet
    from model.elastic.space import ElasticSpace

    space = cfg.elastic.space
    problems = []
    for axis in space.elastic_axes:
        single = ElasticSpace(**{axis: space.choices(axis)}, nvfp4_aligned=space.nvfp4_aligned)
        try:
            single.validate_against(parent)
        except ValueError as err:
            parts = str(err).split(": ", 1)[-1].split("; ")  # "elastic space does not fit the model: a; b"
            problems.append(f"elastic.space.{axis}: " + "; ".join(p.removeprefix(f"{axis}: ") for p in parts))
    if problems or not reachability:
        return problems
    dead_zone = min(cfg.distill_phase1.dead_zone, cfg.distill_phase2.dead_zone)
    try:
        BudgetSet(budgets=cfg.elastic.budgets).check_reachable(parent, space, depth_order=None, dead_zone=dead_zone)
    except ValueError as err:
        problems.append(f"elastic.budgets: {err}")
    return problems


def uri_problems(cfg: PipelineConfig) -> list[str]:
    """Folders and buckets the run writes to must be writable (a missing parent is reported with it)."""
    from components.storage import check_reachable

    problems = []
    for path, uri in (("runs_dir", cfg.runs_dir), ("storage_uri", cfg.storage_uri)):
        if uri:
            try:
                check_reachable(uri)
            except ValueError as err:
                problems.append(f"{path}: {err}")
    return problems


def _data_sections(cfg: PipelineConfig) -> list[tuple[str, Any]]:
    """(YAML path, DataConfig) of every data section the config states."""
    sections: list[tuple[str, Any]] = []
    if cfg.data is not None:
        sections.append(("data", cfg.data))
    candidates = [
        ("parent.train", cfg.parent.train),
        ("rank.calibration", getattr(cfg.rank, "calibration", None)),
        ("distill_phase1", cfg.distill_phase1),
        ("distill_phase2", cfg.distill_phase2),
        ("quantize.calibration", getattr(cfg.quantize, "calibration", None)),
    ]
    for path, section in candidates:
        if section is not None and "data" in section.model_fields_set:
            sections.append((f"{path}.data", section.data))
    return sections


def data_problems(cfg: PipelineConfig) -> list[str]:
    """Every local file of every data section and evaluation set exists and has a known row layout.

    ``s3://`` sources are checked by their schema only here (nothing is downloaded by a dry run); the
    stages check them down to their rows before any worker starts.
    """
    from components.data.mixture import describe_data
    from components.data.sources import DataConfig, FilesSource
    from components.storage import is_s3

    problems = []
    for path, data in _data_sections(cfg):
        local = [s for s in data.sources if not (isinstance(s, FilesSource) and any(is_s3(p) for p in s.paths))]
        if not local:
            continue
        try:
            describe_data(DataConfig(sources=local, cache_dir=data.cache_dir))
        except (ValueError, FileNotFoundError) as err:
            problems.append(f"{path}: {_one_line(err)}")
    for i, eval_set in enumerate(getattr(cfg.evaluate, "eval_sets", None) or []):
        if not is_s3(eval_set.path) and not Path(eval_set.path).is_file():
            problems.append(f"evaluate.eval_sets[{i}].path: no such file {eval_set.path!r}")
    train_eval = cfg.parent.train.eval if cfg.parent.uri is None else None
    if train_eval is not None and not is_s3(train_eval.path) and not Path(train_eval.path).is_file():
        problems.append(f"parent.train.eval.path: no such file {train_eval.path!r}")
    return problems


def stage_name_problems(stages: Sequence[StageSpec], only: Sequence[str] | None, force_from: str | None) -> list[str]:
    names = [s.name for s in stages]
    problems = [f"--only: unknown stage {s!r}; stages are {names}" for s in only or [] if s not in names]
    if force_from is not None and force_from not in names:
        problems.append(f"--from: unknown stage {force_from!r}; stages are {names}")
    return problems


def check_pipeline(
    config_path: str | Path,
    overrides: Sequence[str] = (),
    only: Sequence[str] | None = None,
    force_from: str | None = None,
    stages: Sequence[StageSpec] | None = None,
) -> Preflight:
    """Every check, and the stage configs built on the way; nothing is run or written."""
    if stages is None:
        from pipelines.stages import pipeline_stages

        stages = pipeline_stages()
    names = stage_name_problems(stages, only, force_from)
    try:
        cfg = load_pipeline_config(config_path, overrides)
    except ConfigError as err:
        return Preflight(problems=err.problems + names)
    configs, problems = stage_configs(cfg, stages)
    parent, found = parent_architecture(cfg)
    problems += found
    if parent is not None:
        known_vocab = cfg.parent.uri is not None or _trained_vocab(cfg)[0] is not None
        problems += elastic_problems(cfg, parent, reachability=known_vocab)
    problems += uri_problems(cfg)
    problems += data_problems(cfg)
    return Preflight(config=cfg, stage_configs=configs, problems=problems + names)


def pipeline_problems(
    config_path: str | Path,
    overrides: Sequence[str] = (),
    only: Sequence[str] | None = None,
    force_from: str | None = None,
    stages: Sequence[StageSpec] | None = None,
) -> tuple[PipelineConfig | None, list[str]]:
    """(the validated config or None, one line per problem) of :func:`check_pipeline`."""
    checked = check_pipeline(config_path, overrides, only, force_from, stages)
    return checked.config, checked.problems


def report(problems: Sequence[str], stream: Any = None) -> None:
    """Print one line per problem (stderr by default)."""
    for line in problems:
        print(line, file=stream or sys.stderr)


def dry_run(
    config_path: str | Path,
    overrides: Sequence[str] = (),
    only: Sequence[str] | None = None,
    force_from: str | None = None,
    stages: Sequence[StageSpec] | None = None,
) -> int:
    """``run --dry-run``: 0 and the plan on stdout, or 2 and one line per problem on stderr."""
    if stages is None:
        from pipelines.stages import pipeline_stages

        stages = pipeline_stages()
    checked = check_pipeline(config_path, overrides, only, force_from, stages)
    cfg = checked.config
    if checked.problems or cfg is None:
        report(checked.problems)
        return 2
    plan = PipelineRunner(list(stages), cfg, cfg.run_dir, checked.stage_configs).plan(force_from)
    shown = [(name, what) for name, what in plan if only is None or name in only]
    print(f"pipeline {cfg.run_name}: " + ", ".join(f"{name} ({what})" for name, what in shown))
    return 0
