"""The pipeline's YAML config: one validated document feeding every stage.

Design choices:

* Every section is typed with its stage's own config class, so YAML, ``--set``, ``--dry-run`` and
  the Kubeflow pipeline's parameters (:mod:`pipelines.kfp_params`) share one definition. A
  section is the stage class minus the fields the pipeline fills in (:data:`FILLED`: upstream
  folders, the elastic space, ...); those are refused in the YAML with the place they come from.
  Field types, bounds and field validators are the stage class's own; its cross-field checks run
  when the stage's config is built from the section, which ``--dry-run`` and ``run`` do for every
  stage before anything starts (:mod:`pipelines.preflight`).
* Every problem is one line ``yaml.path: message``; :class:`ConfigError` carries the list.
  YAML syntax errors and repeated keys name the file, line and column.
"""

from __future__ import annotations

import difflib
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
)

from components.data import DataConfig, ReasoningMarkers
from components.distill.config import DistillConfig
from components.evaluate import EvalConfig
from components.parent import ParentTrainConfig
from components.quantize import QuantizeConfig
from components.rank import RankConfig
from components.register import RegisterConfig
from components.serving.config import ServingConfig
from components.settings import MlflowStore, mlflow_store
from components.stage_task import TaskResources
from model.elastic.budgets import Budget, BudgetSet
from model.elastic.space import AXES, ElasticSpace


class ConfigError(ValueError):
    """An invalid pipeline config; ``problems`` holds one ``yaml.path: message`` line per problem."""

    def __init__(self, source: str | Path, problems: list[str]) -> None:
        super().__init__(f"{source}: invalid pipeline config:\n  " + "\n  ".join(problems))
        self.source = str(source)
        self.problems = problems


class ExportStageConfig(BaseModel):
    """Settings of the export stage: one nested checkpoint from the phase-2 student and router."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # resolved once, then only read

    distill_dir: str = Field(description="The phase-2 output folder (student + router).")
    output_dir: str = Field(description="Where the one nested checkpoint is written.")
    allow_off_target: bool = Field(False, description="Export even if a budget misses its target (recorded).")
    tolerance: float = Field(0.05, gt=0, lt=1, description="Relative tolerance on each budget's active params.")
    select: Literal["argmax", "feasible"] = Field(
        "argmax",
        description="Architecture per budget: the router's argmax (the method), or 'feasible': the on-target "
        "architecture nearest the argmax (for a router that saturated off target).",
    )
    resources: TaskResources = Field(
        default_factory=TaskResources,
        description="The Ray task that writes the checkpoint (components.stage_task.TaskResources); it copies "
        "the weights tensor by tensor, so it needs CPU and the largest tensor's memory, no GPU.",
    )


_DISTILL_FILLED = {
    "phase": "the stage: 1 or 2",
    "teacher_uri": "the rank stage's permuted checkpoint",
    "init_from": "phase 2: the phase-1 output",
    "output_dir": "the stage's folder under runs_dir/run_name",
    "space": "elastic.space",
    "budgets": "elastic.budgets",
    "experiment": "experiment",
}
FILLED: dict[str, dict[str, str]] = {
    "parent.train": {"output_dir": "the parent stage's folder under runs_dir/run_name"},
    "rank": {"parent_uri": "parent.uri", "output_dir": "the rank stage's folder under runs_dir/run_name"},
    "distill_phase1": _DISTILL_FILLED,
    "distill_phase2": _DISTILL_FILLED,
    "export": {"distill_dir": "the phase-2 output", "output_dir": "the export stage's folder"},
    "evaluate": {"checkpoint_uri": "the exported nested checkpoint", "output_dir": "the evaluate stage's folder"},
    "quantize": {"checkpoint_uri": "the exported nested checkpoint", "output_dir": "the quantize stage's folder"},
    "register": {
        "checkpoint_uri": "the exported nested checkpoint",
        "budgets": "the export and evaluate outputs",
        "formats": "the quantize outputs",
    },
}
"""Per section (YAML path): stage-config fields the pipeline fills in -> where their value comes from."""


def section_of(cls: type[BaseModel], section: str) -> type[BaseModel]:
    """The YAML section of a stage: ``cls``'s fields and field validators, less the fields in ``FILLED[section]``."""
    filled = FILLED.get(section, {})
    fields: dict[str, Any] = {n: (f.annotation, f) for n, f in cls.model_fields.items() if n not in filled}
    validators = {}
    for name, dec in cls.__pydantic_decorators__.field_validators.items():
        kept = [f for f in dec.info.fields if f not in filled]
        func = dec.func
        if inspect.ismethod(func):  # a classmethod bound to ``cls``: rebind it to the section class
            func = classmethod(func.__func__)
        if kept:
            validators[name] = field_validator(*kept, mode=dec.info.mode)(func)
    doc = f"The ``{section}`` section: {cls.__name__} fields the pipeline does not fill in."
    config = ConfigDict(extra="forbid")
    return create_model(f"{cls.__name__}Section", __config__=config, __doc__=doc, __validators__=validators, **fields)


