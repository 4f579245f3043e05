"""``star-elastic extract`` takes every nested checkpoint the pipeline writes: dense, FP8 and NVFP4.

The command routes by the checkpoint's ``quantization_config``; its output must equal what the
library functions write for the same budget (the dense extraction, or the quantized slicing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.checkpoint import WEIGHTS_NAME
from model.elastic.export import extract_budget
from model.quant import extract_quantized_budget, quantize_checkpoint
from pipelines.cli import main
from tests.unit.test_quant_checkpoint import build_nested, calib_batches


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("extract-cli")
    nested = build_nested(root / "nested")
    out = {"dense": nested}
    for fmt in ("fp8", "nvfp4", "nvfp4_w4a4"):
        out[fmt] = quantize_checkpoint(nested, root / fmt, fmt, "default", calib_batches())
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


@pytest.mark.parametrize(
    "fmt, algo", [("dense", None), ("fp8", "FP8"), ("nvfp4", "W4A16_NVFP4"), ("nvfp4_w4a4", "NVFP4")]
)
def test_extract_routes_by_format_and_writes_what_the_library_writes(checkpoints, fmt, algo, tmp_path, capsys):
    src = checkpoints[fmt]
    assert main(["extract", str(src), "--budget", "small", "--out", str(tmp_path / "cli")]) == 0
    assert "wrote budget 'small'" in capsys.readouterr().out
    reference = tmp_path / "lib"
    if algo is None:
        extract_budget(src, "small", reference)
    else:
        extract_quantized_budget(src, "small", reference)
    got, want = _tensors(tmp_path / "cli"), _tensors(reference)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        bits = got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape and torch.equal(*bits), name
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert "elastic" not in config
    assert (config.get("quantization_config") or {}).get("quant_algo") == algo


def test_extract_refuses_in_one_line(checkpoints, tmp_path, capsys):
    assert main(["extract", str(checkpoints["nvfp4"]), "--budget", "huge", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "huge" in err and "Traceback" not in err
    assert main(["extract", str(tmp_path), "--budget", "small", "--out", str(tmp_path / "y")]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["dense", "nvfp4_w4a4"])
def test_extract_shards_above_max_shard_size_as_save_pretrained(checkpoints, fmt, tmp_path):
    out = tmp_path / "sharded"
    assert (
        main(["extract", str(checkpoints[fmt]), "--budget", "small", "--out", str(out), "--max-shard-size", "10KB"])
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / WEIGHTS_NAME).exists()
    assert all((out / s).stat().st_size <= 10_000 + 2**16 for s in shards)  # a shard may hold one larger tensor
    whole = tmp_path / "whole"
    assert main(["extract", str(checkpoints[fmt]), "--budget", "small", "--out", str(whole)]) == 0
    want = _tensors(whole)
    got = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as fh:
            got.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    assert sorted(got) == sorted(want) == sorted(index["weight_map"])
    assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)) for k in want)


def test_extract_writes_a_dense_budget_in_the_dtype_asked(checkpoints, tmp_path, capsys):
    out, reference = tmp_path / "bf16", tmp_path / "lib"
    args = ["extract", str(checkpoints["dense"]), "--budget", "small", "--out", str(out), "--dtype", "bfloat16"]
    assert main(args) == 0
    extract_budget(checkpoints["dense"], "small", reference, dtype=torch.bfloat16)
    got, want = _tensors(out), _tensors(reference)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert {t.dtype for k, t in got.items() if k.endswith("proj.weight")} == {torch.bfloat16}
    quantized = ["extract", str(checkpoints["fp8"]), "--budget", "small", "--out", str(tmp_path / "q")]
    capsys.readouterr()
    assert main([*quantized, "--dtype", "bfloat16"]) == 2
    assert "--dtype" in capsys.readouterr().err
