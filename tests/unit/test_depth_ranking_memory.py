"""The depth ranking that keeps one batch's logits at a time gives the ranking of the straightforward one that keeps
every batch's logits and computes each nMSE in one float64 expression."""

from __future__ import annotations

import pytest
import torch

from model.config import HybridConfig
from model.elastic.depth import depth_ranking, nmse, removal_mask
from model.hybrid import HybridLM
from tests.conftest import TINY


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _reference(model: HybridLM, batches: list[torch.Tensor]) -> tuple[list[int], list[float], list[float]]:
    """Greedy removal keeping every batch's full logits, nMSE as one expression: (order, scores, single scores)."""
    n = len(model.model.layers)
    with torch.no_grad():
        full = [model(x).logits for x in batches]

        def damage(removed: list[int]) -> float:
            mask = removal_mask(n, removed)
            total = 0.0
            for x, z in zip(batches, full, strict=True):
                f = z.double()
                total += float((f - model(x, mask=mask).logits.double()).pow(2).sum() / f.pow(2).sum())
            return total / len(batches)

        removed: list[int] = []
        scores_at: list[float] = []
        single: list[float] = []
        while len(removed) < n:
            candidates = [j for j in range(n) if j not in removed]
            scores = [damage(removed + [j]) for j in candidates]
            single = single or scores
            best = min(range(len(candidates)), key=lambda i: (scores[i], candidates[i]))
            removed.append(candidates[best])
            scores_at.append(scores[best])
    return removed, scores_at, single


def test_depth_ranking_matches_the_reference_that_keeps_every_batch():
    config = HybridConfig(**{**TINY, "pattern": "M*ME-E*M"})
    model = HybridLM(config).init_weights(3).eval()
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, config.vocab_size, (2, 11), generator=g) for _ in range(3)]
    order, scores, single = _reference(model, batches)
    got = depth_ranking(model, batches, progress=False)
    assert got.removal_order == order
    assert got.removal_scores == pytest.approx(scores, rel=1e-12, abs=0)
    assert got.single_scores == pytest.approx(single, rel=1e-12, abs=0)
    assert len(set(single)) == len(single)  # no ties: the order is decided by the scores, not by the index


def test_chunked_nmse_equals_the_one_shot_expression():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 7, 50, generator=g)
    other = full + 0.1 * torch.randn(3, 7, 50, generator=g)
    f = full.double()
    expected = float((f - other.double()).pow(2).sum() / f.pow(2).sum())
    for rows in (1, 4, 21, 1000):  # one row, a remainder chunk, exactly all rows, more than all rows
        assert nmse(full, other, chunk_rows=rows) == pytest.approx(expected, rel=1e-13, abs=0)
    assert nmse(full, full) == 0.0
    as_bf16 = nmse(full.bfloat16(), other.bfloat16(), chunk_rows=4)
    assert as_bf16 == pytest.approx(
        float(
            (full.bfloat16().double() - other.bfloat16().double()).pow(2).sum() / full.bfloat16().double().pow(2).sum()
        ),
        rel=1e-13,
    )
