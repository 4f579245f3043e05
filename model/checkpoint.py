"""Checkpoint I/O in the Hugging Face ``nemotron_h`` layout: safetensors + config.json.

Loading accepts both key prefixes (``backbone.`` from the original release,
``model.`` from transformers) and both expert layouts (one tensor per expert,
``mixer.experts.{j}.up_proj.weight``, or stacked 3-D ``mixer.experts.up_proj``),
single-file or sharded (``model.safetensors.index.json``). Every tensor is checked
against the config: missing, unexpected and mis-shaped tensors are all reported by
name, and no model is returned half-loaded. Only safetensors are read: nothing is
ever unpickled.

Saving writes into a temporary sibling folder and renames it into place, so a
crash never leaves a half-written checkpoint; ``manifest.json`` records the
SHA-256 of every file and is verified on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from model.config import HybridConfig

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"

_PER_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, or whose files fail their hashes."""


# ---------------------------------------------------------------------- hashing
def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> dict[str, Any]:
    """Record size and SHA-256 of every file in ``folder`` (except the manifest itself)."""
    files = {
        p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def verify_manifest(folder: Path) -> None:
    """Raise :class:`CheckpointError` if a file listed in ``manifest.json`` is missing or altered."""
    path = folder / MANIFEST_NAME
    if not path.exists():
        return
    manifest = json.loads(path.read_text())
    for name, info in manifest.get("files", {}).items():
        f = folder / name
        if not f.exists():
            raise CheckpointError(f"{folder}: file {name} listed in {MANIFEST_NAME} is missing")
        if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            raise CheckpointError(f"{folder}: {name} does not match its SHA-256 in {MANIFEST_NAME} (corrupt?)")


# ---------------------------------------------------------------------- atomic folders
def atomic_folder(target: Path) -> tuple[Path, Callable[[], Path]]:
    """A temporary sibling of ``target`` and a ``commit()`` that swaps it into place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))

    def commit() -> Path:
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        return target

    return tmp, commit


# ---------------------------------------------------------------------- key mapping
def to_canonical(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename ``backbone.`` to ``model.`` and stack per-expert tensors into (E, out, in)."""
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("backbone."):
            key = "model." + key[len("backbone.") :]
        m = _PER_EXPERT.match(key)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
        else:
            out[key] = value
    for (prefix, proj), per in experts.items():
        ids = sorted(per)
        if ids != list(range(len(ids))):
            raise CheckpointError(f"{prefix}.*.{proj}.weight: expert indices {ids} are not 0..{len(ids) - 1}")
        out[f"{prefix}.{proj}"] = torch.stack([per[i] for i in ids])
    return out


def from_canonical(
    tensors: dict[str, Tensor], prefix: Literal["model", "backbone"] = "model", expert_layout: str = "stacked"
) -> dict[str, Tensor]:
    """Our state dict -> file keys in the chosen prefix and expert layout."""
    out: dict[str, Tensor] = {}
    for key, value in tensors.items():
        if key.startswith("model.") and prefix != "model":
            key = prefix + key[len("model") :]
        if expert_layout == "per_expert" and re.search(r"\.mixer\.experts\.(up_proj|down_proj)$", key):
            base, proj = key.rsplit(".", 1)
            for j in range(value.shape[0]):
                out[f"{base}.{j}.{proj}.weight"] = value[j].contiguous()
        else:
            out[key] = value.contiguous()
    return out


# ---------------------------------------------------------------------- reading files
def read_tensors(folder: Path) -> dict[str, Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint."""
    files: Iterable[Path]
    if (folder / INDEX_NAME).exists():
        index = json.loads((folder / INDEX_NAME).read_text())
        files = sorted({folder / f for f in index["weight_map"].values()})
    elif (folder / WEIGHTS_NAME).exists():
        files = [folder / WEIGHTS_NAME]
    else:
        found = sorted(folder.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"{folder}: no *.safetensors file (only safetensors checkpoints are read)")
        files = found
    tensors: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                # Copied out of the file mapping: a tensor left in it keeps the whole mapping alive, and
                # every page a relayout or a forward pass has read then stays resident beside the copies
                # (a replica serving a 610 MB model measured 1.3 GB).
                tensors[key] = fh.get_tensor(key).clone()
    return tensors


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
def load_model(path: str | Path, dtype: torch.dtype | None = None):
    """Build a :class:`~model.hybrid.HybridLM` from a checkpoint folder; all-or-nothing."""
    from model.hybrid import HybridLM

    folder = Path(path)
    if not (folder / CONFIG_NAME).exists():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME}")
    verify_manifest(folder)
    config = HybridConfig.from_json_file(folder / CONFIG_NAME)
    tensors = to_canonical(read_tensors(folder))
    with torch.device("meta"):
        model = HybridLM(config)
    expected = model.state_dict()
    check_state(expected, tensors, str(folder))
    if dtype is not None:
        tensors = {
            k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)) if v.is_floating_point() else v
            for k, v in tensors.items()
        }
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval()


def save_model(
    model,
    path: str | Path,
    prefix: Literal["model", "backbone"] = "model",
    expert_layout: Literal["stacked", "per_expert"] = "stacked",
    extra_config: dict[str, Any] | None = None,
    extra_files: dict[str, Path] | None = None,
) -> Path:
    """Write ``model.safetensors``, ``config.json`` (plus ``extra_config`` keys) and ``manifest.json``.

    ``extra_files`` (name -> source path) are copied in too (e.g. the tokenizer), before
    hashing, so the manifest covers them.
    """
    target = Path(path)
    tmp, commit = atomic_folder(target)
    try:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        tensors = from_canonical(state, prefix, expert_layout)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        model.config.to_json_file(tmp / CONFIG_NAME, extra=extra_config)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        write_manifest(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit()
