"""Checkpoint I/O in the Hugging Face ``nemotron_h`` layout: safetensors + config.json.

Loading reads what transformers and the model's publisher write (``backbone.`` or ``model.`` keys,
per-expert or stacked experts, sharded or not, tied embeddings, ``mtp.*`` skipped), checks every
tensor against the config (all problems by name, never half-loaded), reads only safetensors and
copies each tensor once. Saving (:func:`write_checkpoint`) publishes the folder atomically with a
``manifest.json`` of SHA-256 sums, verified on load when present.

The accepted layouts in full: docs/checkpoints.md ("Checkpoint I/O").
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from model.atomic import publish_folder
from model.config import HybridConfig, read_hf_json
from model.layout import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    WEIGHTS_NAME,
    ExpertLayout,
    Prefix,
    WeightsWriter,
    state_entries,
)
from model.manifest import (  # noqa: F401 - the checkpoint API: defined in model.manifest, used from here too
    MANIFEST_NAME,
    CheckpointError,
    sha256_file,
    verify_manifest,
    write_manifest,
)

CONFIG_NAME = "config.json"

_PER_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_MTP_PREFIX = "mtp."  # multi-token-prediction heads: transformers' NemotronH ignores them on load too
_FP32_TENSORS = ("e_score_correction_bias",)  # kept float32 whatever the file or requested dtype


# ---------------------------------------------------------------------- key mapping
def to_canonical(tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """Rename ``backbone.`` to ``model.`` and stack per-expert tensors (out, in) into (E, out, in).

    ``tensors`` is a mapping or an iterable of ``(file key, tensor)`` pairs (e.g. :func:`iter_tensors`);
    per-expert tensors are released group by group as they are stacked, so the peak is the
    weights plus one stacked projection of one layer.
    """
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    for key, value in pairs:
        name, index = canonical_name(key) or (key, None)  # mtp.* keys pass through: callers drop them
        if index is not None:
            experts.setdefault(name, {})[index] = value
        else:
            out[name] = value
    while experts:
        name, per = experts.popitem()
        ids = sorted(per)
        if ids != list(range(len(ids))):
            prefix, proj = name.rsplit(".", 1)
            raise CheckpointError(f"{prefix}.*.{proj}.weight: expert indices {ids} are not 0..{len(ids) - 1}")
        out[name] = torch.stack([per.pop(i) for i in ids])
    return out


def canonical_name(file_key: str) -> tuple[str, int | None] | None:
    """The model's name for a stored key, one key at a time (the renaming :func:`to_canonical` applies).

    Returns ``(name, None)`` for a whole tensor (``backbone.`` read as ``model.``), ``(stacked name, expert
    index)`` for a per-expert tensor (``...mixer.experts.{j}.up_proj.weight`` -> ``...mixer.experts.up_proj``,
    ``j``), and None for a multi-token-prediction tensor (``mtp.*``), which the model does not have.
    """
    if file_key.startswith(_MTP_PREFIX):
        return None
    key = "model." + file_key[len("backbone.") :] if file_key.startswith("backbone.") else file_key
    m = _PER_EXPERT.match(key)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    return key, None


class ExpertStacker:
    """Per-expert tensors copied straight into their stacked (E, out, in) tensor as they are read.

    ``shapes`` gives the full stacked shape of every name; each stacked tensor is allocated at its first
    expert (in :func:`loaded_dtype` of ``dtype``) and handed back by :meth:`add` once its last expert is in,
    so only the stacks of partly read layers are held here. Tensors that do not fit and experts never read
    are collected in :meth:`problems`.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype | None = None) -> None:
        self.shapes = shapes
        self.dtype = dtype
        self.pending: dict[str, tuple[Tensor, set[int]]] = {}
        self.misfits: list[str] = []

    def add(self, name: str, index: int, view: Tensor) -> Tensor | None:
        """Copy expert ``index`` of ``name`` (``view``: (out, in)) into its stack; returns the stacked
        (E, out, in) tensor when this was its last missing expert, else None."""
        shape = self.shapes.get(name)
        if shape is None or len(shape) != 3 or index >= shape[0] or tuple(view.shape) != tuple(shape[1:]):
            prefix, proj = name.rsplit(".", 1)
            self.misfits.append(f"{prefix}.{index}.{proj}.weight {tuple(view.shape)} does not fit {name} {shape}")
            return None
        if name not in self.pending:
            self.pending[name] = (torch.empty(shape, dtype=loaded_dtype(name, view, self.dtype)), set())
        stacked, got = self.pending[name]
        stacked[index].copy_(view)
        got.add(index)
        if len(got) < shape[0]:
            return None
        del self.pending[name]
        return stacked

    def problems(self) -> list[str]:
        """Misfit tensors, then every stack with experts never read."""
        absent = [
            f"{name}: no tensor for experts {sorted(set(range(t.shape[0])) - got)}"
            for name, (t, got) in self.pending.items()
        ]
        return self.misfits + absent


