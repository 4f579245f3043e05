"""The hybrid model: shapes, incremental decoding == full forward, checkpoint round trips, bad input."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from model.cache import HybridCache, MambaCache, clone_cache
from model.checkpoint import CheckpointError, read_tensors
from model.config import HybridConfig
from model.hybrid import HybridLM
from tests.conftest import TINY


def _model(cfg: HybridConfig, seed: int = 0) -> HybridLM:
    m = HybridLM(cfg).init_weights(seed)
    # make the selection bias and the dt clamp matter
    for block in m.model.layers:
        if block.kind == "moe":
            block.mixer.gate.e_score_correction_bias.normal_(0, 0.3)
    return m.eval()


def test_forward_shapes(tiny_config):
    m = _model(tiny_config)
    ids = torch.randint(0, 64, (3, 11))
    assert m(ids).logits.shape == (3, 11, 64)
    assert m(ids, logits_to_keep=1).logits.shape == (3, 1, 64)


@pytest.mark.parametrize("prefill", [1, 4, 9])
def test_incremental_decoding_equals_full_forward(tiny_config, prefill):
    m = _model(tiny_config)
    ids = torch.randint(0, 64, (2, 19))
    full = m(ids).logits
    out = m(ids[:, :prefill], use_cache=True)
    pieces, cache = [out.logits], out.cache
    for t in range(prefill, ids.shape[1]):
        out = m(ids[:, t : t + 1], cache=cache)
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_decoding_never_writes_the_ssm_states_it_is_given(tiny_config):
    """A step returns new SSM states: those of the cache it was given (the model's own or one built
    elsewhere) stay intact, and both decode like the full forward."""
    m = _model(tiny_config)
    ids = torch.randint(0, 64, (2, 12))
    full = m(ids).logits
    out = m(ids[:, :5], use_cache=True)
    own = out.cache
    foreign = HybridCache(
        [MambaCache(c.conv.clone(), c.ssm.clone()) if isinstance(c, MambaCache) else c for c in clone_cache(own).layers]
    )
    originals = [c for c in [*own.layers, *foreign.layers] if isinstance(c, MambaCache)]
    kept = [c.ssm.clone() for c in originals]
    pieces_own, pieces_foreign = [out.logits], [out.logits]
    for t in range(5, ids.shape[1]):
        pieces_own.append(m(ids[:, t : t + 1], cache=own).logits)
        pieces_foreign.append(m(ids[:, t : t + 1], cache=foreign).logits)
    torch.testing.assert_close(torch.cat(pieces_own, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(pieces_foreign, 1), full, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(c.ssm, k) for c, k in zip(originals, kept, strict=True))  # never written


def test_chunked_prefill_after_cache_equals_full_forward(tiny_config):
    """A multi-token chunk on top of a cache (e.g. re-prefill of an answer phase)."""
    m = _model(tiny_config)
    ids = torch.randint(0, 64, (2, 20))
    full = m(ids).logits
    a = m(ids[:, :7], use_cache=True)
    b = m(ids[:, 7:15], cache=a.cache)
    c = m(ids[:, 15:], cache=b.cache)
    torch.testing.assert_close(torch.cat([a.logits, b.logits, c.logits], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix", ["model", "backbone"])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_save_load_round_trip(tmp_path, tiny_config, prefix, layout):
    m = _model(tiny_config)
    m.save_pretrained(tmp_path / "ck", prefix=prefix, expert_layout=layout)
    keys = read_tensors(tmp_path / "ck").keys()
    assert all(k.startswith((prefix + ".", "lm_head")) for k in keys)
    assert any(".experts.0.up_proj.weight" in k for k in keys) == (layout == "per_expert")
    loaded = HybridLM.from_pretrained(tmp_path / "ck")
    ids = torch.randint(0, 64, (2, 9))
    assert torch.equal(loaded(ids).logits, m(ids).logits)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_loaded_model_does_not_keep_the_file_mapped(tmp_path, tiny_config):
    """Tensors are copied out of the safetensors mapping: pages read later would otherwise stay resident."""
    path = _model(tiny_config).save_pretrained(tmp_path / "ck")
    loaded = HybridLM.from_pretrained(path)
    gc.collect()
    assert str(path / "model.safetensors") not in Path("/proc/self/maps").read_text()
    assert loaded(torch.randint(0, 64, (1, 5))).logits.isfinite().all()


def test_corrupt_file_is_detected(tmp_path, tiny_config):
    path = _model(tiny_config).save_pretrained(tmp_path / "ck")
    blob = bytearray((path / "model.safetensors").read_bytes())
    blob[-5] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="SHA-256"):
        HybridLM.from_pretrained(path)


def test_missing_extra_misshaped_tensors_are_named(tmp_path, tiny_config):
    from safetensors.torch import save_file

    path = _model(tiny_config).save_pretrained(tmp_path / "ck")
    (path / "manifest.json").unlink()
    tensors = read_tensors(path)
    del tensors["backbone.norm_f.weight"]
    tensors["backbone.layers.0.mixer.bogus"] = torch.zeros(2)
    tensors["backbone.layers.1.mixer.q_proj.weight"] = torch.zeros(5, 5)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        HybridLM.from_pretrained(path)
    msg = str(err.value)
    assert "model.norm_f.weight" in msg and "mixer.bogus" in msg and "q_proj.weight" in msg


def test_save_is_atomic(tmp_path, tiny_config, monkeypatch):
    """A crash while writing leaves the previous checkpoint intact and no stray folder as the target."""
    m = _model(tiny_config)
    good = m.save_pretrained(tmp_path / "ck")
    before = (good / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr("model.checkpoint.WeightsWriter.write", boom)
    with pytest.raises(RuntimeError):
        _model(tiny_config, seed=1).save_pretrained(tmp_path / "ck")
    assert (good / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# ---------------------------------------------------------------------- config
def test_config_reads_both_layout_spellings():
    base = HybridConfig(**TINY).to_hf_dict()
    a = dict(base)
    a.pop("layers_block_type")
    b = dict(base)
    b.pop("hybrid_override_pattern")
    b["layers_block_type"] = ["mamba", "attention", "mamba", "moe", "mlp", "moe"]  # legacy names
    assert HybridConfig.from_hf_dict(a).pattern == HybridConfig.from_hf_dict(b).pattern == TINY["pattern"]


def test_config_json_round_trip(tmp_path):
    cfg = HybridConfig(**TINY)
    cfg.to_json_file(tmp_path / "config.json")
    back = HybridConfig.from_json_file(tmp_path / "config.json")
    assert back.model_dump(exclude={"passthrough"}) == cfg.model_dump(exclude={"passthrough"})
    assert back.passthrough["architectures"] == ["NemotronHForCausalLM"]


def test_config_unknown_key_is_named():
    raw = HybridConfig(**TINY).to_hf_dict()
    raw["hiden_size"] = 3
    with pytest.raises(ValueError, match="hiden_size"):
        HybridConfig.from_hf_dict(raw)


def test_config_inconsistent_shapes_are_named():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        HybridConfig(**{**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="n_groups"):
        HybridConfig(**{**TINY, "n_groups": 3})
    with pytest.raises(ValueError, match="pattern"):
        HybridConfig(**{**TINY, "pattern": "MX"})
    raw = HybridConfig(**TINY).to_hf_dict()
    raw["num_hidden_layers"] = 99
    with pytest.raises(ValueError, match="num_hidden_layers"):
        HybridConfig.from_hf_dict(raw)


def test_legacy_field_names_are_renamed():
    raw = HybridConfig(**TINY).to_hf_dict()
    raw["mamba_d_conv"] = raw.pop("conv_kernel")
    raw["mamba_chunk_size"] = raw.pop("chunk_size")
    cfg = HybridConfig.from_hf_dict(json.loads(json.dumps(raw)))
    assert cfg.conv_kernel == TINY.get("conv_kernel", 4) and cfg.chunk_size == TINY["chunk_size"]
