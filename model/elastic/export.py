"""One nested checkpoint for the whole family, and zero-shot extraction of any budget from it.

Layout of a nested checkpoint (a normal ``nemotron_h`` folder, so any loader opens the parent):

* ``model.safetensors``: the FULL (permuted, distilled) weights, as ``save_pretrained`` writes them
  (the export stage copies them from the distillation output tensor by tensor, the same tensors);
* ``config.json``: the parent's config plus an ``elastic`` section::

      {"format_version": 1,
       "parent": {"total_params": ..., "active_params": ...},
       "budgets": [{"name", "fraction", "total_target", "active_target", "architecture": {...},
                    "total_params", "active_params", "total_fraction", "active_fraction",
                    "standalone", ["warning"], ["selection"]}, ...],   # largest first
       "space": {...ElasticSpace...},
       "depth_order": [...]}

* ``manifest.json`` and any extra files (tokenizer), hashed together.

Design choices:

* Budget figures are analytic (:func:`~model.elastic.params.count_params`), stored as integers
  next to the architecture, because users size MoE models by active parameters and reading a
  config must not need the weights. :func:`extract_budget` re-checks the total against the
  extracted model, so an edited config cannot silently describe other weights.
* Each budget's total and active fractions must lie within ``tolerance`` (relative, the budget
  loss's dead zone) of the targets it states (``total_target`` / ``active_target``, null when not
  stated; ``fraction`` is the budget's key, see :class:`~model.elastic.budgets.BudgetSet`). A
  router that missed a target is a failed run: export refuses, naming the budget and the target,
  unless ``allow_off_target=True``, which records a ``warning`` field in that entry so the miss
  stays visible to every later reader. Files written before budgets had two targets have only
  ``fraction``, read as the active target.
* ``depth_order`` is stored resolved (the default order written out), so a reader never depends on
  the default convention of the code version that wrote the file.
* ``standalone`` says whether the budget fits one ``nemotron_h`` config (per-layer sizes that
  differ do not): such budgets are servable from the nested weights with masks or
  :func:`load_budget_model`, but :func:`extract_budget` refuses to write them.
* Extraction writes a plain ``nemotron_h`` checkpoint with no ``elastic`` section (it would
  describe sub-models of the parent, not of the extracted model) and copies the tokenizer files
  that sit beside the source.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.checkpoint import CONFIG_NAME, CheckpointError
from model.config import HybridConfig
from model.elastic.arch import Architecture, check_depth_order
from model.elastic.budgets import Budget, BudgetSet, UnknownBudgetError
from model.elastic.params import ParamCount, count_params
from model.elastic.router import BudgetRouter
from model.elastic.slicing import extract, extract_config
from model.elastic.space import ElasticSpace
from model.hybrid import HybridLM
from model.layout import DEFAULT_MAX_SHARD_SIZE, tokenizer_files

FORMAT_VERSION = 1


@dataclass(frozen=True)
class BudgetInfo:
    """One budget of a nested checkpoint: its target, architecture and parameter counts."""

    name: str
    fraction: float
    architecture: Architecture
    total_params: int
    active_params: int
    active_fraction: float
    standalone: bool = True
    warning: str | None = None
    selection: str | None = None
    """How the architecture was chosen when it is not the router's argmax (e.g. the argmax was off target)."""
    total_fraction: float | None = None
    """Total parameters over the parent's (None only in files written before it was recorded)."""
    total_target: float | None = None
    """The stated target fraction of the parent's total parameters (None: no total target)."""
    active_target: float | None = None
    """The stated target fraction of the parent's active parameters (None: no active target)."""

    @property
    def budget(self) -> Budget:
        """The trained budget (its name and stated targets)."""
        if self.total_target is None and self.active_target is None:
            return Budget(name=self.name, active=self.fraction)
        return Budget(name=self.name, total=self.total_target, active=self.active_target)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "fraction": self.fraction,
            "total_target": self.total_target,
            "active_target": self.active_target,
            "architecture": self.architecture.to_dict(),
            "total_params": self.total_params,
            "active_params": self.active_params,
            "total_fraction": self.total_fraction,
            "active_fraction": self.active_fraction,
            "standalone": self.standalone,
        }
        if self.warning is not None:
            out["warning"] = self.warning
        if self.selection is not None:
            out["selection"] = self.selection
        return out


