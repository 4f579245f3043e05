"""The ``data`` section: a weighted mixture of sources, and the readers that turn a source into rows.

Sources: ``files`` (JSONL or Parquet, local or ``s3://``, read with ``datasets``; chat,
prompt/response or text rows), ``generator`` (the built-in reasoning task) and ``reasoning_gym``.
A reader maps a position of its per-rank stream to a row; files are read in epochs, each a fresh
permutation of this rank's shard, so no two ranks share a row.

Design notes: docs/data.md ("Sources").
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from components.data.locate import builder_for, resolve_files
from components.data.reasoning import ANSWER_PREFIX, Problem, ProblemConfig, derive_seed, generate_problems
from components.data.render import Row
from components.settings import cache_dir as settings_cache_dir

__all__ = [
    "BoundedCache",
    "ChunkedReader",
    "DataConfig",
    "FilesReader",
    "FilesSource",
    "GeneratorReader",
    "GeneratorSource",
    "ReasoningGymSource",
    "SourceConfig",
    "detect_format",
    "gym_available",
    "problem_messages",
    "require_gym",
    "source_names",
]

Layout = Literal["chat", "prompt_response", "text"]
V = TypeVar("V")
Item = TypeVar("Item")
#: Mixture proportions are exact over blocks of this many examples, so a weight below 1/MIX_BLOCK is refused.
MIX_BLOCK = 1000


class FilesSource(BaseModel):
    """JSONL or Parquet files in one of the common row layouts."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["files"] = Field("files", description="Source kind.")
    name: str | None = Field(None, description="Label in logs and batch counts; default 'files:<first path>'.")
    weight: float = Field(1.0, gt=0, description="Share of the mixture (weights are normalised over sources).")
    paths: list[str] = Field(
        min_length=1,
        description="Local files, folders (every .jsonl/.json/.parquet below), globs, or s3:// URIs (globs allowed).",
    )
    format: Literal["auto", "chat", "prompt_response", "text"] = Field(
        "auto", description="Row layout; auto tells it from each file's columns (messages / prompt+response / text)."
    )
    split: str = Field(
        "train", description="datasets split expression applied to each file, e.g. 'train[:98%]' to hold out a tail."
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description="Column renames applied first, e.g. {conversations: messages}."
    )
    streaming: bool = Field(
        False,
        description="Read the files lazily (no Arrow copy; sequential access, resuming replays the shard once); "
        "for corpora too large to convert.",
    )
    shuffle_buffer: int = Field(10_000, ge=1, description="Rows in the shuffle buffer of a streaming source.")

    @field_validator("paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        """Local paths made absolute where the config is read: Ray workers run in other folders."""
        return [p if p.startswith("s3://") or os.path.isabs(p) else os.path.abspath(p) for p in paths]


class GeneratorSource(ProblemConfig):
    """The built-in chained modular arithmetic task with ``<think>`` traces (the demo data)."""

    type: Literal["generator"] = Field("generator", description="Source kind.")
    name: str | None = Field(None, description="Label in logs and batch counts; default 'generator'.")
    weight: float = Field(1.0, gt=0, description="Share of the mixture (weights are normalised over sources).")

    @classmethod
    def from_problems(cls, config: ProblemConfig, **fields: Any) -> GeneratorSource:
        """A generator source with the knobs of ``config``."""
        return cls(**config.model_dump(), **fields)

    def problem_config(self) -> ProblemConfig:
        return ProblemConfig(**self.model_dump(exclude={"type", "name", "weight"}))


_MISSING = (
    "the reasoning_gym source needs the optional package 'reasoning-gym' (pip install reasoning-gym); "
    "the files and generator sources need nothing extra"
)


def gym_available() -> bool:
    """Whether the optional ``reasoning_gym`` package (the ``reasoning_gym`` source) can be imported."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        return False
    return True


def require_gym() -> Any:
    """The ``reasoning_gym`` module.

    Raises:
        ImportError: naming the package to install.
    """
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(_MISSING) from e
    return reasoning_gym


class ReasoningGymSource(BaseModel):
    """A procedural task of the optional ``reasoning-gym`` package (prompts and answers, no traces)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["reasoning_gym"] = Field("reasoning_gym", description="Source kind.")
    name: str | None = Field(None, description="Label in logs and batch counts; default 'reasoning_gym:<task>'.")
    weight: float = Field(1.0, gt=0, description="Share of the mixture (weights are normalised over sources).")
    task: str = Field(min_length=1, description="reasoning_gym dataset name, e.g. 'leg_counting'.")
    task_config: dict[str, int | float | str | bool | list[int | float | str]] = Field(
        default_factory=dict, description="Keyword arguments of reasoning_gym.create_dataset for the task."
    )

    @model_validator(mode="after")
    def _installed(self) -> ReasoningGymSource:
        try:
            require_gym()
        except ImportError as err:  # a config error, reported with the field path by pydantic
            raise ValueError(str(err)) from None
        return self


SourceConfig = Annotated[FilesSource | GeneratorSource | ReasoningGymSource, Field(discriminator="type")]


def _default_name(source: FilesSource | GeneratorSource | ReasoningGymSource) -> str:
    if source.name:
        return source.name
    if isinstance(source, FilesSource):
        return f"files:{source.paths[0]}"
    if isinstance(source, ReasoningGymSource):
        return f"reasoning_gym:{source.task}"
    return "generator"


def source_names(sources: Sequence[FilesSource | GeneratorSource | ReasoningGymSource]) -> list[str]:
    """Each source's label (its ``name``, else derived); repeated labels get ``#2``, ``#3`` suffixes."""
    names, seen = [], {}
    for s in sources:
        base = _default_name(s)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


class DataConfig(BaseModel):
    """The ``data`` section of every stage that needs tokens: a weighted mixture of sources.

    Example, the paper's mix of reasoning traces and pre-training text::

        data:
          sources:
            - {type: files, paths: ["s3://corp-data/traces/*.parquet"], weight: 0.7}
            - {type: files, paths: ["s3://corp-data/web/*.jsonl"], format: text, weight: 0.3}
          mix_by: tokens
    """

    model_config = ConfigDict(extra="forbid")

    sources: list[SourceConfig] = Field(
        default_factory=lambda: [GeneratorSource()],
        min_length=1,
        description="Weighted mixture of sources (weights normalised); default: the built-in generator.",
    )
    pack: bool = Field(False, description="Pack several examples per row (else one example per row).")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="Rows longer than seq_len: cut to seq_len or left out; counted and warned either way."
    )
    seed: int = Field(0, description="Seed of the data order (combined with the run seed and the phase).")
    mix_by: Literal["examples", "tokens"] = Field(
        "examples",
        description="What the weights apportion: examples (exact per block of 1000) or tokens (example shares "
        "scaled by each source's mean length, measured on its first examples).",
    )
    cache_dir: str | None = Field(
        None, description="Where s3:// files are downloaded; default $STAR_ELASTIC_CACHE or ~/.cache/star-elastic."
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        total = sum(s.weight for s in self.sources)
        for name, s in zip(source_names(self.sources), self.sources, strict=True):
            if s.weight / total < 1 / MIX_BLOCK:
                raise ValueError(
                    f"source {name!r}: weight {s.weight} is {s.weight / total:.2e} of the mixture, below the "
                    f"resolution 1/{MIX_BLOCK}; raise it or remove the source"
                )
        return self

    def weights(self) -> list[float]:
        """Normalised weights, in source order."""
        total = sum(s.weight for s in self.sources)
        return [s.weight / total for s in self.sources]


# ---------------------------------------------------------------------------------------------------
# Files: resolving paths, detecting the layout, reading rows


def detect_format(columns: Sequence[str], fmt: str, where: str) -> Layout:
    """The row layout of a file with ``columns`` (``fmt`` is the configured format, maybe ``auto``).

    Raises:
        ValueError: naming ``where`` (the file), the missing field and the columns it has.
    """
    cols = set(columns)
    needs: dict[str, tuple[str, ...]] = {
        "chat": ("messages",),
        "prompt_response": ("prompt", "response"),
        "text": ("text",),
    }
    if fmt != "auto":
        missing = [c for c in needs[fmt] if c not in cols]
        if missing:
            raise ValueError(
                f"{where}: format {fmt!r} needs the field {missing[0]!r}; the file has {sorted(cols)} "
                f"(map another column to it with columns: {{your_column: {missing[0]}}})"
            )
        return fmt  # type: ignore[return-value]
    if "messages" in cols:
        return "chat"
    if "prompt" in cols or "response" in cols:
        missing = [c for c in ("prompt", "response") if c not in cols]
        if missing:
            raise ValueError(
                f"{where}: prompt/response rows need the field {missing[0]!r}; the file has {sorted(cols)}"
            )
        return "prompt_response"
    if "text" in cols:
        return "text"
    raise ValueError(
        f"{where}: cannot tell the row layout from the fields {sorted(cols)}: expected 'messages' (chat), "
        "'prompt' and 'response' (prompt_response) or 'text' (text); set format: and map other names with columns:"
    )


def _string(record: dict[str, Any], key: str, where: str, required: bool = True) -> str | None:
    value = record.get(key)
    if value is None:
        if required:
            raise ValueError(f"{where}: missing field {key!r}")
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def record_to_row(record: dict[str, Any], layout: Layout, where: str) -> Row:
    """A file record of ``layout`` as a :class:`Row` (prompt/response becomes a two-turn chat)."""
    if layout == "text":
        return Row(where, text=_string(record, "text", where))
    if layout == "chat":
        messages = record.get("messages")
        if messages is None:
            raise ValueError(f"{where}: missing field 'messages'")
        return Row(where, messages=messages)
    prompt, response = _string(record, "prompt", where), _string(record, "response", where)
    reasoning = _string(record, "reasoning", where, required=False)
    if reasoning is None:
        reasoning = _string(record, "reasoning_content", where, required=False)
    system = _string(record, "system", where, required=False)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    assistant: dict[str, Any] = {"role": "assistant", "content": response}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    messages.append(assistant)
    return Row(where, messages=messages)


def _load_file(path: Path, source: FilesSource, cache_dir: str | None) -> Any:
    """One file as a ``datasets.Dataset`` (columns renamed)."""
    import datasets

    datasets.disable_progress_bars()
    builder = builder_for(path)
    # The Arrow copies datasets makes of the files live next to the s3 downloads, not in ~/.cache/huggingface.
    arrow_cache = str(settings_cache_dir(cache_dir) / "datasets")
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split=source.split, cache_dir=arrow_cache)
    except Exception as err:  # datasets raises many types; the file and the cause are what matter
        raise ValueError(f"{path}: cannot read as {builder} ({type(err).__name__}: {err})") from err
    renames = {k: v for k, v in source.columns.items() if k in ds.column_names}
    return ds.rename_columns(renames) if renames else ds


