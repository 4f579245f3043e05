"""Training batches as torch tensors: one example per row, or several packed into each row.

Loss-mask convention (shared by every trainer): ``loss_mask[i, t]`` is True when the NEXT token
``input_ids[i, t + 1]`` is a target, so with ``logits`` of shape ``(n, seq_len, vocab)``::

    loss = cross_entropy(logits[:, :-1][mask[:, :-1]], input_ids[:, 1:][mask[:, :-1]])

Targets are everything after the prompt: ``<think>``, the trace, ``</think>``, ``A:``, the answer
and ``<eos>``. The prompt itself (``<bos>Q:...\\n``), padding and the boundary between two packed
examples (predicting the next example's ``<bos>``) are never targets.

Batches are deterministic by ``(seed, index)``: batch ``k`` draws its problems from a seed derived
from both, so a resumed run continues at batch ``k`` with exactly the data it would have seen.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

import torch

from components.data.reasoning import (
    BOS,
    Problem,
    ProblemConfig,
    derive_seed,
    format_training_text,
    generate_problems,
    iter_problems,
)

__all__ = ["BatchStream", "TrainBatch", "batch_stream", "encode_examples", "make_batch", "pack_examples"]

# Problems drawn (and tokenized together) at a time while filling packed rows.
_PACK_CHUNK = 256


class TokenizerLike(Protocol):
    """What the batch builders need from a tokenizer (``CharTokenizer`` satisfies it)."""

    pad_id: int
    bos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass
class TrainBatch:
    """A batch of token rows.

    Attributes:
        input_ids: ``LongTensor (n, seq_len)``; every example starts with ``<bos>``, rows are
            right-padded with the pad id.
        loss_mask: ``BoolTensor (n, seq_len)``; True where the next token is a target.
        segment_ids: ``LongTensor (n, seq_len)``; index of the example within its row (0 when not
            packed), -1 on padding; lets a model build per-example attention masks if it wants.
        n_examples: number of examples in the batch.
        n_truncated: how many examples were cut to fit ``seq_len``.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    n_examples: int
    n_truncated: int = 0

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
        )


def _encode_many(tokenizer: TokenizerLike, texts: Sequence[str]) -> list[list[int]]:
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if encode_batch is not None:
        return encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def _tokenize(problems: Sequence[Problem], tokenizer: TokenizerLike) -> list[tuple[list[int], int]]:
    """Per problem: token ids of the full training text and the length of its context
    (``<bos>`` + prompt), i.e. the index of the first target token."""
    full = _encode_many(tokenizer, [format_training_text(p) for p in problems])
    ctx = _encode_many(tokenizer, [BOS + p.prompt for p in problems])
    return [(ids, len(c)) for ids, c in zip(full, ctx, strict=True)]


def _place(
    row_ids: list[int],
    row_mask: list[bool],
    row_seg: list[int],
    start: int,
    ids: list[int],
    n_ctx: int,
    seg: int,
) -> None:
    """Write one (already truncated) example at ``start`` and set its mask by the per-example rule."""
    row_ids[start : start + len(ids)] = ids
    row_seg[start : start + len(ids)] = [seg] * len(ids)
    # Position t predicts t + 1: targets are example tokens n_ctx .. len-1, so t in [n_ctx-1, len-2].
    for t in range(max(n_ctx - 1, 0), len(ids) - 1):
        row_mask[start + t] = True


def _to_batch(rows: list[list[tuple[list[int], int]]], seq_len: int, pad_id: int, n_truncated: int) -> TrainBatch:
    ids_rows, mask_rows, seg_rows = [], [], []
    for row in rows:
        r_ids, r_mask, r_seg = [pad_id] * seq_len, [False] * seq_len, [-1] * seq_len
        pos = 0
        for seg, (ids, n_ctx) in enumerate(row):
            _place(r_ids, r_mask, r_seg, pos, ids, n_ctx, seg)
            pos += len(ids)
        ids_rows.append(r_ids)
        mask_rows.append(r_mask)
        seg_rows.append(r_seg)
    n_examples = sum(len(r) for r in rows)
    return TrainBatch(
        input_ids=torch.tensor(ids_rows, dtype=torch.long).reshape(len(rows), seq_len),
        loss_mask=torch.tensor(mask_rows, dtype=torch.bool).reshape(len(rows), seq_len),
        segment_ids=torch.tensor(seg_rows, dtype=torch.long).reshape(len(rows), seq_len),
        n_examples=n_examples,
        n_truncated=n_truncated,
    )


def _warn_truncated(n_truncated: int, n: int, seq_len: int) -> None:
    if n_truncated:
        warnings.warn(
            f"{n_truncated} of {n} examples are longer than seq_len={seq_len} and were truncated",
            stacklevel=3,
        )


