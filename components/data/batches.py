"""Training batches as torch tensors: tokenized examples placed one per row, or packed several per row.

Loss-mask convention (shared by every trainer): ``loss_mask[i, t]`` is True when the NEXT token
``input_ids[i, t + 1]`` is a target, so with ``logits`` of shape ``(n, seq_len, vocab)``::

    loss = cross_entropy(logits[:, :-1][mask[:, :-1]], input_ids[:, 1:][mask[:, :-1]])

Which tokens are targets is decided per example by :mod:`components.data.render` (assistant turns
of chat rows, every token of text rows). The boundary between two packed examples (predicting the
next example's first token), padding, and the last position of a row are never targets.

Rows longer than ``seq_len`` are never cut silently: ``overlong="truncate"`` keeps their first
``seq_len`` tokens, ``overlong="drop"`` leaves them out; both are counted in the batch
(``n_truncated`` / ``n_dropped``) and warned about with the count and ``seq_len``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from components.data.render import Example

__all__ = ["TrainBatch", "assemble_batch"]


@dataclass
class TrainBatch:
    """A batch of token rows.

    Attributes:
        input_ids: ``LongTensor (n, seq_len)``; rows right-padded with the pad id.
        loss_mask: ``BoolTensor (n, seq_len)``; True where the next token is a target.
        segment_ids: ``LongTensor (n, seq_len)``; index of the example within its row (0 when not
            packed), -1 on padding; lets a model build per-example attention masks if it wants.
        n_examples: examples placed in the batch.
        n_truncated: examples longer than ``seq_len`` that were cut to it.
        n_dropped: examples longer than ``seq_len`` that were left out (``overlong="drop"``).
        n_skipped: packed batches only: examples of the step's window that did not fit in the rows.
        source_examples: examples placed, per source name.
        source_tokens: tokens placed, per source name.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    n_examples: int
    n_truncated: int = 0
    n_dropped: int = 0
    n_skipped: int = 0
    source_examples: dict[str, int] = field(default_factory=dict)
    source_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def targets(self) -> torch.Tensor:
        """``LongTensor (n, seq_len)``: ``input_ids`` shifted left by one; the last column repeats the
        last input (it is never masked in)."""
        return torch.cat([self.input_ids[:, 1:], self.input_ids[:, -1:]], dim=1)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with tensors on ``device``."""
        return TrainBatch(
            self.input_ids.to(device),
            self.loss_mask.to(device),
            self.segment_ids.to(device),
            self.n_examples,
            self.n_truncated,
            self.n_dropped,
            self.n_skipped,
            dict(self.source_examples),
            dict(self.source_tokens),
        )


def _first_fit(lengths: Sequence[int], batch_size: int, seq_len: int) -> tuple[list[list[int]], list[int]]:
    """Pack examples (in order) into at most ``batch_size`` rows: each goes to the first row with room,
    else opens a new row; returns the example indices per row and the indices that did not fit."""
    rows: list[list[int]] = []
    used: list[int] = []
    skipped: list[int] = []
    for k, n in enumerate(lengths):
        for r in range(len(rows)):
            if used[r] + n <= seq_len:
                rows[r].append(k)
                used[r] += n
                break
        else:
            if len(rows) < batch_size:
                rows.append([k])
                used.append(n)
            else:
                skipped.append(k)
    return rows, skipped


def assemble_batch(
    examples: Sequence[Example],
    batch_size: int,
    seq_len: int,
    pad_id: int,
    pack: bool = False,
    overlong: Literal["truncate", "drop"] = "truncate",
) -> TrainBatch:
    """Place ``examples`` into a ``(batch_size, seq_len)`` batch.

    Without ``pack``, example ``k`` goes to row ``k`` (``examples`` holds ``batch_size`` of them; a
    dropped one leaves its row as padding). With ``pack``, examples go first-fit into the rows in
    order; those that fit nowhere are counted in ``n_skipped``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if not pack and len(examples) != batch_size:
        raise ValueError(f"one example per row: got {len(examples)} examples for batch_size={batch_size}")
    n_truncated = n_dropped = 0
    kept: list[Example | None] = []
    for ex in examples:
        if len(ex) > seq_len:
            if overlong == "drop":
                n_dropped += 1
                kept.append(None)
                continue
            n_truncated += 1
            ex = Example(ex.ids[:seq_len], ex.targets[:seq_len], ex.origin, ex.source)
        kept.append(ex)
    if pack:
        present = [k for k, ex in enumerate(kept) if ex is not None]
        packed, skipped = _first_fit([len(kept[k]) for k in present], batch_size, seq_len)  # type: ignore[arg-type]
        layout = [[present[j] for j in row] for row in packed]
        n_skipped = len(skipped)
    else:
        layout = [[k] if ex is not None else [] for k, ex in enumerate(kept)]
        n_skipped = 0
    ids = [[pad_id] * seq_len for _ in range(batch_size)]
    mask = [[False] * seq_len for _ in range(batch_size)]
    seg = [[-1] * seq_len for _ in range(batch_size)]
    source_examples: dict[str, int] = {}
    source_tokens: dict[str, int] = {}
    for r, row in enumerate(layout):
        pos = 0
        for s, k in enumerate(row):
            ex = kept[k]
            assert ex is not None
            n = len(ex)
            ids[r][pos : pos + n] = ex.ids
            seg[r][pos : pos + n] = [s] * n
            # Position t predicts t + 1 of the same example; the example's last position predicts nothing.
            mask[r][pos : pos + n - 1] = ex.targets[1:]
            pos += n
            source_examples[ex.source] = source_examples.get(ex.source, 0) + 1
            source_tokens[ex.source] = source_tokens.get(ex.source, 0) + n
    n_examples = sum(len(row) for row in layout)
    for count, what in (
        (n_truncated, "truncated to it (data.overlong=truncate)"),
        (n_dropped, "left out (data.overlong=drop)"),
    ):
        if count:
            warnings.warn(
                f"{count} of {len(examples)} examples are longer than seq_len={seq_len} and were {what}",
                stacklevel=3,
            )
    return TrainBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        segment_ids=torch.tensor(seg, dtype=torch.long),
        n_examples=n_examples,
        n_truncated=n_truncated,
        n_dropped=n_dropped,
        n_skipped=n_skipped,
        source_examples=source_examples,
        source_tokens=source_tokens,
    )
