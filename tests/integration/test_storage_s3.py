"""Storage through a real S3-compatible server started on loopback."""

from __future__ import annotations

import pytest

from components.storage import check_reachable, materialize, publish

pytestmark = pytest.mark.integration


def test_publish_and_materialize_round_trip(s3_server, tmp_path):
    src = tmp_path / "ck"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"\x00" * (9 << 20))  # large enough for a multipart upload
    (src / "sub" / "config.json").write_text('{"a": 1}')
    (src / "manifest.json").write_text("{}")
    uri = "s3://test-bucket/runs/demo/ck"
    assert publish(src, uri) == uri
    local = materialize(uri, cache_dir=tmp_path / "cache")
    assert (local / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (local / "sub" / "config.json").read_text() == '{"a": 1}'
    assert materialize(uri, cache_dir=tmp_path / "cache") == local  # cached, not downloaded twice


def test_missing_prefix_and_bucket_are_clear_errors(s3_server, tmp_path):
    with pytest.raises(FileNotFoundError, match="no objects"):
        materialize("s3://test-bucket/does/not/exist", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="not reachable"):
        check_reachable("s3://no-such-bucket/x")
    check_reachable("s3://test-bucket/x")