def encode_examples(problems: Sequence[Problem], tokenizer: TokenizerLike, seq_len: int) -> TrainBatch:
    """One example per row: ``input_ids``/``loss_mask`` of shape ``(len(problems), seq_len)``.

    Longer examples are truncated (counted in ``n_truncated`` and warned about).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    rows, n_truncated = [], 0
    for ids, n_ctx in _tokenize(problems, tokenizer):
        if len(ids) > seq_len:
            ids, n_truncated = ids[:seq_len], n_truncated + 1
        rows.append([(ids, n_ctx)])
    _warn_truncated(n_truncated, len(problems), seq_len)
    return _to_batch(rows, seq_len, tokenizer.pad_id, n_truncated)


class _Packer:
    """Greedy in-order packing: an example that does not fit the current row starts the next row
    (examples are never split across rows; an example longer than a row is truncated alone)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.rows: list[list[tuple[list[int], int]]] = []
        self.current: list[tuple[list[int], int]] = []
        self.used = 0
        self.n_truncated = 0

    def fits(self, n_tokens: int) -> bool:
        """Whether an example of ``n_tokens`` goes into the current row (an empty row takes any)."""
        return not self.current or self.used + n_tokens <= self.seq_len

    def add(self, ids: list[int], n_ctx: int) -> None:
        if len(ids) > self.seq_len:
            ids, self.n_truncated = ids[: self.seq_len], self.n_truncated + 1
        if not self.fits(len(ids)):
            self.close()
        self.current.append((ids, n_ctx))
        self.used += len(ids)

    def close(self) -> None:
        if self.current:
            self.rows.append(self.current)
        self.current, self.used = [], 0


def pack_examples(problems: Sequence[Problem], tokenizer: TokenizerLike, seq_len: int) -> TrainBatch:
    """Several examples per row, in order, each starting with ``<bos>``; as many rows as needed.

    There is no reset between packed examples in the tensors themselves: ``segment_ids`` tells
    them apart. The loss mask follows the per-example rule (see module docstring).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    packer = _Packer(seq_len)
    for ids, n_ctx in _tokenize(problems, tokenizer):
        packer.add(ids, n_ctx)
    packer.close()
    _warn_truncated(packer.n_truncated, len(problems), seq_len)
    return _to_batch(packer.rows, seq_len, tokenizer.pad_id, packer.n_truncated)


def make_batch(
    config: ProblemConfig,
    tokenizer: TokenizerLike,
    batch_size: int,
    seq_len: int,
    seed: int,
    index: int,
    pack: bool = False,
    exclude: Iterable[str] | None = None,
) -> TrainBatch:
    """Batch number ``index`` of the stream ``seed``: ``batch_size`` rows of fresh problems.

    With ``pack`` the rows are filled with as many problems as fit; otherwise one problem per row.
    ``exclude`` lists prompts never to train on (e.g. :func:`~components.data.reasoning.eval_prompts`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    problem_seed = derive_seed("batch", seed, index)
    if not pack:
        problems = generate_problems(batch_size, config, problem_seed, exclude=exclude)
        return encode_examples(problems, tokenizer, seq_len)
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    packer = _Packer(seq_len)
    stream = iter_problems(config, problem_seed, exclude=exclude)
    n_seen = 0
    while len(packer.rows) < batch_size:
        chunk = list(islice(stream, _PACK_CHUNK))
        for ids, n_ctx in _tokenize(chunk, tokenizer):
            if len(packer.rows) == batch_size - 1 and not packer.fits(len(ids)):
                # The last row is full; the example that overflows it is dropped (data are fresh anyway).
                packer.close()
                break
            packer.add(ids, n_ctx)
            n_seen += 1
    _warn_truncated(packer.n_truncated, n_seen, seq_len)
    return _to_batch(packer.rows, seq_len, tokenizer.pad_id, packer.n_truncated)


class BatchStream(Iterator[TrainBatch]):
    """Infinite deterministic stream of :func:`make_batch` batches; ``index`` is the next batch."""

    def __init__(
        self,
        config: ProblemConfig,
        tokenizer: TokenizerLike,
        batch_size: int,
        seq_len: int,
        seed: int,
        pack: bool = False,
        start: int = 0,
        exclude: Iterable[str] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.pack = pack
        self.index = start
        # Frozen once so every batch rejects against the same set.
        self.exclude = frozenset(exclude) if exclude else None

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> TrainBatch:
        batch = make_batch(
            self.config,
            self.tokenizer,
            self.batch_size,
            self.seq_len,
            self.seed,
            self.index,
            pack=self.pack,
            exclude=self.exclude,
        )
        self.index += 1
        return batch

    def skip(self, n: int) -> BatchStream:
        """Jump ``n`` batches ahead without building them (resume at batch ``index + n``)."""
        if n < 0:
            raise ValueError(f"cannot skip a negative number of batches ({n})")
        self.index += n
        return self


def batch_stream(
    config: ProblemConfig,
    tokenizer: TokenizerLike,
    batch_size: int,
    seq_len: int,
    seed: int,
    pack: bool = False,
    start: int = 0,
    exclude: Iterable[str] | None = None,
) -> BatchStream:
    """Infinite stream of fresh batches, deterministic by ``seed``; ``start`` (or ``.skip(k)``)
    resumes at batch ``k`` exactly."""
    return BatchStream(config, tokenizer, batch_size, seq_len, seed, pack=pack, start=start, exclude=exclude)
