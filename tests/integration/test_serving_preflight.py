"""``star-elastic serve`` on a broken checkpoint: the cause in one line, before Ray starts.

Each corruption of the tiny nested checkpoint (truncated or flipped bytes, with and without the
manifest, a missing or mis-shaped tensor, a missing or invalid config, missing tokenizer files) is
refused by :func:`~components.serving.loading.check_checkpoint` with one line naming the problem; a
checkpoint without ``manifest.json`` loads with a one-line warning. The CLI is run once for real.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def _truncate(folder: Path) -> None:
    data = _weights(folder).read_bytes()
    _weights(folder).write_bytes(data[:-1000])


def _flip(folder: Path) -> None:
    data = bytearray(_weights(folder).read_bytes())
    data[len(data) // 2] ^= 0xFF
    _weights(folder).write_bytes(bytes(data))


def _rewrite(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    from model.checkpoint import write_manifest

    tensors = load_file(str(_weights(folder)))
    change(tensors)
    save_file(tensors, str(_weights(folder)), metadata={"format": "pt"})
    write_manifest(folder)  # consistent hashes: the tensors themselves are what is wrong


def _drop_d(tensors) -> None:
    del tensors["backbone.layers.0.mixer.D"]


def _reshape_d(tensors) -> None:
    import torch

    tensors["backbone.layers.0.mixer.D"] = torch.zeros(3, 3)


def _remanifest(edit):
    def run(folder: Path) -> None:
        from model.checkpoint import write_manifest

        edit(folder)
        write_manifest(folder)

    return run


CASES = [
    ("truncated", _truncate, "model.safetensors does not match its SHA-256 in manifest.json"),
    ("flipped byte", _flip, "model.safetensors does not match its SHA-256 in manifest.json"),
    (
        "truncated, no manifest",
        lambda f: (_truncate(f), (f / "manifest.json").unlink()),
        "model.safetensors: unreadable safetensors file (Error while deserializing header: incomplete metadata, "
        "file not fully covered); truncated or corrupt?",
    ),
    ("missing tensor", lambda f: _rewrite(f, _drop_d), "missing tensors ['model.layers.0.mixer.D']"),
    (
        "wrong shape",
        lambda f: _rewrite(f, _reshape_d),
        "mis-shaped tensors model.layers.0.mixer.D: file (3, 3) vs config (4,)",
    ),
    ("missing config", _remanifest(lambda f: (f / "config.json").unlink()), "no config.json"),
    ("invalid config", _remanifest(lambda f: (f / "config.json").write_text("{oops")), "config.json is not valid JSON"),
    (
        "no tokenizer",
        _remanifest(lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")]),
        "the tokenizer does not load: no tokenizer.json or tokenizer_config.json",
    ),
]


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


@pytest.mark.parametrize(("what", "edit", "message"), CASES, ids=[c[0] for c in CASES])
def test_every_checkpoint_problem_is_one_line(tiny_nested_checkpoint, tmp_path, what, edit, message):
    from components.serving.loading import check_checkpoint
    from model.checkpoint import CheckpointError

    folder = _broken(tiny_nested_checkpoint, tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(folder)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(folder)), text
    assert message in text, text


def test_the_serving_config_is_checked_against_the_checkpoint(tiny_nested_checkpoint):
    from components.serving.config import ServingConfig
    from components.serving.loading import check_checkpoint
    from model.checkpoint import CheckpointError

    assert check_checkpoint(tiny_nested_checkpoint) == []  # the intact checkpoint: no problem, no warning
    with pytest.raises(CheckpointError, match="holds dense weights but format='fp8' was asked"):
        check_checkpoint(tiny_nested_checkpoint, ServingConfig(format="fp8"))
    with pytest.raises(CheckpointError, match=r"budgets \['huge'\] are not in the checkpoint"):
        check_checkpoint(tiny_nested_checkpoint, ServingConfig(budgets=["full", "huge"]))


def test_quantized_checkpoint_passes_and_its_tensors_are_checked(tiny_nested_checkpoint, tmp_path):
    from components.serving.loading import check_checkpoint
    from model.checkpoint import CheckpointError
    from model.quant import quantize_checkpoint

    fp8 = quantize_checkpoint(tiny_nested_checkpoint, tmp_path / "fp8", "fp8")
    assert check_checkpoint(fp8) == []

    def wrong_dtype(tensors) -> None:
        key = next(k for k in sorted(tensors) if k.endswith(".weight_scale"))
        tensors[key] = tensors[key].to(dtype=__import__("torch").float16)

    _rewrite(fp8, wrong_dtype)
    with pytest.raises(CheckpointError, match="quantized tensors with the wrong dtype"):
        check_checkpoint(fp8)


def test_no_manifest_loads_with_a_one_line_warning(tiny_nested_checkpoint, tmp_path, capsys, caplog):
    from components.serving.config import ServingConfig
    from components.serving.loading import LoadedModel, preflight

    folder = _broken(tiny_nested_checkpoint, tmp_path / "ckpt", lambda f: (f / "manifest.json").unlink())
    warning = f"{folder}: no manifest.json; loading without an integrity check (corrupt files may go unnoticed)"
    assert preflight(str(folder)) == [warning]
    assert capsys.readouterr().err == f"star-elastic: warning: {warning}\n"
    with caplog.at_level(logging.WARNING, logger="star_elastic.serving"):
        loaded = LoadedModel.load(folder, ServingConfig())
    assert list(loaded.cards) == ["full", "medium", "small"]
    assert [r.getMessage() for r in caplog.records] == [warning]  # the replica's log says it too


def test_cli_prints_one_line_and_exits_before_ray_starts(tiny_nested_checkpoint, tmp_path):
    folder = _broken(tiny_nested_checkpoint, tmp_path / "ckpt", _flip)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "serve", str(folder), "--port", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [f"star-elastic: error: {folder}: model.safetensors does not match its SHA-256 in manifest.json "
                     "(corrupt?)"]  # fmt: skip
    assert "ray" not in (proc.stdout + proc.stderr).replace(str(folder), "").lower()  # Ray never started
    assert elapsed < 120
