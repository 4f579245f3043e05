"""Loading a checkpoint for serving: one weight copy, every budget a view of it, and what /v1/models says;
and the check of a local checkpoint that ``star-elastic serve`` runs before Ray starts.

The folder is read ONCE; every budget is a :class:`~model.decode.budget_view.BudgetModel` of a
:class:`~model.decode.budget_view.BudgetRegistry`: views of the parent's tensors (dense), so serving every
budget costs about the memory of the full one; for FP8/NVFP4, each smaller budget's own slice of the
quantized tensors (``quantized_budgets: sliced``, computing at its own size) or the parent's quantized
modules under the budget's hard mask (``masked``, no extra memory, the parent's compute per token).
:func:`check_checkpoint` / :func:`preflight` find everything a replica
would trip over from the safetensors headers and the manifest, and report it as one line.

Design notes (what the check covers): docs/serving.md ("Loading and the pre-flight check").
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from components.data.tokenizer import TextTokenizer
from components.serving.config import ServingConfig, load_config
from model.checkpoint import MANIFEST_NAME, CheckpointError, inspect_checkpoint
from model.decode.budget_view import BudgetRegistry
from model.elastic.arch import Architecture
from model.phases import PhaseTokens

if TYPE_CHECKING:
    from model.quant import QuantLinear

log = logging.getLogger("star_elastic.serving")


@dataclass(frozen=True)
class BudgetCard:
    """What ``/v1/models`` says about one budget."""

    name: str
    total_params: int
    active_params: int
    active_fraction: float
    architecture: dict[str, Any]


def no_manifest_warning(folder: Path) -> str | None:
    """The one-line warning for a checkpoint without ``manifest.json`` (None when it has one)."""
    if (folder / MANIFEST_NAME).is_file():
        return None
    return f"{folder}: no {MANIFEST_NAME}; loading without an integrity check (corrupt files may go unnoticed)"


@dataclass
class LoadedModel:
    """The registry of budget models over one weight copy, the tokenizer, and the budget cards."""

    registry: BudgetRegistry
    tokenizer: TextTokenizer
    tokens: PhaseTokens
    cards: dict[str, BudgetCard]
    format: str
    folder: Path
    threads: int
    """The torch thread count the decode plans were built, measured and compiled with: the replica's
    ``torch_threads``, set here before the plans, or the process's count. The decode thread runs with it
    (:class:`~components.serving.engine.Engine`): a compiled graph guards on the count, so any other would
    compile every graph again under traffic."""
    dense_copies: tuple[QuantLinear, ...] = ()
    """The quantized modules of every budget that keep a dense copy of their weight (each once), found at load
    once their copies are allotted (``cache_dequantized``, ``dequant_cache_mib``); each makes its copy at its
    first call (:func:`~model.quant.qlinear.held_dense_bytes` says what they hold)."""

    @classmethod
    def load(cls, folder: str | Path, config: ServingConfig) -> LoadedModel:
        from model.elastic.export import read_elastic
        from model.elastic.params import count_params
        from model.hybrid import HybridLM

        if config.torch_threads:  # before the decode plans are built: they hold for one count (threads)
            torch.set_num_threads(config.torch_threads)
        folder = Path(folder)
        warning = no_manifest_warning(folder)
        if warning:
            log.warning(warning)
        info = inspect_checkpoint(folder, verify=False)  # the loaders below check the manifest themselves
        raw, fmt = info.raw, info.format
        if config.format != "auto" and config.format != fmt:
            raise ValueError(f"{folder}: the checkpoint holds {fmt} weights but format={config.format!r} was asked")
        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
        if fmt == "dense":
            full = HybridLM.from_pretrained(folder, dtype=dtype)
        else:
            from model.quant import load_quantized_model

            full = load_quantized_model(folder, dtype=dtype, cache_dequantized=config.cache_dequantized)
        device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        full = full.to(device).eval()
        if "elastic" in raw:
            info = read_elastic(folder)
            archs, order = info.architectures, info.depth_order
            cards = {
                b.name: BudgetCard(b.name, b.total_params, b.active_params, b.active_fraction, b.architecture.to_dict())
                for b in info.budgets
            }
        else:
            count = count_params(full.config)
            archs, order = {"full": Architecture()}, None
            cards = {"full": BudgetCard("full", count.total, count.active, 1.0, {})}
        if config.budgets is not None:
            unknown = sorted(set(config.budgets) - set(archs))
            if unknown:
                raise ValueError(f"budgets {unknown} are not in the checkpoint; it has {sorted(archs)}")
            archs = {n: a for n, a in archs.items() if n in config.budgets}
        sliced = None
        if fmt != "dense" and config.quantized_budgets == "sliced":  # each budget at its own size
            from model.decode.budget_view import sliced_quantized_budgets, smaller_budgets

            names = smaller_budgets(full.config, archs, order)
            sliced = sliced_quantized_budgets(folder, names, dtype, config.cache_dequantized)
            sliced = {n: m.to(device).eval() for n, m in sliced.items()}
        registry = BudgetRegistry(full, archs, order, sliced=sliced)  # dense: every budget a view of one copy
        if fmt != "dense" and config.dequant_cache_mib is not None:
            from model.quant import bound_dequantized_caches

            budgets = [registry.get(n) for n in registry.names]  # largest first
            dense = full.model.embeddings.weight.dtype  # the activations' dtype, the copies'
            used = bound_dequantized_caches(budgets, int(config.dequant_cache_mib * 2**20), dense)
            log.info("dense copies of quantized weights: up to %.1f MiB (bound %.1f MiB)", used / 2**20,
                     config.dequant_cache_mib)  # fmt: skip
        dense_copies: tuple[QuantLinear, ...] = ()
        if fmt != "dense":
            from model.quant import dense_copy_holders

            dense_copies = tuple(dense_copy_holders([registry.get(n) for n in registry.names]))
        copy_bytes = None if config.decode_copy_mib is None else int(config.decode_copy_mib * 2**20)
        prepare_decode(registry, copy_bytes, config.decode_compile)
        tokenizer = TextTokenizer.load(folder, config.markers)
        cards = {n: cards[n] for n in registry.names}  # largest first
        tokens = PhaseTokens.from_tokenizer(tokenizer)
        return cls(registry, tokenizer, tokens, cards, fmt, folder, torch.get_num_threads(), dense_copies)


def prepare_decode(registry: BudgetRegistry, max_copy_bytes: int | None = None, compiled: bool = False) -> None:
    """Build every budget's decode plan now, so that its kernel measurements (model/decode/kernels.py; cached
    on disk per machine) and, with ``compiled``, its compiled steps, one row and several (model/decode/compiled.py,
    compiled and measured against the eager steps) are done at start-up and never by a first request; logs
    what it took.

    ``max_copy_bytes``: what the plans' weight copies may take for all budgets together, largest budget
    first (None: the default bound for each budget; 0: every budget reads the one weight copy)."""
    start = time.perf_counter()
    summaries = []
    left = max_copy_bytes
    with torch.inference_mode():
        for name in registry.names:
            plan = registry.get(name).decode_plan(max_copy_bytes=left, compiled=compiled)
            if plan is not None:
                detail = plan.kernels.summary() + (f"; {plan.compile_summary()}" if compiled else "")
                summaries.append(f"{name}: {detail}")
                if left is not None:
                    left = max(0, left - plan.copied_bytes())
    detail = "; " + "; ".join(summaries) if summaries else ""
    log.info("decode plans ready in %.1fs%s", time.perf_counter() - start, detail)


# ---------------------------------------------------------------------- the check before Ray starts
def _check_quantized(folder: Path, config: Any, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
    from model.quant.checkpoint import build_quantized_model

    renamed = {("model." + k[len("backbone.") :] if k.startswith("backbone.") else k): v for k, v in tensors.items()}
    build_quantized_model(config, renamed, fmt, where=str(folder))  # checks names, shapes and dtypes (meta)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def check_checkpoint(folder: str | Path, config: ServingConfig | None = None) -> list[str]:
    """Check a local checkpoint folder as a replica would load it; returns warnings (one line each).

    Raises :class:`~model.checkpoint.CheckpointError` (a ``ValueError``) with one line naming the
    file and the problem. See the module docstring for what is checked.
    """
    from model.elastic.export import read_elastic
    from model.hybrid import HybridLM

    config = config or ServingConfig()
    folder = Path(folder)
    try:
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: no such checkpoint folder")
        warnings = [w for w in [no_manifest_warning(folder)] if w]
        if config.format != "auto":  # the format first: a wrong one is the clearest message
            fmt = inspect_checkpoint(folder, verify=False).format
            if config.format != fmt:
                raise CheckpointError(
                    f"{folder}: the checkpoint holds {fmt} weights but format={config.format!r} was asked"
                )
        info = inspect_checkpoint(folder)
        hybrid, fmt = info.config, info.format
        if fmt == "dense":
            HybridLM.check_checkpoint(info)
        else:
            _check_quantized(folder, hybrid, fmt, info.tensors)
        names = ["full"]
        if info.elastic:
            elastic = read_elastic(folder)
            elastic.space.validate_against(hybrid)
            names = elastic.names
        if config.budgets is not None:
            unknown = sorted(set(config.budgets) - set(names))
            if unknown:
                raise CheckpointError(f"{folder}: budgets {unknown} are not in the checkpoint; it has {names}")
        try:
            tok = TextTokenizer.load(folder, config.markers)
        except Exception as err:
            why = str(err).replace(f"{folder}: ", "")
            raise CheckpointError(f"{folder}: the tokenizer does not load: {why}") from None
        if tok.vocab_size > hybrid.vocab_size:
            raise CheckpointError(
                f"{folder}: the tokenizer has {tok.vocab_size} ids but the model's vocab_size is {hybrid.vocab_size}"
            )
        PhaseTokens.from_tokenizer(tok)  # a vocabulary with no line break cannot cut thinking at a cap
    except CheckpointError as err:
        raise CheckpointError(_one_line(str(err))) from None
    except Exception as err:  # a config or section error: the same one line
        raise CheckpointError(_one_line(f"{folder}: {err}" if str(folder) not in str(err) else str(err))) from None
    return warnings


def preflight(model_uri: str, config: ServingConfig | dict[str, Any] | str | Path | None = None) -> list[str]:
    """What ``star-elastic serve`` runs first: check a local checkpoint, print its warnings on stderr.

    Remote URIs (``s3://``, ``models:/``) are left to the replica. Raises ``CheckpointError`` (one
    line) for a broken checkpoint, ``FileNotFoundError`` for a path that does not exist.
    """
    if model_uri.startswith(("s3://", "models:/", "runs:/")):
        return []
    cfg = load_config(config)
    if not Path(model_uri).exists():
        raise FileNotFoundError(f"{model_uri}: no such checkpoint folder")
    warnings = check_checkpoint(model_uri, cfg)
    for w in warnings:
        print(f"star-elastic: warning: {w}", file=sys.stderr, flush=True)
    return warnings
