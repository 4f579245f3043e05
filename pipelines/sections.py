"""Each stage's config resolved from its section of the pipeline config: one function per stage.

The pipeline's stages (the ``build_*`` of :mod:`pipelines.stages`, which preflight, the runner,
Kubeflow's run-stage and ``star-elastic plan`` call) and the subcommands that run one stage by itself
(``star-elastic rank``, ``parent train``) build a stage's config here, so a section means the same
thing wherever it is read: the rank subcommand calibrates on exactly the rows the pipeline's rank
stage does. Each function takes

* ``section``: the keys the YAML sets (a validated section's ``model_dump(exclude_unset=True)``, or
  the mapping a subcommand read);
* ``inherit``: the top-level ``data`` / ``markers`` (:class:`~components.data.inherit.Inherited`,
  whose ``fill`` is the one inheritance rule);
* ``filled``: the values the pipeline fills in (:data:`pipelines.config.FILLED`: upstream folders, the
  elastic space, ...; a pipeline section never sets those) or a subcommand takes from its flags, which
  win over the section it read;

and returns the stage's validated config (pydantic's ``ValidationError`` otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from components.data.inherit import Inherited
from components.stage_task import TaskResources
from pipelines.config import ExportStageConfig, PipelineConfig

if TYPE_CHECKING:
    from components.distill.config import DistillConfig
    from components.evaluate import EvalConfig
    from components.parent import ParentTrainConfig
    from components.quantize import QuantizeConfig
    from components.rank import RankConfig
    from components.register import RegisterConfig

Section = Mapping[str, Any]


def inherited(cfg: PipelineConfig) -> Inherited:
    """What every section of ``cfg`` inherits from its top level."""
    return Inherited(data=cfg.data, markers=cfg.markers)


def merge(base: Mapping[str, Any], section: Section) -> dict[str, Any]:
    """``section`` over ``base`` (one level deep for nested dicts)."""
    out = dict(base)
    for k, v in section.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _calibration(section: Section, inherit: Inherited) -> dict[str, Any]:
    """``section`` with its ``calibration`` inheriting the top-level data (packed) and markers."""
    out = dict(section)
    calibration = out.get("calibration") or {}
    if isinstance(calibration, Mapping):  # anything else is left for validation to name
        calibration = inherit.fill(calibration, calibration=True)
    out["calibration"] = calibration
    return out


def task_device(device: str, resources: TaskResources, device_field: str, resources_field: str) -> str:
    """The evaluation device inside a stage task: ``auto`` is cuda when the task reserves a GPU and cpu
    otherwise (a CPU task on a GPU node must not use a GPU it did not reserve); cuda without one is refused,
    naming both fields."""
    if device == "auto":
        return "cuda" if resources.num_gpus > 0 else "cpu"
    if device.startswith("cuda") and resources.num_gpus == 0:
        raise ValueError(
            f"{device_field}: {device!r} but the task reserves no GPU; set {resources_field}.num_gpus (e.g. 1), "
            "or device: auto"
        )
    return device


# ---------------------------------------------------------------------- one function per stage
def parent_train_config(section: Section, inherit: Inherited, **filled: Any) -> ParentTrainConfig:
    """``parent.train``: the parent trained here, on the top-level data and markers unless it sets its own."""
    from components.parent import ParentTrainConfig

    return ParentTrainConfig(**{**inherit.fill(section), **filled})


def rank_config(section: Section, inherit: Inherited, **filled: Any) -> RankConfig:
    """``rank``: its calibration inherits the top-level data (rows packed) and markers."""
    from components.rank import RankConfig

    return RankConfig(**{**_calibration(section, inherit), **filled})


def distill_config(section: Section, inherit: Inherited, **filled: Any) -> DistillConfig:
    """``distill_phase1`` / ``distill_phase2``: the section over the filled values, data and markers inherited."""
    from components.distill.config import DistillConfig

    return DistillConfig(**merge(filled, inherit.fill(section)))


def export_config(section: Section, **filled: Any) -> ExportStageConfig:
    """``export``: nothing inherited."""
    return ExportStageConfig(**{**section, **filled})


def evaluate_config(section: Section, inherit: Inherited, *, threads: int, **filled: Any) -> EvalConfig:
    """``evaluate``: the markers inherited, the pipeline's ``threads`` unless the section sets its own;
    ``device: auto`` resolved against the task's resources."""
    from components.evaluate import EvalConfig

    cfg = EvalConfig(**merge({**filled, "threads": threads}, inherit.fill(section, keys=("markers",))))
    device = task_device(cfg.device, cfg.resources, "evaluate.device", "evaluate.resources")
    return cfg.model_copy(update={"device": device})


def quantize_config(section: Section, evaluate: Section, inherit: Inherited, **filled: Any) -> QuantizeConfig:
    """``quantize``: its calibration inherits like rank's; its recovery evaluation is the ``evaluate`` section
    reduced to accuracy per budget (full thinking, no cap sweep, no elastic pairs, on the quantize task's
    resources), under the section's own ``evaluate`` keys."""
    from components.quantize import QuantizeConfig

    ev = {k: v for k, v in evaluate.items() if k not in ("think_caps", "elastic_pairs", "resources")}
    ev.update({"think_caps": [None], "elastic_pairs": [], "carry_state_compare": False, "progress": False})
    base = {**filled, "evaluate": inherit.fill(ev, keys=("markers",))}
    cfg = QuantizeConfig(**merge(base, _calibration(section, inherit)))
    if cfg.evaluate is None:
        return cfg
    device = task_device(cfg.evaluate.get("device", "auto"), cfg.resources, "evaluate.device", "quantize.resources")
    return cfg.model_copy(update={"evaluate": {**cfg.evaluate, "device": device}})


def register_config(section: Section, **filled: Any) -> RegisterConfig:
    """``register``: nothing inherited (its budgets and formats come from upstream outputs when it runs)."""
    from components.register import RegisterConfig

    return RegisterConfig(**{**section, **filled})
