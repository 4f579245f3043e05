"""Reading a checkpoint's metadata from S3 without its weights: ``fetch_files`` / ``fetch_metadata`` on a real
S3-compatible server, and the stage-start checks (distill preflight, the router schedule of phase 2) that use them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.distill.config import DistillConfig, preflight, with_router_schedule
from components.storage import fetch_files, fetch_metadata, materialize, publish
from tests.conftest import TINY
from tests.helpers import save_tiny_parent

pytestmark = pytest.mark.integration


def _files(root: Path) -> set[str]:
    """Every file under ``root``, as paths relative to it."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def parent_dir(tmp_path_factory) -> Path:
    """A tiny random parent (weights, config, manifest) with the character tokenizer beside it."""
    return save_tiny_parent(tmp_path_factory.mktemp("named-parent"))


def test_fetch_files_downloads_only_the_named_files(s3_server, parent_dir, tmp_path):
    uri = "s3://test-bucket/named/parent"
    publish(parent_dir, uri)
    cache = tmp_path / "cache"
    local = fetch_files(uri, ["config.json", "manifest.json", "not-there.json"], cache_dir=cache)
    assert _files(local) == {"config.json", "manifest.json"}  # an absent name is left out
    assert (local / "config.json").read_bytes() == (parent_dir / "config.json").read_bytes()
    assert not [p for p in cache.rglob("*") if p.suffix == ".safetensors"]

    meta = fetch_metadata(uri, cache_dir=cache)
    assert meta == local
    assert "model.safetensors" in _files(parent_dir)
    assert _files(meta) == _files(parent_dir) - {"model.safetensors"}  # everything but the weights
    for name in _files(meta):
        assert (meta / name).read_bytes() == (parent_dir / name).read_bytes(), name
    assert not [p for p in cache.rglob("*") if p.suffix == ".safetensors"]

    # the prefix re-published with another config: the next call reads the new bytes, not a stale copy
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_text('{"changed": true}')
    publish(changed, uri)
    assert (fetch_files(uri, ["config.json"], cache_dir=cache) / "config.json").read_text() == '{"changed": true}'

    # a prefix already downloaded whole is reused as it is
    whole = materialize("s3://test-bucket/named/parent", cache_dir=tmp_path / "whole")
    assert fetch_files(uri, ["config.json"], cache_dir=tmp_path / "whole") == whole

    with pytest.raises(FileNotFoundError, match="none of"):
        fetch_files("s3://test-bucket/named/absent", ["config.json"], cache_dir=cache)
    with pytest.raises(ValueError, match="relative paths"):
        fetch_files(uri, ["../escape.json"], cache_dir=cache)
    assert fetch_files(parent_dir, ["config.json"]) == parent_dir  # a local folder is read in place


def test_distill_preflight_of_an_s3_teacher_reads_no_weights(s3_server, parent_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("STAR_ELASTIC_CACHE", str(cache))
    uri = "s3://test-bucket/named/teacher"
    publish(parent_dir, uri)
    base = dict(
        output_dir=str(tmp_path / "out"), space={"hidden": [32, 16]}, budgets=[{"name": "full", "fraction": 1.0}]
    )
    from_s3 = preflight(DistillConfig(teacher_uri=uri, **base))
    assert from_s3 == preflight(DistillConfig(teacher_uri=str(parent_dir), **base))  # as from the local folder
    assert from_s3.hidden_size == TINY["hidden_size"]
    fetched = _files(cache)
    assert any(f.endswith("/config.json") for f in fetched) and any(f.endswith("/tokenizer.json") for f in fetched)
    assert not [f for f in fetched if f.endswith(".safetensors")], fetched

    with pytest.raises(FileNotFoundError, match="teacher_uri='s3://test-bucket/named/nothing'"):
        preflight(DistillConfig(teacher_uri="s3://test-bucket/named/nothing", **base))


def test_phase2_router_schedule_reads_distill_json_only(s3_server, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("STAR_ELASTIC_CACHE", str(cache))
    phase1 = tmp_path / "phase1"
    phase1.mkdir()
    (phase1 / "model.safetensors").write_bytes(b"\x00" * 4096)
    (phase1 / "distill.json").write_text(json.dumps({"steps": 40, "router": {"step_offset": 0}}))
    publish(phase1, "s3://test-bucket/named/phase1")
    base = dict(phase=2, teacher_uri="t", output_dir="o", space={"hidden": [32, 16]},
                budgets=[{"name": "full", "fraction": 1.0}], steps=10)  # fmt: skip
    resolved = with_router_schedule(DistillConfig(init_from="s3://test-bucket/named/phase1", **base)).router
    assert (resolved.step_offset, resolved.schedule_steps) == (40, 40)
    local = with_router_schedule(DistillConfig(init_from=str(phase1), **base)).router
    assert (local.step_offset, local.schedule_steps) == (40, 40)
    assert not [f for f in _files(cache) if f.endswith(".safetensors")]
    with pytest.raises(FileNotFoundError, match="no distill.json"):
        with_router_schedule(DistillConfig(init_from="s3://test-bucket/named/absent", **base))