@dataclass(frozen=True)
class ElasticInfo:
    """The ``elastic`` section of a nested checkpoint, parsed; ``config`` is the parent's config."""

    config: HybridConfig
    budgets: list[BudgetInfo]
    space: ElasticSpace
    depth_order: list[int]
    parent_total_params: int
    parent_active_params: int

    @property
    def names(self) -> list[str]:
        """Budget names, largest first."""
        return [b.name for b in self.budgets]

    def budget(self, name: str) -> BudgetInfo:
        """The budget called ``name``; :class:`UnknownBudgetError` listing the valid names otherwise."""
        for b in self.budgets:
            if b.name == name:
                return b
        raise UnknownBudgetError(f"unknown budget {name!r}; valid budgets {self.names}")

    @property
    def budget_set(self) -> BudgetSet:
        return BudgetSet(budgets=[b.budget for b in self.budgets])

    @property
    def architectures(self) -> dict[str, Architecture]:
        return {b.name: b.architecture for b in self.budgets}


# ---------------------------------------------------------------------- export
def _architectures(
    router_or_archs: BudgetRouter | Mapping[str, Architecture | dict[str, Any]],
    budgets: BudgetSet,
    select: str = "argmax",
    tolerance: float = 0.05,
    depth_order: Sequence[int] | None = None,
) -> dict[str, Architecture]:
    """Budget name -> architecture, from a trained router (``select``: see
    :meth:`BudgetRouter.architectures`) or given explicitly."""
    if isinstance(router_or_archs, BudgetRouter):
        router = router_or_archs
        if router.budgets != budgets:
            raise ValueError(
                f"the router was trained for budgets {_as_map(router.budgets)}, not {_as_map(budgets)}: "
                "its one-hot inputs would mean other budgets"
            )
        return router.architectures(budgets, select=select, tolerance=tolerance, depth_order=depth_order)
    missing = [n for n in budgets.names if n not in router_or_archs]
    extra = sorted(set(router_or_archs) - set(budgets.names))
    if missing or extra:
        raise ValueError(
            f"architectures do not match the budgets {budgets.names}: missing {missing}, unexpected {extra}"
        )
    return {
        n: a if isinstance(a, Architecture) else Architecture.from_dict(dict(a))
        for n, a in ((n, router_or_archs[n]) for n in budgets.names)
    }


def _as_map(budgets: BudgetSet) -> dict[str, dict[str, float]]:
    return {b.name: b.targets for b in budgets.budgets}


def describe_budgets(
    config: HybridConfig,
    archs: Mapping[str, Architecture],
    budgets: BudgetSet,
    space: ElasticSpace | None = None,
    depth_order: Sequence[int] | None = None,
    tolerance: float = 0.05,
) -> tuple[list[BudgetInfo], list[str]]:
    """Counts and checks of every budget: (infos largest first, off-target problems, one line each).

    Every stated target (total and / or active) is checked against ``tolerance``. Invalid
    architectures raise ``ValueError`` naming the budget; off-target ones are returned as problems
    (and carry a ``warning``) so the caller decides.
    """
    full = count_params(config)
    infos, problems = [], []
    for b, key in zip(budgets.budgets, budgets.fractions, strict=True):
        arch = archs[b.name]
        try:
            arch.validate(config, space, depth_order)
        except ValueError as err:
            raise ValueError(f"budget {b.name!r}: {err}") from None
        count = count_params(config, arch, depth_order)
        warning = _off_target(b, count, full, tolerance)
        if warning is not None:
            problems.append(f"budget {b.name!r}: {warning}")
        try:
            extract_config(config, arch, depth_order)
            standalone = True
        except ValueError:
            standalone = False
        infos.append(
            BudgetInfo(
                name=b.name,
                fraction=key,
                architecture=arch,
                total_params=count.total,
                active_params=count.active,
                active_fraction=count.active / full.active,
                standalone=standalone,
                warning=warning,
                total_fraction=count.total / full.total,
                total_target=b.total,
                active_target=b.active,
            )
        )
    return infos, problems


