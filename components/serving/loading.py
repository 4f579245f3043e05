"""Loading a checkpoint for serving: one weight copy, every budget a view of it, and what /v1/models says.

The checkpoint folder is read ONCE; every budget is a :class:`~model.budget_view.BudgetModel` of a
:class:`~model.budget_view.BudgetRegistry`, i.e. views of the parent's tensors (or, for FP8/NVFP4
weights, which cannot be viewed as dense slices, the parent's own quantized modules under the
budget's hard mask). Serving every budget therefore costs about the memory of serving the full one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from components.data.tokenizer import CharTokenizer
from components.serving.config import ServingConfig
from model.budget_view import BudgetRegistry
from model.elastic.arch import Architecture
from model.phases import PhaseTokens


@dataclass(frozen=True)
class BudgetCard:
    """What ``/v1/models`` says about one budget."""

    name: str
    total_params: int
    active_params: int
    active_fraction: float
    architecture: dict[str, Any]


@dataclass
class LoadedModel:
    """The registry of budget models over one weight copy, the tokenizer, and the budget cards."""

    registry: BudgetRegistry
    tokenizer: CharTokenizer
    tokens: PhaseTokens
    cards: dict[str, BudgetCard]
    format: str
    folder: Path

    @classmethod
    def load(cls, folder: str | Path, config: ServingConfig) -> LoadedModel:
        from model.elastic.export import read_elastic
        from model.elastic.params import count_params
        from model.hybrid import HybridLM

        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        algo = (raw.get("quantization_config") or {}).get("quant_algo")
        fmt = {"FP8": "fp8", "NVFP4": "nvfp4"}.get(algo, "dense")
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
        registry = BudgetRegistry(full, archs, order, nested=True)  # one weight copy, laid out for budgets
        tokenizer = CharTokenizer.load(folder)
        cards = {n: cards[n] for n in registry.names}  # largest first
        return cls(registry, tokenizer, PhaseTokens.from_tokenizer(tokenizer), cards, fmt, folder)