RankSection = section_of(RankConfig, "rank")
DistillSection = section_of(DistillConfig, "distill_phase1")
ExportSection = section_of(ExportStageConfig, "export")
EvaluateSection = section_of(EvalConfig, "evaluate")
QuantizeSection = section_of(QuantizeConfig, "quantize")
RegisterSection = section_of(RegisterConfig, "register")
ParentTrainSection = section_of(ParentTrainConfig, "parent.train")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""Budget names: served model ids, MLflow keys (``acc/<name>``) and folder names."""

TRACKING_SCHEMES = ("file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")


def _budget_named(budget: Budget) -> Budget:
    if not NAME.match(budget.name):
        raise ValueError(
            f"name {budget.name!r}: use letters, digits, '_', '.' and '-' only (a budget name is a served model id "
            "and part of MLflow keys)"
        )
    return budget


class ParentSection(BaseModel):
    """Where the parent comes from: an existing nemotron_h checkpoint, or the demo parent trained here."""

    model_config = ConfigDict(extra="forbid")

    uri: str | None = Field(None, description="A nemotron_h checkpoint folder (or s3:// URI); null trains one.")
    train: ParentTrainSection = Field(default_factory=ParentTrainSection, description="Used when uri is null.")


class ElasticSection(BaseModel):
    """The nested family: elastic axes with candidate sizes, and the budgets to train."""

    model_config = ConfigDict(extra="forbid")

    space: ElasticSpace = Field(description="Candidate sizes per elastic axis (model.elastic.space.ElasticSpace).")
    budgets: list[Annotated[Budget, AfterValidator(_budget_named)]] = Field(
        min_length=1, description="Budgets: name and target fraction of the parent's active parameters (1.0 needed)."
    )

    @field_validator("space")
    @classmethod
    def _some_axis(cls, space: ElasticSpace) -> ElasticSpace:
        if not space.elastic_axes:
            raise ValueError(f"no elastic axis; give candidate sizes for at least one of {list(AXES)}")
        return space

    @field_validator("budgets")
    @classmethod
    def _budget_set(cls, budgets: list[Budget]) -> list[Budget]:
        try:
            BudgetSet(budgets=budgets)  # unique names and fractions, a full budget (1.0)
        except ValidationError as err:  # re-raised as a plain error: it belongs to this field, not to a nested one
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())) from None
        return budgets


class PipelineConfig(BaseModel):
    """Everything one pipeline execution needs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    run_name: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$", description="Folder name under runs_dir.")
    runs_dir: str = Field("runs", min_length=1, description="Where every run writes (checkpoints, MLflow store).")
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (and registry); it wins over MLFLOW_TRACKING_URI, which wins over the "
        "default sqlite:///<runs_dir>/mlflow.db.",
    )
    experiment: str = Field("star-elastic", min_length=1, description="MLflow experiment name.")
    storage_uri: str | None = Field(
        None, description="s3://bucket/prefix (or an absolute folder) to publish stage outputs to; null: local only."
    )
    threads: int = Field(2, ge=1, description="torch CPU threads per process on the driver.")
    parent: ParentSection = Field(default_factory=ParentSection, description="The parent model.")
    data: DataConfig | None = Field(
        None,
        description="Default data mixture of every stage that needs tokens (parent training, rank calibration, both "
        "distillation phases, quantize calibration) unless its own section sets data; calibrations pack its rows. "
        "null: each stage's own default (the built-in generator).",
    )
    markers: ReasoningMarkers | None = Field(
        None,
        description="Reasoning markers of the tokenizer for every stage and for serving, unless a section sets its "
        "own; null: <think> / </think>.",
    )
    elastic: ElasticSection = Field(description="Elastic axes and budgets.")
    rank: RankSection = Field(default_factory=RankSection, description="Rank stage (RankConfig fields).")
    distill_phase1: DistillSection = Field(
        default_factory=DistillSection, description="Phase 1, short context (DistillConfig fields)."
    )
    distill_phase2: DistillSection = Field(
        default_factory=DistillSection, description="Phase 2, long context (DistillConfig fields)."
    )
    export: ExportSection = Field(default_factory=ExportSection, description="Export stage (ExportStageConfig fields).")
    evaluate: EvaluateSection = Field(
        default_factory=EvaluateSection, description="Evaluate stage (EvalConfig fields)."
    )
    quantize: QuantizeSection = Field(
        default_factory=QuantizeSection, description="Quantize stage (QuantizeConfig fields)."
    )
    registry: RegisterSection = Field(
        default_factory=RegisterSection, alias="register", description="Registry and promotion (YAML key: register)."
    )
    serve: ServingConfig = Field(default_factory=ServingConfig, description="Serving settings (star-elastic serve).")

    @field_validator("tracking_uri")
    @classmethod
    def _tracking_scheme(cls, uri: str | None) -> str | None:
        if uri is None or "://" not in uri:
            return uri  # None, or a local folder (MLflow's file store)
        scheme = uri.split("://", 1)[0].split("+", 1)[0]
        if scheme not in TRACKING_SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r} in {uri!r}; MLflow takes {list(TRACKING_SCHEMES)} or a folder")
        return uri

    @field_validator("storage_uri")
    @classmethod
    def _storage_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        if re.match(r"^s3://[^/]+", uri) or (Path(uri).is_absolute() and "://" not in uri):
            return uri
        raise ValueError(f"{uri!r} is neither s3://bucket/prefix nor an absolute folder")

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run_name

    def mlflow_store(self) -> MlflowStore:
        """Where this run logs and registers: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else
        ``sqlite:///<runs_dir>/mlflow.db`` (the rule of :mod:`components.settings`)."""
        default = f"sqlite:///{Path(self.runs_dir).resolve() / 'mlflow.db'}"
        return mlflow_store(self.tracking_uri, default=default)