def _off_target(budget: Budget, count: ParamCount, full: ParamCount, tolerance: float) -> str | None:
    """One line naming every stated target ``count`` misses by more than ``tolerance``; None if none."""
    misses = []
    for kind, deviation in budget.deviations(count, full).items():
        if deviation > tolerance:
            frac = getattr(count, kind) / getattr(full, kind)
            target = budget.targets[kind]
            misses.append(
                f"{kind} fraction {frac:.4f} is {100 * deviation:.1f}% off the target {target:.4f} "
                f"(tolerance {100 * tolerance:g}%)"
            )
    return "; ".join(misses) if misses else None


def nested_section(
    config: HybridConfig,
    router_or_archs: BudgetRouter | Mapping[str, Architecture | dict[str, Any]],
    budgets: BudgetSet,
    space: ElasticSpace,
    depth_order: Sequence[int] | None = None,
    allow_off_target: bool = False,
    tolerance: float = 0.05,
    select: str = "argmax",
) -> dict[str, Any]:
    """The ``elastic`` section of the nested checkpoint of a parent with ``config``; needs no weights.

    Arguments as :func:`export_nested`, which writes this section beside the weights; raises the
    same errors (off-target budgets unless ``allow_off_target``, invalid architectures, a router
    trained for other budgets).
    """
    space.validate_against(config)
    order = check_depth_order(config.num_hidden_layers, depth_order)
    archs = _architectures(router_or_archs, budgets, select, tolerance, order)
    infos, problems = describe_budgets(config, archs, budgets, space, order, tolerance)
    if isinstance(router_or_archs, BudgetRouter) and select != "argmax":
        argmax = router_or_archs.architectures(budgets)
        full = count_params(config)
        for i, info in enumerate(infos):
            a = argmax[info.name]
            if a != info.architecture:
                c = count_params(config, a, order)
                note = (
                    f"{select}: the router argmax {a.to_dict()} has total fraction {c.total / full.total:.4f}, "
                    f"active fraction {c.active / full.active:.4f}"
                )
                infos[i] = dataclasses.replace(info, selection=note)
    if problems and not allow_off_target:
        raise ValueError(
            "budgets off target: " + "; ".join(problems) + " (pass allow_off_target=True to export anyway)"
        )
    parent = count_params(config)
    return {
        "format_version": FORMAT_VERSION,
        "parent": {"total_params": parent.total, "active_params": parent.active},
        "budgets": [info.to_dict() for info in infos],
        "space": space.model_dump(),
        "depth_order": order,
    }


def named_files(extra_files: Mapping[str, str | Path] | Sequence[str | Path] | None) -> dict[str, Path]:
    """``extra_files`` as ``{name: source}``: a mapping as given, a list of sources under their own names."""
    if extra_files is None:
        return {}
    if isinstance(extra_files, Mapping):
        return {name: Path(src) for name, src in extra_files.items()}
    return {Path(src).name: Path(src) for src in extra_files}


def export_nested(
    model: HybridLM,
    router_or_archs: BudgetRouter | Mapping[str, Architecture | dict[str, Any]],
    budgets: BudgetSet,
    space: ElasticSpace,
    out_dir: str | Path,
    depth_order: Sequence[int] | None = None,
    extra_files: Mapping[str, str | Path] | Sequence[str | Path] | None = None,
    allow_off_target: bool = False,
    tolerance: float = 0.05,
    select: str = "argmax",
) -> Path:
    """Write the nested checkpoint (full weights + ``elastic`` config section) to ``out_dir``.

    ``router_or_archs``: a trained :class:`BudgetRouter` (architectures by ``select``: ``"argmax"``,
    the method's rule, or ``"feasible"``, the on-target architecture nearest the argmax, see
    :meth:`BudgetRouter.feasible_arch`; a budget so chosen records the argmax it replaced) or
    ``{budget name: Architecture or dict}``. ``extra_files``: ``{name: source}`` or a list of
    sources (copied under their own names), e.g. the tokenizer. Raises ``ValueError`` naming every
    budget whose total or active fraction is more than ``tolerance`` (relative) off a target it
    states, unless ``allow_off_target``. The write is atomic (see :func:`model.checkpoint.save_model`).

    This writes a model held in memory; the export stage streams a checkpoint folder tensor by
    tensor instead (:func:`components.distill.export.run_export`), with this function as its reference.
    """
    section = nested_section(
        model.config, router_or_archs, budgets, space, depth_order, allow_off_target, tolerance, select
    )
    return model.save_pretrained(out_dir, extra_config={"elastic": section}, extra_files=named_files(extra_files))