# ---------------------------------------------------------------------- reading files
def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in read order.

    ``model.safetensors.index.json`` (sharded, as ``save_pretrained(max_shard_size=...)`` writes) names
    the shards; otherwise ``model.safetensors``; otherwise every ``*.safetensors`` file. Raises
    :class:`CheckpointError` for a folder without weights or an index naming a missing shard.
    """
    folder = Path(folder)
    if (folder / INDEX_NAME).exists():
        try:
            weight_map = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{folder / INDEX_NAME}: unreadable shard index ({err}); expected a 'weight_map'"
            ) from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shards {missing} named in {INDEX_NAME} are missing")
        return files
    if (folder / WEIGHTS_NAME).exists():
        return [folder / WEIGHTS_NAME]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{folder}: no *.safetensors file (only safetensors checkpoints are read)")
    return found


REOPEN_BYTES = 64 << 20
"""Bytes read through one opening of a weight file before it is closed and reopened.

safetensors reads through a memory mapping, and every page read stays resident until the mapping
is closed: one opening per file would keep a whole single-file checkpoint in memory beside the
copies made from it (twice the weights at the end of a load)."""


def iter_views(folder: str | Path) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(file key, view)`` for every tensor of a single-file or sharded checkpoint, in file order.

    A view reads straight from the file mapping: copy (or convert) it before asking for the next
    one. Each file is closed and reopened every :data:`REOPEN_BYTES`, so at most that much of it
    stays mapped. A key found in two files raises :class:`CheckpointError`.
    """
    seen: dict[str, str] = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as fh:
            keys = list(fh.keys())  # a safe_open handle is not iterable
        i = 0
        while i < len(keys):
            with safe_open(str(path), framework="pt") as fh:
                read = 0
                while i < len(keys) and read < REOPEN_BYTES:
                    key = keys[i]
                    i += 1
                    if key in seen:
                        raise CheckpointError(f"{folder}: tensor {key} is stored twice ({seen[key]} and {path.name})")
                    seen[key] = path.name
                    view = fh.get_tensor(key)
                    read += view.numel() * view.element_size()
                    yield key, view
                    del view


def iter_tensors(folder: str | Path, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(file key, tensor)`` for every tensor of a single-file or sharded checkpoint, one at a time.

    Keys are as stored (``backbone.`` or ``model.`` prefix, experts as stored). Each tensor is the
    caller's own copy, in its stored dtype or, for floating tensors, in ``dtype`` (converted straight
    out of the file: one copy). Copies, not views: a tensor left in the file mapping keeps the whole
    mapping alive, and every page a relayout or a forward pass has read then stays resident beside
    the copies. A consumer that places each
    tensor and drops it holds about one tensor, plus at most :data:`REOPEN_BYTES` of mapped file.
    """
    for key, view in iter_views(folder):
        floating = dtype is not None and view.is_floating_point()
        yield key, (view.to(dtype, copy=True) if floating else view.clone())


def read_tensors(folder: str | Path) -> dict[str, Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, keys as stored."""
    return dict(iter_tensors(folder))


