"""Depth importance: how much the logits move when whole layers are removed, ranked greedily.

The damage of removing the layer set R is ``d(R) = ||z - z_R||^2 / ||z||^2`` (``z`` the untouched
parent's logits, ``z_R`` those with R skipped through ``LayerMask(keep=0)``), averaged over the
calibration batches. Greedy: remove the layer with the smallest ``d(R + {j})``, re-score, repeat;
the depth ranking is the removal order read backwards. ``L (L + 1) / 2`` masked forwards per batch, plus
one untouched forward per batch and round (its logits are not kept between rounds), in one process
(not additive).

Design notes: docs/elastic.md ("Depth importance").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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


NMSE_CHUNK_ROWS = 512
"""Token rows per float64 chunk of :func:`nmse` (a chunk is ``rows x vocabulary x 8`` bytes per temporary:
512 x 131k vocabulary = 0.5 GB)."""


def nmse(full: Tensor, other: Tensor, chunk_rows: int = NMSE_CHUNK_ROWS) -> float:
    """``||full - other||^2 / ||full||^2`` in float64, both (batch, seq, vocab), ``chunk_rows`` token rows at a
    time: the float64 temporaries are one chunk, not four copies of the whole logits (17 GB each for one
    4 x 4096 x 131k batch). Its reference is the one-shot expression (the tests compare them)."""
    f_rows = full.reshape(-1, full.shape[-1])
    o_rows = other.reshape(-1, other.shape[-1])
    num = torch.zeros((), dtype=torch.float64, device=full.device)
    den = torch.zeros((), dtype=torch.float64, device=full.device)
    for start in range(0, f_rows.shape[0], chunk_rows):
        f = f_rows[start : start + chunk_rows].double()
        num += (f - o_rows[start : start + chunk_rows].double()).pow(2).sum()
        den += f.pow(2).sum()
    return float(num / den.clamp_min(1e-30))


@torch.no_grad()
def depth_ranking(
    model, batches: Sequence[Tensor], progress: bool | Callable[[int, str, str], Any] = True
) -> DepthRanking:
    """Greedy depth ranking of ``model`` (a :class:`~model.hybrid.HybridLM`) on ``batches``.

    ``batches``: input ids, each (batch, seq) long. Returns a :class:`DepthRanking`. ``progress``: a tqdm
    bar when True, or ``progress(total, desc, unit)`` making an object with ``update(n)`` and ``close()``.

    Memory: one batch's untouched logits and one masked forward's logits are alive at a time (plus
    :func:`nmse`'s float64 chunks). Each greedy round runs batch by batch: the batch's full logits are
    computed (again) at the start of its round, then compared with every candidate removal on it, so
    no batch's logits are kept across rounds (one (batch, seq, vocab) tensor is 4.3 GB in bf16 at
    4 x 4096 x 131k). That costs one extra forward per batch and round (``L`` per batch against the
    ``L (L + 1) / 2`` masked ones) and gives the scores of keeping every batch's logits: each
    candidate's per-batch nMSEs are summed in batch order, then averaged.
    """
    if not batches:
        raise ValueError("depth ranking needs at least one calibration batch")
    was_training = model.training
    model.eval()
    device = model.device
    ids = [b.to(device) for b in batches]
    n_layers = len(model.model.layers)

    def round_scores(removed: list[int], candidates: list[int]) -> list[float]:
        """Mean nMSE over the batches of removing ``removed + [j]``, for each ``j`` in ``candidates``."""
        masks = [removal_mask(n_layers, removed + [j], device) for j in candidates]
        sums = [0.0] * len(candidates)
        for x in ids:
            full = model(x).logits
            for i, mask in enumerate(masks):
                sums[i] += nmse(full, model(x, mask=mask).logits)
                if bar is not None:
                    bar.update(1)
            del full
        return [total / len(ids) for total in sums]

    bar = None
    total = n_layers * (n_layers + 1) // 2 * len(ids)
    if callable(progress):  # the caller's display (the rank stage's: plain lines inside a Ray task)
        bar = progress(total, "depth", "forward")
    elif progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="depth", unit="forward")
    removed: list[int] = []
    removal_scores: list[float] = []
    single: list[float] = []
    try:
        while len(removed) < n_layers:
            candidates = [j for j in range(n_layers) if j not in removed]
            scores = round_scores(removed, candidates)
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
