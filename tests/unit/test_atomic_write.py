"""Atomic checkpoint writes: a folder is published whole or not at all, and its hashes are checked on load."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from model.atomic import publish_folder
from model.checkpoint import CheckpointError, write_checkpoint
from model.hybrid import HybridLM


def _old_folder(parent: Path) -> Path:
    target = parent / "ck"
    target.mkdir()
    (target / "a.txt").write_text("old a")
    (target / "stale.txt").write_text("only in the old folder")
    return target


def _listing(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_new_folder_appears_only_complete(tmp_path):
    target = tmp_path / "sub" / "ck"  # parent folders are created
    with publish_folder(target) as staging:
        (staging / "a.txt").write_text("new a")
        assert not target.exists()  # nothing visible under the target name while writing
        assert staging.parent == target.parent and staging.name.startswith(".ck.tmp-")  # same file system
        (staging / "b.txt").write_text("new b")
    assert _listing(target) == {"a.txt": "new a", "b.txt": "new b"}
    assert [p.name for p in target.parent.iterdir()] == ["ck"]


def test_replacement_appears_only_complete(tmp_path):
    target = _old_folder(tmp_path)
    with publish_folder(target) as staging:
        (staging / "a.txt").write_text("new a")
        # a reader still sees the whole old folder
        assert _listing(target) == {"a.txt": "old a", "stale.txt": "only in the old folder"}
        (staging / "b.txt").write_text("new b")
    assert _listing(target) == {"a.txt": "new a", "b.txt": "new b"}  # replaced as a whole: no stale.txt
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no staging or set-aside folder left


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_inside_keeps_old_folder_and_leaves_no_staging(tmp_path, error):
    target = _old_folder(tmp_path)
    with pytest.raises(type(error)), publish_folder(target) as staging:
        (staging / "a.txt").write_text("half written")
        raise error
    assert _listing(target) == {"a.txt": "old a", "stale.txt": "only in the old folder"}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_failed_rename_restores_old_folder(tmp_path, monkeypatch):
    target = _old_folder(tmp_path)
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".ck.tmp-"):  # the staging folder's rename fails
            raise OSError("rename refused")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename refused"), publish_folder(target) as staging:
        (staging / "a.txt").write_text("new a")
    assert _listing(target) == {"a.txt": "old a", "stale.txt": "only in the old folder"}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd to name fsynced descriptors")
def test_files_reach_disk_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "ck"
    with publish_folder(target) as staging:
        (staging / "a.txt").write_text("a")
        (staging / "b.txt").write_text("b")
    assert events == [
        ("fsync", str(staging / "a.txt")),
        ("fsync", str(staging / "b.txt")),
        ("fsync", str(staging)),
        ("replace", str(target)),
        ("fsync", str(tmp_path)),  # the rename itself
    ]


def test_published_folder_has_a_plain_folders_mode(tmp_path):
    with publish_folder(tmp_path / "ck") as staging:
        (staging / "a.txt").write_text("a")
    (tmp_path / "plain").mkdir()
    mode = stat.S_IMODE((tmp_path / "ck").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


def test_checkpoint_manifest_covers_every_file_and_is_verified_on_load(tmp_path, tiny_config):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": "tiny"}')
    model = HybridLM(tiny_config).init_weights(0).eval()
    out = model.save_pretrained(tmp_path / "ck", extra_files={"tokenizer.json": tokenizer})
    assert out == tmp_path / "ck"
    manifest = json.loads((out / "manifest.json").read_text())["files"]
    assert sorted(manifest) == ["config.json", "model.safetensors", "tokenizer.json"]
    for name, info in manifest.items():
        blob = (out / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    loaded = HybridLM.from_pretrained(out)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    weights = out / "model.safetensors"
    intact = weights.read_bytes()
    blob = bytearray(intact)
    blob[-3] ^= 0xFF
    weights.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its SHA-256"):
        HybridLM.from_pretrained(out)
    weights.write_bytes(intact)
    (out / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json listed in manifest.json is missing"):
        HybridLM.from_pretrained(out)


def test_write_checkpoint_failure_keeps_the_previous_checkpoint(tmp_path, tiny_config):
    model = HybridLM(tiny_config).init_weights(0).eval()
    good = model.save_pretrained(tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    missing = tmp_path / "no-such-tokenizer.json"  # copying it fails after the weights are written
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    with pytest.raises(FileNotFoundError):
        write_checkpoint(good, tensors, tiny_config, extra_files={"tokenizer.json": missing})
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    HybridLM.from_pretrained(good)  # still loads, hashes intact