def cross_section_problems(cfg: PipelineConfig) -> list[str]:
    """Budget names used outside ``elastic.budgets`` must be among them."""
    names = [b.name for b in cfg.elastic.budgets]
    problems = []
    if cfg.serve.budgets is not None and (bad := sorted(set(cfg.serve.budgets) - set(names))):
        problems.append(f"serve.budgets: unknown budgets {bad}; elastic.budgets are {names}")
    if bad := sorted(set(cfg.registry.gate.min_accuracy) - set(names)):
        problems.append(f"register.gate.min_accuracy: unknown budgets {bad}; elastic.budgets are {names}")
    pairs = cfg.evaluate.elastic_pairs
    if pairs != "all" and (bad := sorted({n for pair in pairs for n in pair} - set(names))):
        problems.append(f"evaluate.elastic_pairs: unknown budgets {bad}; elastic.budgets are {names}")
    return problems


# ---------------------------------------------------------------------- one line per problem
_TYPE_TAGS = {"int", "float", "str", "bool", "none", "list", "dict", "tuple", "set"}


def _is_tag(part: Any) -> bool:
    """A union member's tag in a pydantic error location (``literal['all']``, ``list[...]``, ``int``)."""
    return isinstance(part, str) and ("[" in part or part.startswith("function-") or part in _TYPE_TAGS)


