"""Parents written by transformers' ``NemotronHForCausalLM.save_pretrained`` (and publishers) load here.

Each test saves a tiny transformers model with every layer kind (Mamba2, attention, MoE, dense
MLP) in one of the layouts a user brings (fp32 / bf16, single file / sharded, both layer-pattern
spellings, tied embeddings, every spelling of infinity), loads it with our loader and compares
logits with transformers' own on the same input.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    iter_tensors,
    read_config,
    read_tensors,
    to_canonical,
    weight_files,
    write_manifest,
)
from model.config import HybridConfig, decode_special_floats
from model.hybrid import HybridLM
from tests.conftest import TINY
from tests.helpers import perturbed_hf_model

transformers = pytest.importorskip("transformers")

PATTERN = "M*ME-E"
BLOCKS = ["linear_attention", "full_attention", "linear_attention", "moe", "mlp", "moe"]  # PATTERN, list spelling
LEGACY_BLOCKS = ["mamba", "attention", "mamba", "moe", "mlp", "moe"]  # the same layers, legacy names
HF_TINY = {**{k: v for k, v in TINY.items() if k != "pattern"}, "layers_block_type": BLOCKS}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # max |logit difference|; tiny-model logits are ~0.4


def _hf_model(seed: int = 0):
    """A tiny transformers NemotronH with non-trivial values everywhere (default init leaves some constant)."""
    return perturbed_hf_model(HF_TINY, seed)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, HF_TINY["vocab_size"], (2, 21), generator=torch.Generator().manual_seed(seed))


def _max_diff(ours, hf, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(ids).logits.float() - hf(ids).logits.float()).abs().max().item()


def _edit_config(folder: Path, **changes) -> dict:
    """Rewrite ``config.json``: a value of ``None`` removes the key."""
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return raw


def _drop_tensor(folder: Path, name: str) -> None:
    """Remove one tensor from a single-file or sharded checkpoint, as a writer that never stored it would."""
    index_path = folder / INDEX_NAME
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    shard = folder / (index["weight_map"].pop(name) if index else "model.safetensors")
    tensors = load_file(str(shard))
    del tensors[name]
    if tensors:
        save_file(tensors, str(shard), metadata={"format": "pt"})
    else:
        shard.unlink()
    if index:
        index_path.write_text(json.dumps(index))


# ---------------------------------------------------------------------- dtypes and sharding
@pytest.mark.parametrize(
    ("dtype", "max_shard_size"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "20KB"), (torch.bfloat16, "10KB")],
    ids=["fp32", "bf16", "fp32-sharded", "bf16-sharded"],
)
def test_save_pretrained_output_loads_with_equal_logits(tmp_path, dtype, max_shard_size):
    hf = _hf_model().to(dtype)
    hf.save_pretrained(tmp_path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["time_step_limit"] == [0.0, {"__float__": "Infinity"}]  # how transformers 5 writes inf
    assert raw["layers_block_type"] == BLOCKS and "hybrid_override_pattern" not in raw
    assert not (tmp_path / "manifest.json").exists()
    if max_shard_size:
        shards = set(json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"].values())
        assert len(shards) >= 2 and not (tmp_path / "model.safetensors").exists()
        assert weight_files(tmp_path) == sorted(tmp_path / s for s in shards)

    ours = HybridLM.from_pretrained(tmp_path)
    assert ours.config.pattern == PATTERN and ours.config.time_step_limit == (0.0, math.inf)
    assert {p.dtype for p in ours.parameters()} == {dtype}  # dtype=None keeps the stored dtype
    for block in ours.model.layers:
        if block.kind == "moe":
            assert block.mixer.gate.e_score_correction_bias.dtype == torch.float32  # as transformers keeps it
    ids = _ids()
    assert _max_diff(ours, hf, ids) <= TOLERANCE[dtype]
    if dtype == torch.bfloat16:  # the same bf16 values computed in float32 on both sides: no rounding slack
        assert _max_diff(HybridLM.from_pretrained(tmp_path, dtype=torch.float32), hf.float(), ids) <= 1e-4


def test_sharded_checkpoint_with_missing_shard_names_it(tmp_path):
    _hf_model().save_pretrained(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        HybridLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------------- layer-pattern spellings
@pytest.mark.parametrize(
    "layout",
    [
        {"layers_block_type": None, "hybrid_override_pattern": PATTERN},
        {"layers_block_type": LEGACY_BLOCKS},
        {"layers_block_type": None, "layer_types": BLOCKS},
        {"hybrid_override_pattern": PATTERN},  # both spellings, agreeing
    ],
    ids=["hybrid_override_pattern", "legacy-names", "layer_types", "both"],
)
def test_layer_pattern_spellings_load(tmp_path, layout):
    from transformers import NemotronHConfig

    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    _edit_config(tmp_path, **layout)
    assert NemotronHConfig.from_pretrained(tmp_path).layers_block_type == BLOCKS  # transformers reads it too
    ours = HybridLM.from_pretrained(tmp_path)
    assert ours.config.pattern == PATTERN
    assert [b.kind for b in ours.model.layers] == ["mamba", "attention", "mamba", "moe", "mlp", "moe"]
    assert _max_diff(ours, hf, _ids()) <= 1e-4


def test_disagreeing_layer_spellings_are_named(tmp_path):
    _hf_model().save_pretrained(tmp_path)
    _edit_config(tmp_path, hybrid_override_pattern="MMME-E")
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        HybridLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------------- tied embeddings
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single", "sharded"])
def test_tied_embeddings_load(tmp_path, max_shard_size):
    hf = _hf_model()
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embeddings.weight)  # the tied model, computed by transformers
    hf.save_pretrained(tmp_path / "hf", **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    # transformers' NemotronH never ties (it always stores lm_head); a tied writer stores the matrix once
    _drop_tensor(tmp_path / "hf", "lm_head.weight")
    _edit_config(tmp_path / "hf", tie_word_embeddings=True)
    assert "lm_head.weight" not in read_tensors(tmp_path / "hf")

    ours = HybridLM.from_pretrained(tmp_path / "hf")
    assert _max_diff(ours, hf, _ids()) <= 1e-4
    # lm_head is its own parameter (training may move it), starting equal to the embedding
    assert ours.lm_head.weight.data_ptr() != ours.model.embeddings.weight.data_ptr()
    assert torch.equal(ours.lm_head.weight, ours.model.embeddings.weight)
    # written back untied, with lm_head stored, so any reader gets the same output layer
    out = ours.save_pretrained(tmp_path / "ours")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in read_tensors(out)
    assert _max_diff(HybridLM.from_pretrained(out), hf, _ids()) <= 1e-4


def test_missing_lm_head_without_tying_is_named(tmp_path):
    _hf_model().save_pretrained(tmp_path)
    _drop_tensor(tmp_path, "lm_head.weight")
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        HybridLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------------- infinities in config.json
@pytest.mark.parametrize("literal", ["Infinity", '{"__float__": "Infinity"}', "1e30", "1e+300"])
def test_every_spelling_of_infinity_loads(tmp_path, literal):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["time_step_limit"] = [0.0, "@INF@"]
    (tmp_path / "config.json").write_text(json.dumps(raw).replace('"@INF@"', literal))
    assert literal in (tmp_path / "config.json").read_text()

    assert HybridConfig.from_json_file(tmp_path / "config.json").time_step_limit == (0.0, math.inf)
    ours = HybridLM.from_pretrained(tmp_path)
    assert ours.config.time_step_limit == (0.0, math.inf)
    assert _max_diff(ours, hf, _ids()) <= 1e-4


def test_time_step_limit_finite_null_and_bad_values():
    base = HybridConfig(pattern=PATTERN, vocab_size=64, hidden_size=32).to_hf_dict()
    assert HybridConfig.from_hf_dict({**base, "time_step_limit": [0.0, 5.0]}).time_step_limit == (0.0, 5.0)
    assert HybridConfig.from_hf_dict({**base, "time_step_limit": None}).time_step_limit == (0.0, math.inf)
    with pytest.raises(ValueError, match="time_step_limit"):
        HybridConfig.from_hf_dict({**base, "time_step_limit": [0.0, "big"]})
    with pytest.raises(ValueError, match="__float__"):
        HybridConfig.from_hf_dict({**base, "time_step_limit": [0.0, {"__float__": "Infinityy"}]})


def test_decode_special_floats():
    got = decode_special_floats(
        {"a": [1.5, {"__float__": "Infinity"}], "b": {"c": {"__float__": "-Infinity"}}, "d": {"__float__": "NaN"}}
    )
    assert got["a"] == [1.5, math.inf] and got["b"] == {"c": -math.inf} and math.isnan(got["d"])
    assert decode_special_floats({"__float__": "Infinity", "other": 1}) == {"__float__": "Infinity", "other": 1}


def test_written_config_stays_strict_json_and_reads_back_infinite(tmp_path):
    cfg = HybridConfig(pattern=PATTERN, vocab_size=64, hidden_size=32)
    cfg.to_json_file(tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    assert "Infinity" not in text and "__float__" not in text  # readable by any JSON parser
    assert HybridConfig.from_json_file(tmp_path / "config.json").time_step_limit == (0.0, math.inf)


# ---------------------------------------------------------------------- publisher configs
def test_publisher_style_config_loads(tmp_path):
    """Keys a publisher's nemotron_h config.json carries that no implementation reads, and legacy names."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    _edit_config(
        tmp_path,
        layers_block_type=None,
        hybrid_override_pattern=PATTERN,
        num_hidden_layers=6,
        head_dim=None,
        attention_head_dim=8,  # the first Nemotron-H releases' name
        n_groups=None,
        mamba_n_groups=2,
        time_step_limit=None,
        dtype=None,
        torch_dtype="bfloat16",
        transformers_version="4.55.4",
        auto_map={"AutoConfig": "configuration_nemotron_h.NemotronHConfig"},
        _name_or_path="nvidia/some-model",
        norm_eps=1e-5,
        rms_norm_eps=1e-5,
        rope_theta=10000,
        partial_rotary_factor=1.0,
        time_step_rank=256,
    )
    config, raw = read_config(tmp_path)
    assert config.head_dim == 8 and config.n_groups == 2 and raw["rope_theta"] == 10000
    assert _max_diff(HybridLM.from_pretrained(tmp_path), hf, _ids()) <= 1e-4
    _edit_config(tmp_path, hiden_size=32)  # a typo is still an error naming the key
    with pytest.raises(ValueError, match="hiden_size"):
        HybridLM.from_pretrained(tmp_path)


