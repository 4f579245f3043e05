"""A checkpoint folder's ``manifest.json``: size and SHA-256 of every file, written on publish, checked on load."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, or whose files fail their hashes."""


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


__all__ = ["MANIFEST_NAME", "CheckpointError", "sha256_file", "verify_manifest", "write_manifest"]
