"""The training stream of a ``data`` section: which rows step ``s`` of rank ``r`` trains on.

Everything is a pure function of ``(data, seed, phase, step, rank, world)``; nothing is carried from
one step to the next, so a run resumed at step ``s`` sees exactly what it would have seen. Per rank
the mixture is a sequence of slots in blocks of :data:`~components.data.sources.MIX_BLOCK` holding
each source's exact share; step ``s`` owns a fixed window of slots (packed first-fit when packing).

Design notes (blocks, windows, seeds, ``mix_by: tokens``): docs/data.md ("The training stream").
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from components.data.batches import TrainBatch, assemble_batch
from components.data.gym import GymReader
from components.data.reasoning import ProblemConfig, derive_seed
from components.data.render import Example, render_rows
from components.data.sources import (
    MIX_BLOCK,
    DataConfig,
    FilesReader,
    FilesSource,
    GeneratorReader,
    GeneratorSource,
    ReasoningGymSource,
    source_names,
)
from components.data.streaming import StreamingFilesReader
from components.data.tokenizer import TextTokenizer

__all__ = ["apportion", "describe_data", "make_batch", "make_data_batch", "mixture_slots"]

#: Examples rendered per source to measure its mean length (for packing and ``mix_by: tokens``).
PROBE_EXAMPLES = 64

_READERS: OrderedDict[tuple, Any] = OrderedDict()
_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()


def _reader(source: FilesSource | GeneratorSource | ReasoningGymSource, name: str, cache_dir: str | None) -> Any:
    """The (cached) reader of ``source``: files are resolved and opened once per process."""
    key = (source.model_dump_json(), name, cache_dir)
    if key not in _READERS:
        if isinstance(source, FilesSource):
            kind = StreamingFilesReader if source.streaming else FilesReader
            _READERS[key] = kind(source, name, cache_dir)
        elif isinstance(source, GeneratorSource):
            _READERS[key] = GeneratorReader(source, name)
        else:
            _READERS[key] = GymReader(source, name)
        if len(_READERS) > 32:
            _READERS.popitem(last=False)
    return _READERS[key]


def apportion(weights: list[float], total: int = MIX_BLOCK) -> list[int]:
    """Integer counts summing to ``total`` in proportion to ``weights`` (largest remainder; ties to
    the earlier source)."""
    s = sum(weights)
    exact = [w / s * total for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_slots(quota: list[int], base: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sources and per-source positions of the slots ``[start, start + n)`` of the stream ``base``.

    Returns:
        ``(labels, positions)``, each ``int64 (n,)``: slot ``t`` is example ``positions[t]`` of source
        ``labels[t]``'s stream.
    """
    block = sum(quota)
    pattern = np.repeat(np.arange(len(quota)), quota)
    labels, positions = [], []
    for b in range(start // block, (start + n - 1) // block + 1):
        order = np.random.default_rng(derive_seed("block", base, b)).permutation(pattern)
        # before[t]: how many earlier slots of this block belong to the same source as slot t.
        onehot = order[:, None] == np.arange(len(quota))[None, :]
        before = (np.cumsum(onehot, axis=0) - onehot)[np.arange(block), order]
        pos = b * np.asarray(quota)[order] + before
        lo, hi = max(start - b * block, 0), min(start + n - b * block, block)
        labels.append(order[lo:hi])
        positions.append(pos[lo:hi])
    return np.concatenate(labels), np.concatenate(positions)


@dataclass
class _Plan:
    """What a ``(data, tokenizer, seq_len)`` needs once: readers, slot quotas, mean lengths."""

    names: list[str]
    readers: list[Any]
    quota: list[int]
    mean_len: float  # mean example length under the mixture, capped at seq_len
    tokenizer: TextTokenizer  # held so the cache key's id() is not reused


def _stream(data: DataConfig, seed: int, phase: str, world: int, *what: object) -> int:
    """A seed of the run's data for ``what``; ranks add their own rank where their streams must differ."""
    return derive_seed("data", data.seed, seed, phase, world, *what)


def _probe(reader: Any, name: str, data: DataConfig, tok: TextTokenizer, seq_len: int) -> float:
    """Mean length (capped at ``seq_len``) of the first examples of a stream seeded for probing only."""
    rows = reader.rows(range(PROBE_EXAMPLES), derive_seed("probe", data.seed, name), 0, 1, None)
    return float(np.mean([min(len(e), seq_len) for e in render_rows(tok, rows)]))


def _plan(data: DataConfig, tok: TextTokenizer, seq_len: int) -> _Plan:
    key = (data.model_dump_json(), id(tok), seq_len)
    if key in _PLANS:
        return _PLANS[key]
    names = source_names(data.sources)
    readers = [_reader(s, n, data.cache_dir) for s, n in zip(data.sources, names, strict=True)]
    weights = data.weights()
    lengths: list[float] | None = None
    if data.pack or data.mix_by == "tokens":
        lengths = [_probe(r, n, data, tok, seq_len) for r, n in zip(readers, names, strict=True)]
    if data.mix_by == "tokens":
        assert lengths is not None
        weights = [w / n for w, n in zip(weights, lengths, strict=True)]
    quota = apportion(weights)
    for name, q, w in zip(names, quota, weights, strict=True):
        if q == 0:
            raise ValueError(
                f"source {name!r}: its share ({w / sum(weights):.2e} of the examples with mix_by={data.mix_by}) "
                f"rounds to 0 of {MIX_BLOCK}; raise its weight"
            )
    mean_len = sum(q * n for q, n in zip(quota, lengths, strict=True)) / MIX_BLOCK if lengths else float(seq_len)
    plan = _Plan(names, readers, quota, mean_len, tok)
    _PLANS[key] = plan
    if len(_PLANS) > 16:
        _PLANS.popitem(last=False)
    return plan


def make_data_batch(
    data: DataConfig,
    tokenizer: TextTokenizer,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    phase: str,
    step: int,
    rank: int = 0,
    world: int = 1,
    exclude: Iterable[str] | None = None,
) -> TrainBatch:
    """Rank ``rank``'s share of the global batch of step ``step``: ``batch_size`` rows of ``seq_len``.

    The global batch of a step is ``batch_size * world`` rows; each rank reads its own shard of
    every files source, and its own generator streams. The stream: docs/data.md ("The training stream").

    Args:
        data: the mixture.
        tokenizer: renders and tokenizes the rows (its chat template decides the layout).
        batch_size: rows on this rank.
        seq_len: tokens per row.
        seed: run seed (combined with ``data.seed``).
        phase: stage / phase label, so different phases read different streams.
        step: optimizer step; the only thing that moves the stream.
        rank, world: data-parallel rank and world size.
        exclude: user-turn strings never to train on (e.g. evaluation prompts).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    plan = _plan(data, tokenizer, seq_len)
    banned = frozenset(exclude) if exclude else None
    window = batch_size if not data.pack else max(batch_size, math.ceil(batch_size * seq_len / plan.mean_len))
    labels, positions = mixture_slots(plan.quota, _stream(data, seed, phase, world, "mix", rank), step * window, window)
    rows: list[Any] = [None] * window
    for i, (name, reader) in enumerate(zip(plan.names, plan.readers, strict=True)):
        slots = np.nonzero(labels == i)[0]
        if len(slots) == 0:
            continue
        stream = _stream(data, seed, phase, world, "source", name)
        for slot, row in zip(slots, reader.rows(positions[slots].tolist(), stream, rank, world, banned), strict=True):
            rows[slot] = row
    examples: list[Example] = render_rows(tokenizer, rows)
    for ex, label in zip(examples, labels, strict=True):
        ex.source = plan.names[label]
    return assemble_batch(examples, batch_size, seq_len, tokenizer.pad_id, pack=data.pack, overlong=data.overlong)


def make_batch(
    config: ProblemConfig,
    tokenizer: TextTokenizer,
    batch_size: int,
    seq_len: int,
    seed: int,
    index: int,
    pack: bool = False,
    exclude: Iterable[str] | None = None,
) -> TrainBatch:
    """Generator-only shortcut: batch ``index`` of the built-in task with knobs ``config``; the same as
    :func:`make_data_batch` with one generator source, phase ``"batch"`` and ``step=index``."""
    data = DataConfig(sources=[GeneratorSource.from_problems(config)], pack=pack)
    return make_data_batch(
        data,
        tokenizer,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        phase="batch",
        step=index,
        exclude=set(exclude) if exclude else None,
    )


def describe_data(data: DataConfig, tokenizer: TextTokenizer | None = None, n_rows: int = 4) -> list[dict[str, Any]]:
    """Check every source down to its rows: files resolved (s3:// downloaded), each file's layout
    detected, and with a ``tokenizer`` the first ``n_rows`` rows of every source rendered through the
    chat template. Returns one summary per source; raises the first problem found (naming the
    source, file, row and field)."""
    out = []
    for name, source, weight in zip(source_names(data.sources), data.sources, data.weights(), strict=True):
        info: dict[str, Any] = {"name": name, "type": source.type, "weight": weight}
        reader = _reader(source, name, data.cache_dir)
        if isinstance(reader, FilesReader):
            info["files"] = [
                {"path": str(p), "layout": layout, "rows": len(ds)}
                for p, layout, ds in zip(reader.files, reader.layouts, reader.datasets, strict=True)
            ]
            info["rows"] = reader.n_rows
        elif isinstance(reader, StreamingFilesReader):  # row counts would need a full read
            info["files"] = [
                {"path": str(p), "layout": lay} for p, lay in zip(reader.files, reader.layouts, strict=True)
            ]
        if tokenizer is not None and n_rows > 0:
            rows = reader.rows(range(n_rows), derive_seed("describe", data.seed, name), 0, 1, None)
            info["example_tokens"] = [len(e) for e in render_rows(tokenizer, rows)]
        out.append(info)
    return out