def test_multi_token_prediction_tensors_are_skipped(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.layers.0.norm.weight"] = torch.ones(HF_TINY["hidden_size"])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert _max_diff(HybridLM.from_pretrained(tmp_path), hf, _ids()) <= 1e-4


# ---------------------------------------------------------------------- manifest and streaming
def test_manifest_is_checked_when_present(tmp_path):
    _hf_model().save_pretrained(tmp_path, max_shard_size="20KB")
    write_manifest(tmp_path)
    HybridLM.from_pretrained(tmp_path)  # intact: loads
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="SHA-256"):
        HybridLM.from_pretrained(tmp_path)


def test_iter_tensors_streams_every_tensor_once(tmp_path):
    hf = _hf_model().to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="10KB")
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    stream = iter_tensors(tmp_path)
    assert iter(stream) is stream  # an iterator, not a materialised dict
    first_name, _ = next(stream)
    got = dict([(first_name, _)] + list(stream))
    assert sorted(got) == sorted(weight_map)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert any(".experts.0.up_proj.weight" in k for k in got)  # transformers stores one tensor per expert
    canonical = to_canonical(got)
    reference = hf.state_dict()
    assert sorted(canonical) == sorted(reference)
    for name, tensor in canonical.items():
        assert torch.equal(tensor, reference[name]), name
    del got, stream
    gc.collect()
    if Path("/proc/self/maps").exists():  # copies, not views: no shard stays mapped
        maps = Path("/proc/self/maps").read_text()
        assert not any(str(f) in maps for f in weight_files(tmp_path))