def check_state(expected: dict[str, Tensor], got: dict[str, Tensor], where: str) -> None:
    """Raise one :class:`CheckpointError` listing every missing, unexpected and mis-shaped tensor."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = [
        f"{k}: file {tuple(got[k].shape)} vs config {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(got))
        if tuple(got[k].shape) != tuple(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:20]}{' ...' if len(missing) > 20 else ''}")
    if extra:
        problems.append(f"unexpected tensors {extra[:20]}{' ...' if len(extra) > 20 else ''}")
    if wrong:
        problems.append("mis-shaped tensors " + "; ".join(wrong[:20]))
    if problems:
        raise CheckpointError(f"{where}: " + " | ".join(problems))


# ---------------------------------------------------------------------- public API
def read_config(path: str | Path) -> tuple[HybridConfig, dict[str, Any]]:
    """``(config, raw config.json dict)`` of a checkpoint folder; the raw dict has tagged floats decoded.

    Raises :class:`CheckpointError` when ``config.json`` is missing and ``ValueError`` naming the field
    when it is not a valid ``nemotron_h`` config.
    """
    folder = Path(path)
    if not (folder / CONFIG_NAME).exists():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME}")
    raw = read_hf_json(folder / CONFIG_NAME)
    try:
        return HybridConfig.from_hf_dict(raw), raw
    except ValueError as err:
        raise ValueError(f"{folder / CONFIG_NAME}: {err}") from None


_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip


def header_tensors(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint as a ``meta`` tensor of its stored shape and dtype, keys as stored (the
    file headers only: no weight is read). Raises :class:`CheckpointError` for a truncated or corrupt file,
    an unsupported dtype or a key stored twice."""
    folder = Path(folder)
    out: dict[str, Tensor] = {}
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                    sl = fh.get_slice(key)
                    dtype = _HEADER_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"{f}: tensor {key} has unsupported dtype {sl.get_dtype()}")
                    if key in out:
                        raise CheckpointError(f"{folder}: tensor {key} is stored twice")
                    out[key] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
        except CheckpointError:
            raise
        except Exception as err:  # the Rust reader's error: a truncated or corrupt file
            raise CheckpointError(f"{f}: unreadable safetensors file ({err}); truncated or corrupt?") from None
    return out


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint folder holds, from its ``config.json``, its file headers and its manifest (no weight
    is read): the one reading of a checkpoint that serving, evaluation, the parent check and extraction use.

    ``format``: ``"dense"`` or the quantized format (``fp8``, ``nvfp4``, ``nvfp4_w4a4``: ``quant_algo`` of its
    ``quantization_config``, ModelOpt's names); ``layout``: ``"published"`` (``backbone.`` keys, one tensor per
    routed expert, as ``save_pretrained`` writes) or ``"stacked"`` (``model.`` keys or experts stored as one
    (E, out, in) tensor); ``tensors``: stored key -> meta tensor; ``manifest``: ``manifest.json`` or None.
    """

    folder: Path
    config: HybridConfig
    raw: dict[str, Any]
    format: str
    layout: str
    tensors: dict[str, Tensor]
    manifest: dict[str, Any] | None

    @property
    def quantized(self) -> bool:
        return self.format != "dense"

    @property
    def elastic(self) -> bool:
        """Whether the folder is a nested checkpoint (an ``elastic`` section in its config)."""
        return "elastic" in self.raw

    def dense_state(self) -> dict[str, Tensor]:
        """The tensors under the model's names, as the loader reads them (``mtp.*`` dropped, per-expert tensors
        stacked, a tied head filled from the embeddings); :meth:`~model.hybrid.HybridLM.check_checkpoint`
        checks them against the config."""
        state = to_canonical({k: v for k, v in self.tensors.items() if not k.startswith(_MTP_PREFIX)})
        if tied_head(state, self.raw, self.folder, strict=False):  # untied: check_state names the missing head
            state["lm_head.weight"] = state["model.embeddings.weight"]
        return state


def tied_head(keys: Collection[str], raw: Mapping[str, Any], folder: str | Path, *, strict: bool) -> bool:
    """Whether a folder's ``lm_head.weight`` is to be filled from its ``model.embeddings.weight``: the head absent
    from ``keys`` (the model's names of the stored tensors), the embedding present and ``raw`` (its config.json)
    setting ``tie_word_embeddings``. A head absent and not tied is False, or with ``strict`` a
    :class:`CheckpointError` naming the fix. Every reader of a checkpoint decides by this rule."""
    if "lm_head.weight" in keys or "model.embeddings.weight" not in keys:
        return False
    if raw.get("tie_word_embeddings"):
        return True
    if strict:
        raise CheckpointError(
            f"{folder}: no lm_head.weight in the files and {CONFIG_NAME} does not set tie_word_embeddings; "
            "set it to true if the model ties its output layer to the embedding, or add the tensor"
        )
    return False


def inspect_checkpoint(folder: str | Path, verify: bool = True) -> CheckpointInfo:
    """Read a checkpoint folder's config, format, layout, tensor headers and manifest (see
    :class:`CheckpointInfo`); with ``verify``, check every file against its manifest's SHA-256 first."""
    from model.quant.modelopt import format_of

    folder = Path(folder)
    try:
        config, raw = read_config(folder)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{folder}: config.json is not valid JSON ({err})") from None
    if verify:
        verify_manifest(folder)
    tensors = header_tensors(folder)
    stacked = any(k.startswith("model.") for k in tensors) or any(
        k.endswith(("experts.up_proj", "experts.down_proj")) for k in tensors
    )
    manifest = json.loads((folder / MANIFEST_NAME).read_text()) if (folder / MANIFEST_NAME).is_file() else None
    fmt = format_of(raw.get("quantization_config")) or "dense"
    return CheckpointInfo(folder, config, raw, fmt, "stacked" if stacked else "published", tensors, manifest)