class BoundedCache(Generic[V]):
    """At most ``size`` values by key, the least recently used dropped first: what a reader recomputes
    cheaply but not per row (shards, permutations, generated chunks)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value of ``key``, from ``make()`` when it is not held."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._items[key] = make()
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value


class FilesReader:
    """Rows of a :class:`FilesSource`, by position in a per-rank stream of epochs."""

    def __init__(self, source: FilesSource, name: str, cache_dir: str | None = None) -> None:
        self.source, self.name = source, name
        self.files = resolve_files(source.paths, cache_dir, name)
        self.datasets = [_load_file(p, source, cache_dir) for p in self.files]
        self.layouts = [
            detect_format(ds.column_names, source.format, str(p))
            for p, ds in zip(self.files, self.datasets, strict=True)
        ]
        self.offsets = np.cumsum([0] + [len(ds) for ds in self.datasets])
        if self.offsets[-1] == 0:
            raise ValueError(f"source {name!r}: the files {[str(p) for p in self.files]} hold no rows")
        self._usable: BoundedCache[np.ndarray] = BoundedCache(8)
        self._perms: BoundedCache[np.ndarray] = BoundedCache(16)

    @property
    def n_rows(self) -> int:
        return int(self.offsets[-1])

    def fetch(self, indices: Sequence[int]) -> list[Row]:
        """Rows at global ``indices`` (over the concatenated files), in that order."""
        rows: list[Row | None] = [None] * len(indices)
        file_of = np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1
        for f in np.unique(file_of):
            slots = np.nonzero(file_of == f)[0]
            local = [int(indices[s] - self.offsets[f]) for s in slots]
            columns = self.datasets[f][local]
            for j, s in enumerate(slots):
                record = {k: v[j] for k, v in columns.items()}
                rows[s] = record_to_row(record, self.layouts[f], f"{self.files[f]} row {local[j] + 1}")
        return rows  # type: ignore[return-value]

    def usable(self, rank: int, world: int, exclude: frozenset[str] | None) -> np.ndarray:
        """Global indices of this rank's shard (``index % world == rank``) whose user turns are not in ``exclude``."""
        return self._usable.get((rank, world, exclude), partial(self._shard, rank, world, exclude))

    def _shard(self, rank: int, world: int, exclude: frozenset[str] | None) -> np.ndarray:
        shard = np.arange(rank, self.n_rows, world, dtype=np.int64)
        if exclude:
            shard = shard[~self._excluded(exclude)[shard]]
        if len(shard) == 0:
            raise ValueError(
                f"source {self.name!r}: rank {rank} of {world} gets no rows ({self.n_rows} rows in all"
                f"{', exclude removes the rest' if exclude else ''})"
            )
        return shard

    def _excluded(self, exclude: frozenset[str]) -> np.ndarray:
        """``bool (n_rows,)``: rows with a user turn in ``exclude`` (reads only the prompt / messages column)."""
        flags = []
        for ds, layout in zip(self.datasets, self.layouts, strict=True):
            if layout == "text":  # no user turn to match
                flags.append(np.zeros(len(ds), dtype=bool))
            elif layout == "prompt_response":
                flags.append(np.fromiter((p in exclude for p in ds["prompt"]), dtype=bool, count=len(ds)))
            else:
                users = (
                    any(
                        isinstance(m, dict) and m.get("role") == "user" and m.get("content") in exclude
                        for m in msgs or ()
                    )
                    for msgs in ds["messages"]
                )
                flags.append(np.fromiter(users, dtype=bool, count=len(ds)))
        return np.concatenate(flags)

    def _permutation(self, stream: int, epoch: int, n: int) -> np.ndarray:
        make = lambda: np.random.default_rng(derive_seed("epoch", stream, epoch)).permutation(n)
        return self._perms.get((stream, epoch, n), make)

    def rows(
        self, positions: Sequence[int], stream: int, rank: int, world: int, exclude: frozenset[str] | None
    ) -> list[Row]:
        """Rows at ``positions`` of the stream: position ``p`` is row ``p % n`` of epoch ``p // n``'s
        permutation of this rank's shard (``n`` rows)."""
        shard = self.usable(rank, world, exclude)
        n = len(shard)
        picks = [int(shard[self._permutation(stream, p // n, n)[p % n]]) for p in positions]
        return self.fetch(picks)


# ---------------------------------------------------------------------------------------------------
# The built-in generator


def problem_messages(problem: Problem) -> list[dict[str, Any]]:
    """A generated problem as chat: user = its prompt, assistant = trace (``reasoning_content``) and
    ``"A:" + answer``; through the demo chat template this is exactly the demo training text."""
    return [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "reasoning_content": problem.reasoning, "content": f"{ANSWER_PREFIX}{problem.answer}"},
    ]


class ChunkedReader(ABC, Generic[Item]):
    """Rows of a procedural source: position ``p`` of a rank's stream is item ``p % CHUNK`` of chunk
    ``p // CHUNK``, each chunk made from its own seed (random access without replaying the stream; each
    rank draws its own items). The last ``CACHED`` chunks are kept."""

    CHUNK: ClassVar[int]
    CACHED: ClassVar[int]

    def __init__(self, name: str) -> None:
        self.name = name
        self._chunks: BoundedCache[list[Item]] = BoundedCache(self.CACHED)

    @abstractmethod
    def make_chunk(self, stream: int, rank: int, c: int, exclude: frozenset[str] | None) -> list[Item]:
        """Chunk ``c`` of rank ``rank``'s stream ``stream``: ``CHUNK`` items, deterministic by those numbers."""

    @abstractmethod
    def messages(self, chunk: list[Item], k: int, exclude: frozenset[str] | None) -> list[dict[str, Any]]:
        """The chat row of item ``k`` of ``chunk``."""

    def rows(
        self, positions: Sequence[int], stream: int, rank: int, world: int, exclude: frozenset[str] | None
    ) -> list[Row]:
        """Rows at ``positions`` of rank ``rank``'s stream (``world`` is not needed: ranks draw apart)."""
        out = []
        for p in positions:
            c, k = divmod(p, self.CHUNK)
            chunk = self._chunks.get((stream, rank, c, exclude), partial(self.make_chunk, stream, rank, c, exclude))
            out.append(Row(f"{self.name}:{p}", messages=self.messages(chunk, k, exclude)))
        return out


class GeneratorReader(ChunkedReader[Problem]):
    """Rows of a :class:`GeneratorSource`; each chunk is generated with ``exclude`` left out."""

    CHUNK, CACHED = 256, 64

    def __init__(self, source: GeneratorSource, name: str) -> None:
        super().__init__(name)
        self.source = source

    @cached_property
    def config(self) -> ProblemConfig:
        return self.source.problem_config()

    def make_chunk(self, stream: int, rank: int, c: int, exclude: frozenset[str] | None) -> list[Problem]:
        return generate_problems(self.CHUNK, self.config, derive_seed("chunk", stream, rank, c), exclude=exclude)

    def messages(self, chunk: list[Problem], k: int, exclude: frozenset[str] | None) -> list[dict[str, Any]]:
        return problem_messages(chunk[k])
