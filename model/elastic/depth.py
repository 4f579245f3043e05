"""Depth importance: how much the logits move when whole layers are removed, ranked greedily.

The damage of removing the layer set R is ``d(R) = ||z - z_R||^2 / ||z||^2`` (``z`` the untouched
parent's logits, ``z_R`` those with R skipped through ``LayerMask(keep=0)``), averaged over the
calibration batches. Greedy: remove the layer with the smallest ``d(R + {j})``, re-score, repeat;
the depth ranking is the removal order read backwards. ``L (L + 1) / 2`` forwards per batch, in one
process (not additive).

Design notes: docs/elastic.md ("Depth importance").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from model.masks import LayerMask, ModelMask


class DepthRanking(BaseModel):
    """Greedy depth ranking.

    ``removal_order``: layers in the order they are dropped (least important first);
    ``removal_scores[t]``: the averaged nMSE after removing ``removal_order[: t + 1]``;
    ``single_scores[j]``: the nMSE with only layer j removed (the first greedy round);
    ``order``: most important first (``removal_order`` reversed), the order a depth budget keeps.
    """

    model_config = ConfigDict(extra="forbid")

    removal_order: list[int] = Field(description="Layers in removal order, least important first.")
    removal_scores: list[float] = Field(description="nMSE of the parent after each cumulative removal.")
    single_scores: list[float] = Field(description="nMSE with one layer removed, per layer index.")

    @property
    def order(self) -> list[int]:
        return list(reversed(self.removal_order))

    def kept_layers(self, n_keep: int) -> list[int]:
        """Indices (ascending) of the ``n_keep`` most important layers."""
        return sorted(self.order[:n_keep])


def removal_mask(num_layers: int, removed: Sequence[int], device: torch.device | None = None) -> ModelMask:
    """A :class:`ModelMask` that skips the ``removed`` layers (keep = 0) and leaves the others whole."""
    gone = set(removed)
    zero = torch.tensor(0.0, device=device)
    return ModelMask(layers=[LayerMask(keep=zero) if i in gone else LayerMask() for i in range(num_layers)])


def _nmse(full: Tensor, other: Tensor) -> float:
    """||full - other||^2 / ||full||^2 in float64 (both (batch, seq, vocab))."""
    f = full.double()
    return float((f - other.double()).pow(2).sum() / f.pow(2).sum().clamp_min(1e-30))


@torch.no_grad()
def depth_ranking(model, batches: Sequence[Tensor], progress: bool = True) -> DepthRanking:
    """Greedy depth ranking of ``model`` (a :class:`~model.hybrid.HybridLM`) on ``batches``.

    ``batches``: input ids, each (batch, seq) long. Returns a :class:`DepthRanking`.
    """
    if not batches:
        raise ValueError("depth ranking needs at least one calibration batch")
    was_training = model.training
    model.eval()
    device = model.device
    ids = [b.to(device) for b in batches]
    n_layers = len(model.model.layers)
    full = [model(x).logits for x in ids]

    def damage(removed: list[int]) -> float:
        mask = removal_mask(n_layers, removed, device)
        return sum(_nmse(z, model(x, mask=mask).logits) for x, z in zip(ids, full, strict=True)) / len(ids)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_layers * (n_layers + 1) // 2, desc="depth", unit="eval")
    removed: list[int] = []
    removal_scores: list[float] = []
    single: list[float] = []
    try:
        while len(removed) < n_layers:
            candidates = [j for j in range(n_layers) if j not in removed]
            scores = []
            for j in candidates:
                scores.append(damage(removed + [j]))
                if bar is not None:
                    bar.update(1)
            if not removed:
                single = scores
            best = min(range(len(candidates)), key=lambda i: (scores[i], candidates[i]))
            removed.append(candidates[best])
            removal_scores.append(scores[best])
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    return DepthRanking(removal_order=removed, removal_scores=removal_scores, single_scores=single)