# ---------------------------------------------------------------------- reading and extraction
def read_elastic(path: str | Path) -> ElasticInfo:
    """Parse the ``elastic`` section of a nested checkpoint folder (or of its ``config.json``)."""
    p = Path(path)
    cfg_path = p / CONFIG_NAME if p.is_dir() else p
    if not cfg_path.exists():
        raise CheckpointError(f"{p}: no {CONFIG_NAME}")
    raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    section = raw.get("elastic")
    if not isinstance(section, dict):
        raise CheckpointError(
            f"{cfg_path}: no 'elastic' section; not a nested elastic checkpoint (write one with export_nested)"
        )
    version = section.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: elastic format_version {version} is not supported (expected 1)")
    try:
        config = HybridConfig.from_hf_dict(raw)
        parent = section.get("parent") or {}
        full = count_params(config)
        parent_total = int(parent.get("total_params", full.total))
        budgets = [
            BudgetInfo(
                name=b["name"],
                fraction=float(b["fraction"]),
                architecture=Architecture.from_dict(b["architecture"]),
                total_params=int(b["total_params"]),
                active_params=int(b["active_params"]),
                active_fraction=float(b["active_fraction"]),
                standalone=bool(b.get("standalone", True)),
                warning=b.get("warning"),
                selection=b.get("selection"),
                total_fraction=float(b.get("total_fraction") or int(b["total_params"]) / parent_total),
                total_target=_optional_float(b.get("total_target")),
                # files from before two targets: "fraction" was the active target
                active_target=_optional_float(b["active_target"] if "active_target" in b else b["fraction"]),
            )
            for b in section["budgets"]
        ]
        space = ElasticSpace.model_validate(section["space"])
        order = [int(i) for i in section["depth_order"]]
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{cfg_path}: malformed 'elastic' section: {err}") from None
    return ElasticInfo(
        config=config,
        budgets=budgets,
        space=space,
        depth_order=order,
        parent_total_params=parent_total,
        parent_active_params=int(parent.get("active_params", full.active)),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def load_budget_model(checkpoint_dir: str | Path, budget_name: str, dtype=None) -> HybridLM:
    """The standalone model of ``budget_name``, cut out of a nested checkpoint in memory.

    Per-layer budgets are built too (each block with its own sizes), but their ``config`` is only
    an envelope; see :mod:`model.elastic.slicing`.
    """
    info = read_elastic(checkpoint_dir)
    return _extract(checkpoint_dir, info, info.budget(budget_name), dtype)  # bad names fail before any read


def _extract(checkpoint_dir: str | Path, info: ElasticInfo, budget: BudgetInfo, dtype) -> HybridLM:
    parent = HybridLM.from_pretrained(checkpoint_dir, dtype=dtype)
    sub = extract(parent, budget.architecture, info.depth_order)
    got = sub.num_parameters()
    if got != budget.total_params:
        raise CheckpointError(
            f"{checkpoint_dir}: budget {budget.name!r} extracts to {got} parameters but its config entry "
            f"records {budget.total_params} (edited config or different weights?)"
        )
    return sub


def extract_budget(
    checkpoint_dir: str | Path,
    budget_name: str,
    out_dir: str | Path,
    dtype=None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``budget_name`` of a nested checkpoint as a standalone ``nemotron_h`` checkpoint in ``out_dir``.

    The result has no ``elastic`` section, opens with :meth:`HybridLM.from_pretrained` and with
    transformers' ``NemotronHForCausalLM``, and computes what the nested weights compute under
    that budget's hard mask. Tokenizer files beside the source are copied. The weights are in the published
    layout (:mod:`model.layout`), sharded with an index above ``max_shard_size``.
    """
    info = read_elastic(checkpoint_dir)
    budget = info.budget(budget_name)
    try:
        extract_config(info.config, budget.architecture, info.depth_order)
    except ValueError as err:
        raise ValueError(f"budget {budget_name!r} cannot be written as a standalone checkpoint: {err}") from None
    sub = _extract(checkpoint_dir, info, budget, dtype)
    return sub.save_pretrained(out_dir, extra_files=tokenizer_files(checkpoint_dir), max_shard_size=max_shard_size)