def test_reopening_files_changes_nothing(tmp_path, monkeypatch):
    """Files are reopened every REOPEN_BYTES; with a tiny window every tensor comes through one opening each."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    whole = read_tensors(tmp_path)
    import model.checkpoint as ck

    openings = []
    real_open = ck.safe_open
    monkeypatch.setattr(ck, "safe_open", lambda *a, **k: openings.append(a[0]) or real_open(*a, **k))
    monkeypatch.setattr(ck, "REOPEN_BYTES", 1)
    assert list(read_tensors(tmp_path)) == list(whole)
    assert len(openings) == len(whole) + 1  # one to list the keys, then one per tensor
    assert all(torch.equal(t, whole[k]) for k, t in read_tensors(tmp_path).items())
    assert _max_diff(HybridLM.from_pretrained(tmp_path), hf, _ids()) <= 1e-4


def test_iter_tensors_converts_floating_tensors_only(tmp_path):
    cfg = HybridConfig(pattern=PATTERN, vocab_size=64, hidden_size=32, n_routed_experts=4, num_experts_per_tok=2)
    HybridLM(cfg).init_weights(0).save_pretrained(tmp_path)
    stored = read_tensors(tmp_path)
    stored["step"] = torch.tensor([7], dtype=torch.int64)  # a non-floating tensor must keep its dtype
    save_file(stored, str(tmp_path / "model.safetensors"))
    got = dict(iter_tensors(tmp_path, dtype=torch.bfloat16))
    assert got["step"].dtype == torch.int64 and got["step"].tolist() == [7]
    assert got["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lm_head.weight"], stored["lm_head.weight"].to(torch.bfloat16))


def test_per_expert_tensors_that_do_not_fit_are_named(tmp_path):
    _hf_model().save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["backbone.layers.3.mixer.experts.2.up_proj.weight"]
    tensors["backbone.layers.5.mixer.experts.9.down_proj.weight"] = torch.zeros(32, 16)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        HybridLM.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "model.layers.5.mixer.experts.9.down_proj.weight" in msg
    assert "model.layers.3.mixer.experts.up_proj: no tensor for experts [2]" in msg


def test_duplicate_tensor_across_shards_is_named(tmp_path):
    _hf_model().save_pretrained(tmp_path, max_shard_size="20KB")
    first, second = sorted(tmp_path.glob("model-*.safetensors"))[:2]
    a, b = load_file(str(first)), load_file(str(second))
    name = next(iter(a))
    b[name] = a[name]
    save_file(b, str(second), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="stored twice"):
        read_tensors(tmp_path)


# ---------------------------------------------------------------------- other loaders
def test_budget_registry_and_quantizer_read_transformers_output(tmp_path):
    from model.decode.budget_view import BudgetRegistry
    from model.quant import load_quantized_model
    from model.quant.quantize import quantize_checkpoint

    hf = _hf_model().to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="10KB")
    registry = BudgetRegistry.from_checkpoint(tmp_path / "hf", dtype=torch.float32)
    assert registry.names == ["full"]
    hf32 = _hf_model().to(torch.bfloat16).float()  # the bf16-rounded weights, computed in float32
    assert _max_diff(registry.get("full"), hf32, _ids()) <= 1e-4
    out = quantize_checkpoint(tmp_path / "hf", tmp_path / "fp8", "fp8")
    quantized = load_quantized_model(out, dtype=torch.float32)
    assert quantized.config.time_step_limit == (0.0, math.inf)
    assert _max_diff(quantized, hf32, _ids()) <= 0.1  # fp8 weights: close, not equal
