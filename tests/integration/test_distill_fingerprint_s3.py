"""The distillation run name keys the input checkpoints by their manifests, read from S3 without the weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import components.storage as storage
from components.distill.config import DistillConfig, input_fingerprint, with_run_name
from components.storage import publish
from model.checkpoint import write_manifest

pytestmark = pytest.mark.integration


def _checkpoint(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text('{"model_type": "nemotron_h"}')
    write_manifest(folder)
    return folder


def _config(teacher: str, init_from: str | None = None) -> DistillConfig:
    return DistillConfig(
        teacher_uri=teacher, init_from=init_from, phase=2 if init_from else 1, output_dir="out",
        space={"hidden": [32, 16]}, budgets=[{"name": "full", "fraction": 1.0}],
    )  # fmt: skip


def test_run_name_of_an_s3_teacher_reads_its_manifest_only(s3_server, tmp_path, monkeypatch):
    teacher = _checkpoint(tmp_path / "teacher", b"\x01" * 4096)
    student = _checkpoint(tmp_path / "student", b"\x02" * 4096)
    changed = _checkpoint(tmp_path / "changed", b"\x03" * 4096)
    for folder in (teacher, student):
        publish(folder, f"s3://test-bucket/fingerprint/{folder.name}")
    publish(tmp_path / "teacher", "s3://test-bucket/fingerprint/no-manifest")
    storage.s3_client().delete_object(Bucket="test-bucket", Key="fingerprint/no-manifest/manifest.json")

    def no_download(*args, **kwargs):
        raise AssertionError("the run name downloaded a checkpoint")

    monkeypatch.setattr(storage, "materialize", no_download)
    s3 = "s3://test-bucket/fingerprint/"
    # the fingerprint is the manifests' bytes, written out here: the S3 copy keys like the local folder
    expected = hashlib.sha256(
        (teacher / "manifest.json").read_bytes() + (student / "manifest.json").read_bytes()
    ).hexdigest()
    assert input_fingerprint(f"{s3}teacher", f"{s3}student") == expected
    assert input_fingerprint(teacher, student) == expected
    config = _config(f"{s3}teacher", f"{s3}student")
    assert with_run_name(config).run_name == f"distill-phase2-{config.run_key(expected)}"
    # other weights under the same URI: another run; a prefix without a manifest adds nothing (as a folder)
    before = with_run_name(_config(f"{s3}teacher")).run_name
    publish(changed, f"{s3}teacher")
    assert with_run_name(_config(f"{s3}teacher")).run_name != before
    assert input_fingerprint(f"{s3}no-manifest", None) == hashlib.sha256().hexdigest()
