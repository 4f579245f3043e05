"""The published ``nemotron_h`` on-disk layout: key names, per-expert tensors, shards and their index.

Every checkpoint the project writes goes through :class:`WeightsWriter` (directly, or through
:func:`model.checkpoint.write_checkpoint`), so every folder has the layout that transformers'
``NemotronHForCausalLM.save_pretrained`` and the model's publisher write for the same config:

* keys with the ``backbone.`` prefix (``backbone.embeddings.weight``, ``backbone.layers.N.mixer...``,
  ``backbone.norm_f.weight``) and ``lm_head.weight``;
* routed experts one tensor per expert, ``backbone.layers.N.mixer.experts.J.up_proj.weight`` (F, H) and
  ``...down_proj.weight`` (H, F), split from the model's stacked (E, F, H) / (E, H, F) tensors;
* one ``model.safetensors`` up to ``max_shard_size`` bytes, above it ``model-0000i-of-0000n.safetensors``
  plus ``model.safetensors.index.json`` (``{"metadata": {"total_parameters", "total_size"}, "weight_map"}``),
  with transformers' (huggingface_hub's) shard semantics: tensors in transformers' save order, a shard
  closed when the next tensor would take it past the limit, a tensor larger than the limit alone in its
  shard, a stacked expert tensor kept whole in one shard (transformers splits it from one storage).

Writers hand tensors under the model's own names (``model.`` prefix, stacked or per-expert experts) in
any order, one at a time: the shard plan and every file header are fixed up front from ``(name, shape,
dtype)`` entries, and each tensor's bytes go straight to their offset, so a writer holds one tensor.
Reading accepts this layout and the others (:mod:`model.checkpoint`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch
from torch import Tensor

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)
"""Files that make up a checkpoint's tokenizer (and its generation config) beside the weights, as transformers
writes them; every stage and every extracted budget carries the present ones forward."""
DEFAULT_MAX_SHARD_SIZE = "50GB"
"""transformers 5's ``save_pretrained`` default (ModelOpt's export passes ``10GB``)."""

SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # decimal, as huggingface_hub parses them
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_STACKED = re.compile(r"^(.*\.mixer\.experts)\.(up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_BUFFERS = ("e_score_correction_bias",)  # buffers in transformers' model: not counted in total_parameters

Prefix = Literal["backbone", "model"]
ExpertLayout = Literal["per_expert", "stacked"]
Entry = tuple[str, tuple[int, ...], torch.dtype]
"""``(name, shape, dtype)`` of one tensor under the model's name."""


def tokenizer_files(folder: str | Path) -> dict[str, Path]:
    """``{name: path}`` of the :data:`TOKENIZER_FILES` present in ``folder``, in that order: what a stage or an
    extracted budget copies next to its weights (the ``extra_files`` of the checkpoint writers)."""
    root = Path(folder)
    return {name: root / name for name in TOKENIZER_FILES if (root / name).is_file()}


def parse_shard_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or ``"<number><KB|MB|GB|TB>"`` (decimal units, as transformers reads them)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size: expected a positive number of bytes, got {size}")
        return size
    text = str(size).strip()
    unit = text[-2:].upper()
    try:
        value = float(text[:-2].strip())
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or value <= 0:
        raise ValueError(f"max_shard_size: {size!r} is not a size like '5GB', '500MB' or a number of bytes")
    return int(value * SIZE_UNITS[unit])


def natural_key(name: str) -> tuple:
    """Sort key of transformers' save order: dotted parts, numbers numerically and before words."""
    parts: list[tuple] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            stem = part.rstrip("0123456789")
            parts.append((1, stem, int(part[len(stem) :])) if stem != part else (1, part))
    return tuple(parts)


def published_keys(
    name: str, shape: tuple[int, ...], prefix: Prefix = "backbone", experts: ExpertLayout = "per_expert"
) -> list[tuple[str, tuple[int, ...], int | None]]:
    """The file keys one tensor of the model is written as: ``[(key, shape, expert index or None)]``.

    ``model.X`` becomes ``backbone.X`` (``lm_head`` and other top-level names stay); a stacked expert
    tensor ``...mixer.experts.up_proj`` (E, out, in) becomes E keys ``...mixer.experts.J.up_proj.weight``
    (out, in) unless ``experts="stacked"``.
    """
    key = prefix + name[len("model") :] if name.startswith("model.") else name
    m = _STACKED.match(key)
    if m is None or experts == "stacked" or len(shape) != 3:
        return [(key, tuple(shape), None)]
    return [(f"{m.group(1)}.{j}.{m.group(2)}.weight", tuple(shape[1:]), j) for j in range(shape[0])]