def yaml_path(loc: Iterable[Any]) -> str:
    """``("elastic", "budgets", 1, "name")`` -> ``elastic.budgets[1].name``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".")


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class holding the key at ``loc`` (for spelling suggestions); None when unknown."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        fields = {f.alias or n: f for n, f in current.model_fields.items()} | current.model_fields
        if part not in fields:
            return None
        ann, current = fields[part].annotation, None
        for arg in (ann, *typing.get_args(ann), *(a for t in typing.get_args(ann) for a in typing.get_args(t))):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
                break
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unknown_key(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    section, key = yaml_path(loc[:-1]), loc[-1]
    if section in FILLED and key in FILLED[section]:
        return f"set by the pipeline ({FILLED[section][key]}); remove it"
    owner = _model_at(model, loc) if model is not None else None
    names = [f.alias or n for n, f in owner.model_fields.items()] if owner is not None else []
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    return "unknown key" + (f"; did you mean {close[0]!r}?" if close else "; remove it or fix its spelling")


def describe(
    err: ValidationError,
    prefix: tuple[Any, ...] = (),
    model: type[BaseModel] | None = None,
    relocate: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
) -> list[str]:
    """One ``yaml.path: message`` line per problem (errors of one union field merged into one line).

    An error's location is ``prefix`` + its pydantic location, or ``relocate(location)``; ``model``
    is the class validated, for spelling suggestions on unknown keys.
    """
    merged: dict[str, list[str]] = {}
    for e in err.errors():
        raw = tuple(e["loc"])
        cut = next((i for i, p in enumerate(raw) if _is_tag(p)), len(raw))
        inner = yaml_path(p for p in raw[cut:] if not _is_tag(p))  # inside one member of a union
        loc = relocate(raw[:cut]) if relocate else (*prefix, *raw[:cut])
        if e["type"] == "extra_forbidden" and not inner:
            msg = _unknown_key(model, loc)
        elif e["type"] == "missing" and not inner:
            msg = "missing; this key is required"
        else:
            msg = e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
            if loc and isinstance(loc[-1], str):
                msg = msg.removeprefix(f"{loc[-1]}: ")
            value = e.get("input")
            if e["type"] != "value_error" and isinstance(value, str | int | float | bool | type(None)):
                msg += f", got {value!r}"[:80]
            if inner:
                msg = f"{inner.lstrip('.')}: {msg}"
        path = yaml_path(loc) or "(top level)"
        if msg not in merged.setdefault(path, []):
            merged[path].append(msg)
    return [f"{path}: {'; '.join(msgs)}" for path, msgs in merged.items()]


# ---------------------------------------------------------------------- reading
class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key repeated in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise yaml.MarkedYAMLError(problem=f"key {key!r} repeated in one mapping", problem_mark=mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_error(source: str, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    return f"{where}: invalid YAML: {problem}" + (f" ({context})" if context else "")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file; :class:`ConfigError` naming file, line and column otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(p, [f"{p}: no such config file"])
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe
    except yaml.YAMLError as err:
        raise ConfigError(p, [_yaml_error(str(p), err)]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(p, [f"{p}: expected a mapping of sections at the top level, got {type(data).__name__}"])
    return data


def set_by_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``a.b.c=value`` override on a nested dict (a string value is parsed as YAML)."""
    keys = dotted.split(".")
    if not all(keys):
        raise ValueError(f"--set {dotted}: empty key in the path")
    cur = data
    for i, k in enumerate(keys[:-1]):
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ValueError(f"{'.'.join(keys[: i + 1])}: not a section, cannot set {dotted}")
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ValueError(f"{dotted}: --set value is not valid YAML ({getattr(err, 'problem', err)})") from None
    cur[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> None:
    """Apply ``key.path=value`` strings to a nested dict in place (values parsed as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item}: expected key.path=value")
        key, value = item.split("=", 1)
        set_by_path(data, key.strip(), value)


def validate_pipeline(data: Mapping[str, Any], source: str | Path = "config") -> PipelineConfig:
    """A :class:`PipelineConfig` from a mapping; :class:`ConfigError` listing every problem otherwise."""
    try:
        cfg = PipelineConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(source, describe(err, model=PipelineConfig)) from None
    problems = cross_section_problems(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg


def load_pipeline_config(path: str | Path, overrides: Iterable[str] | None = None) -> PipelineConfig:
    """Read a YAML file, apply ``key.path=value`` overrides, validate; :class:`ConfigError` lists every problem."""
    data = read_yaml(path)
    problems = []
    for item in overrides or []:
        try:
            apply_overrides(data, [item])
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError(path, problems)
    return validate_pipeline(data, path)
