"""One reading of a checkpoint folder (:func:`model.checkpoint.inspect_checkpoint`): config, format, layout,
tensor headers and manifest, as serving, evaluation, the parent check and extraction take it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import WEIGHTS_NAME, CheckpointError, inspect_checkpoint, save_model, tied_head
from model.config import HybridConfig
from model.hybrid import HybridLM
from tests.conftest import TINY


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return HybridLM(HybridConfig(**TINY)).init_weights(0)


@pytest.mark.parametrize(
    "prefix, experts, layout", [("backbone", "per_expert", "published"), ("model", "stacked", "stacked")]
)
def test_dense_checkpoint_in_either_layout(model, tmp_path, prefix, experts, layout):
    folder = save_model(model, tmp_path / layout, prefix=prefix, expert_layout=experts)
    info = inspect_checkpoint(folder)
    assert (info.format, info.layout, info.quantized, info.elastic) == ("dense", layout, False, False)
    stored = load_file(str(folder / WEIGHTS_NAME))
    assert sorted(info.tensors) == sorted(stored)
    assert all(info.tensors[k].shape == v.shape and info.tensors[k].dtype == v.dtype for k, v in stored.items())
    assert all(t.is_meta for t in info.tensors.values())  # headers only
    assert HybridLM.check_checkpoint(info) == model.num_parameters()
    assert info.manifest is not None and WEIGHTS_NAME in info.manifest["files"]
    assert (info.config.hidden_size, info.config.pattern) == (model.config.hidden_size, model.config.pattern)


def test_quantized_format_from_quant_algo(model, tmp_path):
    from model.quant import quantize_checkpoint

    dense = save_model(model, tmp_path / "dense")
    info = inspect_checkpoint(quantize_checkpoint(dense, tmp_path / "fp8", "fp8"))
    assert info.format == "fp8" and info.quantized and info.raw["quantization_config"]["quant_algo"] == "FP8"
    raw = json.loads((dense / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "something"}  # truthy but not a quant_algo: dense
    (dense / "config.json").write_text(json.dumps(raw))
    assert inspect_checkpoint(dense, verify=False).format == "dense"


def test_altered_files_and_wrong_tensors_are_named(model, tmp_path):
    folder = save_model(model, tmp_path / "m")
    weights = folder / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="SHA-256"):
        inspect_checkpoint(folder)
    folder = save_model(model, tmp_path / "n")
    state = load_file(str(folder / WEIGHTS_NAME))
    state.pop(next(k for k in state if k.endswith("norm_f.weight")))
    from safetensors.torch import save_file

    save_file(state, str(folder / WEIGHTS_NAME))
    info = inspect_checkpoint(folder, verify=False)
    with pytest.raises(CheckpointError, match="missing tensors.*norm_f"):
        HybridLM.check_checkpoint(info)
    (folder / WEIGHTS_NAME).write_bytes(b"\x10\x00\x00\x00")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        inspect_checkpoint(folder, verify=False)
    assert torch.tensor(0).dim() == 0  # torch imported for the fixture's model


def test_a_tied_head_is_read_from_the_embedding_by_one_rule(model, tmp_path):
    folder = save_model(model, tmp_path / "tied")
    state = load_file(str(folder / WEIGHTS_NAME))
    del state["lm_head.weight"]  # a tied writer stores the matrix once
    from safetensors.torch import save_file

    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    info = inspect_checkpoint(folder, verify=False)
    assert "lm_head.weight" in info.dense_state()
    assert HybridLM.check_checkpoint(info) == model.num_parameters()
    (folder / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    info = inspect_checkpoint(folder, verify=False)
    with pytest.raises(CheckpointError, match=r"missing tensors.*lm_head"):  # inspecting names what is missing
        HybridLM.check_checkpoint(info)
    with pytest.raises(CheckpointError, match="set it to true if the model ties"):  # loading names the fix
        tied_head(info.dense_state(), info.raw, folder, strict=True)
    keys = {"model.embeddings.weight"}
    assert tied_head(keys, {"tie_word_embeddings": True}, folder, strict=True)
    assert not tied_head(keys | {"lm_head.weight"}, {"tie_word_embeddings": True}, folder, strict=True)
    assert not tied_head(set(), {"tie_word_embeddings": False}, folder, strict=True)  # no embedding: nothing to tie
    assert not tied_head(keys, {}, folder, strict=False)
