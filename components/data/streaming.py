"""Files sources read as streams (``streaming: true``): for corpora too large to copy into Arrow files.

``datasets`` reads the files lazily; the stream stays a pure function of its position (shard by file
or by row, epochs of permuted files through a seeded shuffle buffer). A reader serves increasing
positions by reading forward and replays from the start for a smaller one.

Design notes (sharding, epochs, positions): docs/data.md ("Streaming files").
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from components.data.locate import builder_for, resolve_files
from components.data.reasoning import derive_seed
from components.data.render import Row
from components.data.sources import FilesSource, Layout, detect_format, record_to_row

__all__ = ["StreamingFilesReader"]


def _open(path: Path, source: FilesSource) -> Any:
    import datasets

    datasets.disable_progress_bars()
    builder = builder_for(path)
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    except Exception as err:  # datasets raises many types; the file and the cause are what matter
        raise ValueError(f"{path}: cannot read as {builder} ({type(err).__name__}: {err})") from err
    return ds


def _records(ds: Any, source: FilesSource) -> Iterator[dict[str, Any]]:
    for record in ds:
        yield {source.columns.get(k, k): v for k, v in record.items()}


class _Cursor:
    """Where one stream is: the row iterator of the current epoch and how far it has gone."""

    def __init__(self) -> None:
        self.epoch = 0
        self.position = 0  # stream position of the next row the iterator yields
        self.start = 0  # stream position of the current epoch's first row
        self.rows: Iterator[Row] | None = None


class StreamingFilesReader:
    """Rows of a streaming :class:`~components.data.sources.FilesSource`, by stream position."""

    def __init__(self, source: FilesSource, name: str, cache_dir: str | None = None) -> None:
        if source.split != "train":
            raise ValueError(
                f"source {name!r}: streaming reads whole files; split {source.split!r} needs streaming: false"
            )
        self.source, self.name = source, name
        self.files = resolve_files(source.paths, cache_dir, name)
        self.layouts: list[Layout] = []
        for path in self.files:
            first = next(iter(_records(_open(path, source), source)), None)
            if first is None:
                raise ValueError(f"{path}: the file holds no rows")
            self.layouts.append(detect_format(list(first), source.format, str(path)))
        self.epoch_rows: dict[tuple, int] = {}  # rows per epoch, per (rank, world, exclude), once counted
        self._cursors: OrderedDict[tuple, _Cursor] = OrderedDict()

    def _epoch_rows(self, seed: int, rank: int, world: int, exclude: frozenset[str] | None) -> Iterator[Row]:
        """One epoch of this rank's shard: permuted files, buffer-shuffled rows, excluded rows skipped."""
        rng = random.Random(seed)
        by_file = len(self.files) >= world
        indices = list(range(rank, len(self.files), world)) if by_file else list(range(len(self.files)))
        rng.shuffle(indices)
        buffer: list[Row] = []
        size = self.source.shuffle_buffer
        k = -1
        for f in indices:
            path, layout = self.files[f], self.layouts[f]
            for j, record in enumerate(_records(_open(path, self.source), self.source)):
                row = record_to_row(record, layout, f"{path} row {j + 1}")
                if exclude and set(row.user_texts()) & exclude:
                    continue
                k += 1
                if not by_file and k % world != rank:
                    continue
                if len(buffer) < size:
                    buffer.append(row)
                    continue
                slot = rng.randrange(size)
                yield buffer[slot]
                buffer[slot] = row
        rng.shuffle(buffer)
        yield from buffer

    def rows(
        self, positions: Sequence[int], stream: int, rank: int, world: int, exclude: frozenset[str] | None
    ) -> list[Row]:
        """Rows at ``positions`` (served in increasing order; see the module docstring). ``stream`` is the
        same on every rank (the shared sequence of the row-modulo shard depends on it)."""
        key = (stream, rank, world, exclude)
        size_key = (rank, world, exclude)
        cursor = self._cursors.get(key)
        out: dict[int, Row] = {}
        for p in sorted(set(positions)):
            if cursor is None or p < cursor.position:
                cursor = _Cursor()
            while True:
                if cursor.rows is None:
                    n = self.epoch_rows.get(size_key)
                    if n is not None and p >= cursor.position + n:  # skip whole epochs without reading them
                        skip = (p - cursor.position) // n
                        cursor.epoch, cursor.position = cursor.epoch + skip, cursor.position + skip * n
                    epoch_seed = derive_seed("stream-epoch", stream, cursor.epoch)
                    cursor.rows = self._epoch_rows(epoch_seed, rank, world, exclude)
                    cursor.start = cursor.position
                row = next(cursor.rows, None)
                if row is None:  # end of the epoch
                    n = cursor.position - cursor.start
                    if n == 0:
                        raise ValueError(
                            f"source {self.name!r}: rank {rank} of {world} gets no rows"
                            f"{' (exclude removes them all)' if exclude else ''}"
                        )
                    self.epoch_rows[size_key] = n
                    cursor.epoch, cursor.rows = cursor.epoch + 1, None
                    continue
                cursor.position += 1
                if cursor.position - 1 == p:
                    out[p] = row
                    break
        if cursor is not None:
            self._cursors[key] = cursor
            self._cursors.move_to_end(key)
            if len(self._cursors) > 8:
                self._cursors.popitem(last=False)
        return [out[p] for p in positions]