def _unit(name: str) -> str:
    """The storage unit a tensor is sharded with: per-expert dense weights with their stacked tensor."""
    m = _PER_EXPERT.match(name)
    return f"{m.group(1)}.{m.group(3)}" if m else name


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return _numel(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass
class _Slot:
    file: int
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # offset of its bytes from the start of the data section
    written: bool = False


class WeightsWriter:
    """Write tensors under the published keys into one file or shards, in any order, one at a time.

    Args:
        folder: where the files go (an existing folder, usually a :func:`~model.atomic.publish_folder` staging).
        entries: ``(name, shape, dtype)`` of every tensor that will be written, under the model's names.
        max_shard_size: bytes or a size string (:func:`parse_shard_size`).
        metadata: added to every file's header beside ``format: pt``.
        prefix / experts: the key prefix and expert layout (the published ones by default; the others only
            to write the older layouts the reader accepts).

    :meth:`write` takes ``(name, tensor)``; :meth:`close` checks every entry was written exactly once and
    writes the index when sharded. Use as a context manager (files closed on error; the staging folder is
    discarded by its owner).
    """

    def __init__(
        self,
        folder: str | Path,
        entries: Iterable[Entry],
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        metadata: Mapping[str, str] | None = None,
        prefix: Prefix = "backbone",
        experts: ExpertLayout = "per_expert",
    ) -> None:
        self.folder = Path(folder)
        limit = parse_shard_size(max_shard_size)
        entries = list(entries)
        seen: set[str] = set()
        units: dict[str, list[Entry]] = {}
        for name, shape, dtype in entries:
            if name in seen:
                raise ValueError(f"WeightsWriter: tensor {name} is listed twice")
            seen.add(name)
            units.setdefault(_unit(name), []).append((name, tuple(shape), dtype))
        # Shards over units in transformers' order (huggingface_hub's split: greedy, oversize alone).
        shards: list[list[str]] = []
        current: list[str] = []
        size = 0
        self.total_size = 0
        for unit in sorted(units, key=natural_key):
            n = sum(_nbytes(s, d) for _, s, d in units[unit])
            self.total_size += n
            if n > limit:
                shards.append([unit])
                continue
            if current and size + n > limit:
                shards.append(current)
                current, size = [], 0
            current.append(unit)
            size += n
        if current or not shards:
            shards.append(current)
        count = len(shards)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.files = [WEIGHTS_NAME] if count == 1 else names
        self.slots: dict[str, list[_Slot]] = {}
        self.total_parameters = 0
        headers: list[dict[str, Any]] = []
        for i, shard in enumerate(shards):
            header: dict[str, Any] = {"__metadata__": {"format": "pt", **dict(metadata or {})}}
            offset = 0
            for unit in shard:
                members = sorted(units[unit], key=lambda e: natural_key(e[0]))
                for name, shape, dtype in members:
                    for key, kshape, _ in published_keys(name, shape, prefix, experts):
                        if key in header:
                            raise ValueError(f"WeightsWriter: two tensors are written as {key}")
                        nbytes = _nbytes(kshape, dtype)
                        span = [offset, offset + nbytes]
                        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(kshape), "data_offsets": span}
                        self.slots.setdefault(name, []).append(_Slot(i, key, kshape, dtype, offset))
                        offset += nbytes
                    if not name.endswith(_BUFFERS):
                        self.total_parameters += _numel(shape)
            headers.append(header)
        self._handles: list[BinaryIO] = []
        self._data_start: list[int] = []
        try:
            for name, header in zip(self.files, headers, strict=True):
                raw = json.dumps(header, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                fh = open(self.folder / name, "wb")  # noqa: SIM115 - closed in close()
                self._handles.append(fh)
                fh.write(len(raw).to_bytes(8, "little"))
                fh.write(raw)
                self._data_start.append(8 + len(raw))
        except BaseException:
            self._close_handles()
            raise

    @property
    def weight_map(self) -> dict[str, str]:
        """File key -> file name, as the index records it."""
        return {s.key: self.files[s.file] for slots in self.slots.values() for s in slots}

    def write(self, name: str, tensor: Tensor) -> None:
        """Write the tensor ``name`` (the model's name; a stacked expert tensor is split per expert)."""
        slots = self.slots.get(name)
        if slots is None:
            raise ValueError(f"WeightsWriter: {name} is not among the entries given up front")
        parts = [tensor] if len(slots) == 1 and slots[0].shape == tuple(tensor.shape) else list(tensor.unbind(0))
        if len(parts) != len(slots):
            raise ValueError(f"WeightsWriter: {name} {tuple(tensor.shape)} does not match its entry")
        for slot, part in zip(slots, parts, strict=True):
            if slot.written:
                raise ValueError(f"WeightsWriter: {slot.key} is written twice")
            if tuple(part.shape) != slot.shape or part.dtype != slot.dtype:
                raise ValueError(
                    f"WeightsWriter: expected {slot.key} {slot.shape} {slot.dtype}, "
                    f"got {tuple(part.shape)} {part.dtype}"
                )
            fh = self._handles[slot.file]
            fh.seek(self._data_start[slot.file] + slot.start)
            flat = part.detach().to("cpu").contiguous().reshape(-1)
            fh.write(memoryview(flat.view(torch.uint8).numpy()))
            slot.written = True

    def _close_handles(self) -> None:
        for fh in self._handles:
            fh.close()

    def close(self) -> list[Path]:
        """Check completeness, close the files and (sharded) write the index; returns the weight files."""
        self._close_handles()
        missing = sorted(s.key for slots in self.slots.values() for s in slots if not s.written)
        if missing:
            raise ValueError(f"WeightsWriter: tensors never written: {missing[:20]}")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
                "weight_map": self.weight_map,
            }
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return [self.folder / f for f in self.files]

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._close_handles()


def write_weights(
    folder: str | Path,
    entries: Iterable[Entry],
    tensors: Iterable[tuple[str, Tensor]],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    prefix: Prefix = "backbone",
    experts: ExpertLayout = "per_expert",
) -> list[Path]:
    """:class:`WeightsWriter` fed from a stream of ``(name, tensor)`` (one tensor in memory at a time)."""
    with WeightsWriter(folder, entries, max_shard_size, metadata, prefix, experts) as writer:
        for name, tensor in tensors:
            writer.write(name, tensor)
        return writer.close()


def state_entries(state: Mapping[str, Tensor]) -> list[Entry]:
    """``(name, shape, dtype)`` of every tensor of a state dict."""
    return [(k, tuple(v.shape), v.dtype) for k, v in state.items()]


def iter_state(state: Mapping[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of a state dict (for :func:`write_weights`)."""
    yield from state.items()