def _loaded_copy(key: str, view: Tensor, dtype: torch.dtype | None) -> Tensor:
    """An owned copy of ``view`` as :func:`load_state` holds it (floating: ``dtype``, router bias: float32)."""
    return view.to(loaded_dtype(key, view, dtype), copy=True)


def loaded_dtype(name: str, view: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a loaded tensor is held in: as stored when not floating or ``dtype`` is None, the MoE router's
    ``e_score_correction_bias`` in float32, any other floating tensor in ``dtype``."""
    if not view.is_floating_point():
        return view.dtype
    return torch.float32 if name.endswith(_FP32_TENSORS) else (dtype or view.dtype)


def _read_state(folder: Path, expected: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """The checkpoint's tensors under our names (``model.`` prefix, stacked experts), each copied once.

    A per-expert tensor (``...mixer.experts.{j}.up_proj.weight``, what transformers writes) is copied
    straight into slot ``j`` of its stacked (E, out, in) tensor, so no per-expert copies sit beside
    the stacked ones. ``expected`` (the config's state, e.g. on the meta device) gives the stacked
    shapes; per-expert tensors that do not fit it raise :class:`CheckpointError` naming them.
    """
    out: dict[str, Tensor] = {}
    stacker = ExpertStacker({name: tuple(t.shape) for name, t in expected.items()}, dtype)
    per_expert: set[str] = set()  # stacks built from per-expert tensors
    for file_key, view in iter_views(folder):
        named = canonical_name(file_key)
        if named is None:
            continue
        key, index = named
        if (key in out and key not in per_expert) or (index is None and (key in out or key in stacker.pending)):
            raise CheckpointError(f"{folder}: {key} is stored both stacked and per expert")
        if index is not None:
            stacked = stacker.add(key, index, view)
            if stacked is not None:
                out[key] = stacked
                per_expert.add(key)
            continue
        out[key] = _loaded_copy(key, view, dtype)
    misfits = stacker.problems()
    if misfits:
        raise CheckpointError(f"{folder}: per-expert tensors that do not fit the config: " + "; ".join(misfits[:20]))
    return out


def load_state(path: str | Path, expected: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The tensors of a checkpoint folder under the model's names, checked against ``expected``; all-or-nothing.

    ``expected``: the state dict of a model built from the folder's config (meta tensors suffice; it gives
    the names and the stacked experts' shapes): :meth:`~model.hybrid.HybridLM.from_pretrained` builds it
    and assigns the result. ``dtype=None`` keeps every tensor in its stored dtype (bf16 files give bf16
    tensors); a ``dtype`` converts floating tensors as they are read. The router's
    ``e_score_correction_bias`` is float32 either way. Each tensor is copied once out of the files (see
    :func:`_read_state`). See the module docstring for the layouts accepted.
    """
    folder = Path(path)
    _, raw = read_config(folder)
    verify_manifest(folder)
    tensors = _read_state(folder, expected, dtype)
    if tied_head(tensors, raw, folder, strict=True):
        # A tied checkpoint stores the matrix once. Our lm_head is a separate parameter (training may move it
        # away from the embedding), so it starts as a copy and the config is written back untied.
        tensors["lm_head.weight"] = tensors["model.embeddings.weight"].clone()
    check_state(dict(expected), tensors, str(folder))
    return tensors


def write_checkpoint(
    path: str | Path,
    tensors: Mapping[str, Tensor],
    config: HybridConfig,
    metadata: dict[str, str] | None = None,
    extra_config: dict[str, Any] | None = None,
    extra_files: Mapping[str, Path] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    prefix: Prefix = "backbone",
    expert_layout: ExpertLayout = "per_expert",
    extra_json: Mapping[str, Any] | None = None,
) -> Path:
    """Publish the weights, ``config.json``, ``extra_files`` and ``manifest.json`` as one folder, atomically.

    ``tensors`` (the model's names: ``model.`` prefix, stacked or per-expert experts; CPU tensors) are
    written in the published layout (:mod:`model.layout`: ``backbone.`` keys, one tensor per routed
    expert, sharded with an index above ``max_shard_size``), with ``metadata`` added to every file header
    beside ``format: pt``; ``extra_config`` keys are added to ``config.json``; ``extra_files`` (name ->
    source path, e.g. the tokenizer) are copied in before hashing, so the manifest covers every file.
    ``extra_json`` (file name -> JSON content, e.g. ``hf_quant_config.json``) are written beside.
    ``prefix`` / ``expert_layout`` other than the defaults write the older layouts the reader also
    accepts. An existing ``path`` is replaced only once the new folder is complete
    (:func:`~model.atomic.publish_folder`).
    """
    with publish_folder(path) as staging:
        with WeightsWriter(staging, state_entries(tensors), max_shard_size, metadata, prefix, expert_layout) as w:
            for name, tensor in tensors.items():
                w.write(name, tensor)
            w.close()
        config.to_json_file(staging / CONFIG_NAME, extra=extra_config)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, staging / name)
        for name, content in (extra_json or {}).items():
            (staging / name).write_text(json.dumps(content, indent=4) + "\n", encoding="utf-8")
        write_manifest(staging)
    return Path(path)


def save_model(
    model,
    path: str | Path,
    prefix: Prefix = "backbone",
    expert_layout: ExpertLayout = "per_expert",
    extra_config: dict[str, Any] | None = None,
    extra_files: dict[str, Path] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write the model's weights (published layout by default, see :func:`write_checkpoint`), ``config.json``
    (plus ``extra_config`` keys) and ``manifest.json``.

    ``extra_files`` (name -> source path) are copied in too (e.g. the tokenizer), before
    hashing, so the manifest covers them.
    """
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return write_checkpoint(
        path,
        state,
        model.config,
        extra_config=extra_config,
        extra_files=extra_files,
        max_shard_size=max_shard_size,
        prefix=prefix,
        expert_layout=expert_layout,
    )
