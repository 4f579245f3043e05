"""Masked full model == extracted sub-model, for every elastic axis and their combinations.

The parents are tiny but exercise the grouped rules: two Mamba groups of three heads, two KV
groups of three query heads, six experts with a random selection bias, random norm weights
(so the norm rescaling must be right) and, in one variant, biases everywhere they exist.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.config import HybridConfig
from model.elastic import (
    LAYER_AXES,
    Architecture,
    ElasticSpace,
    extract,
    extract_config,
    hard_mask,
    layer_configs,
    mask_as_dense,
    soft_mask,
)
from model.hybrid import HybridLM

CFG = dict(
    vocab_size=64,
    hidden_size=48,
    pattern="M*EM-E*M",
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=40,
    mamba_num_heads=6,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=8,
    chunk_size=4,
    n_routed_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=32,
)
VARIANTS = {"plain": {}, "biased": {"use_bias": True, "mlp_bias": True}}
SPACE = ElasticSpace(
    hidden=[48, 40, 24],
    mamba_heads=[6, 4, 2],
    attn_heads=[6, 4, 2],
    mlp_ffn=[40, 32, 16],
    moe_ffn=[24, 16, 8],
    shared_ffn=[32, 24, 8],
    experts=[6, 4, 2],
    depth=[8, 7, 5],
    per_layer=True,
)
TOL = 1e-5


@torch.no_grad()
def randomize(model: HybridLM, seed: int = 0) -> HybridLM:
    """Give every tensor a random value of a sensible scale (norms around 1, router bias non-zero)."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, mean=0.0, std=1.0):
        return torch.randn(shape, generator=g) * std + mean

    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
            p.copy_(normal(p.shape, 1.0, 0.3))
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7 + 1))
        elif name.endswith("dt_bias"):
            p.copy_(normal(p.shape, -1.0, 1.0))
        elif name.endswith("embeddings.weight"):
            p.copy_(normal(p.shape))
        elif name.endswith("bias"):
            p.copy_(normal(p.shape, 0.0, 0.1))
        else:  # projections (out, in) / experts (E, out, in) / conv (C, 1, K): scale by fan-in
            p.copy_(normal(p.shape, 0.0, 1.0 / math.sqrt(p.shape[-1])))
    for block in model.model.layers:
        if block.kind == "moe":
            bias = block.mixer.gate.e_score_correction_bias
            bias.copy_(normal(bias.shape, 0.0, 0.3))
    return model.eval()


@functools.cache
def parent(variant: str = "plain") -> HybridLM:
    return randomize(HybridLM(HybridConfig(**CFG, **VARIANTS[variant])))


def ids(seq: int = 11, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def assert_masked_equals_extracted(model: HybridLM, arch: Architecture, depth_order=None, changes: bool = True):
    x = ids()
    masked = model(x, mask=hard_mask(model.config, arch, depth_order)).logits
    small = extract(model, arch, depth_order)
    got = small(x).logits
    assert (masked - got).abs().max().item() <= TOL, f"{arch.to_dict()}: max diff {(masked - got).abs().max()}"
    if changes:  # the mask really did something: the sub-model differs from the parent
        assert (masked - model(x).logits).abs().max().item() > 1e-3
    return small


# ---------------------------------------------------------------------- masked == extracted
def test_parent_logits_are_not_degenerate():
    logits = parent()(ids()).logits
    assert 0.5 < logits.std().item() < 50


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("axis", [a for a in SPACE.elastic_axes])
@pytest.mark.parametrize("choice", [1, 2])
def test_single_axis(variant, axis, choice):
    arch = Architecture(**{axis: SPACE.choices(axis)[choice]})
    small = assert_masked_equals_extracted(parent(variant), arch)
    assert small.num_parameters() < parent(variant).num_parameters()


def test_full_architecture_is_the_parent():
    arch = Architecture.largest_in(SPACE, parent().config)
    assert hard_mask(parent().config, arch).hidden is None
    small = assert_masked_equals_extracted(parent(), arch, changes=False)
    assert torch.equal(small(ids()).logits, parent()(ids()).logits)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(
    "arch",
    [
        dict(hidden=40, moe_ffn=16, experts=4),  # the reported family's axes
        dict(hidden=24, mamba_heads=2, attn_heads=4, mlp_ffn=16, moe_ffn=8, shared_ffn=8, experts=2),
        dict(mamba_heads=4, attn_heads=2, depth=5),
        dict(hidden=24, experts=2, depth=7),
    ],
)
def test_combinations(variant, arch):
    assert_masked_equals_extracted(parent(variant), Architecture(**arch))


def test_per_layer_overrides():
    arch = Architecture(
        hidden=40,
        moe_ffn=16,
        layers={0: {"mamba_heads": 2}, 3: {"mamba_heads": 4}, 1: {"attn_heads": 2}, 5: {"experts": 2, "moe_ffn": 8}},
    )
    small = assert_masked_equals_extracted(parent(), arch)
    assert small.model.layers[0].mixer.num_heads == 2 and small.model.layers[3].mixer.num_heads == 4
    assert small.model.layers[7].mixer.num_heads == 6  # no override: the global (full) choice
    assert small.model.layers[5].mixer.experts.up_proj.shape == (2, 8, 40)
    assert small.model.layers[2].mixer.experts.up_proj.shape == (6, 16, 40)
    assert [c.mamba_num_heads for c in layer_configs(parent().config, arch) if c.pattern == "M"] == [2, 4, 6]


@pytest.mark.parametrize("depth_order", [None, [2, 0, 5, 7, 1, 3, 4, 6], [4, 6, 1]])
def test_depth(depth_order):
    small = assert_masked_equals_extracted(parent(), Architecture(depth=5), depth_order)
    order = depth_order or [7, 6, 5]
    kept = [c for i, c in enumerate(CFG["pattern"]) if i not in order[:3]]
    assert small.config.pattern == "".join(kept)


# Derandomized with no example database: the same 30 architectures on every machine. Masked and
# sliced models round differently in float32 (norms over zero-padded vs sliced widths, dense vs
# sparse expert sums), so a free search would eventually find a draw just past the 1e-5 bound
# without any change to the code.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None)
@given(data=st.data())
def test_random_architectures(data):
    model = parent(data.draw(st.sampled_from(list(VARIANTS))))
    arch, order = draw_arch(data)
    assert_masked_equals_extracted(model, arch, order, changes=False)


def draw_arch(data) -> tuple[Architecture, list[int] | None]:
    """A random architecture of SPACE (some axes full, some per-layer overrides) and depth order."""
    fields = {a: data.draw(st.sampled_from([None, *SPACE.choices(a)])) for a in SPACE.elastic_axes}
    layers = {}
    for i, kind in enumerate(parent().config.layer_kinds):
        if data.draw(st.booleans()):
            axes = [a for a, k in LAYER_AXES.items() if k == kind]
            layers[i] = {a: data.draw(st.sampled_from(SPACE.choices(a))) for a in axes if data.draw(st.booleans())}
    order = data.draw(st.none() | st.permutations(range(len(CFG["pattern"]))))
    return Architecture(**fields, layers=layers), order


# ---------------------------------------------------------------------- decoding with caches
@pytest.mark.parametrize(
    "arch",
    [
        Architecture(hidden=24, mamba_heads=4, attn_heads=2, moe_ffn=8, experts=4, shared_ffn=24, mlp_ffn=16),
        Architecture(hidden=40, depth=7, layers={0: {"mamba_heads": 2}, 6: {"attn_heads": 4}}),
    ],
)
@torch.no_grad()
def test_decoding_with_cache(arch):
    model, order = parent("biased"), [3, 1, 0, 2, 4, 5, 6, 7]
    mask = hard_mask(model.config, arch, order)
    small = extract(model, arch, order)
    x = ids(seq=14)
    outs = {}
    for name, run in {"masked": lambda *a, **k: model(*a, mask=mask, **k), "extracted": small}.items():
        out = run(x[:, :6], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for t in range(6, x.shape[1]):
            out = run(x[:, t : t + 1], cache=cache)
            pieces.append(out.logits)
        outs[name] = torch.cat(pieces, 1)
    assert (outs["masked"] - outs["extracted"]).abs().max().item() <= TOL
    assert (outs["extracted"] - small(x).logits).abs().max().item() <= TOL


# ---------------------------------------------------------------------- soft masks
def one_hot(arch: Architecture) -> dict[str, torch.Tensor]:
    return {
        a: torch.nn.functional.one_hot(torch.tensor(SPACE.choices(a).index(getattr(arch, a))), 3).float()
        for a in SPACE.elastic_axes
        if getattr(arch, a) is not None
    }


@torch.no_grad()
def test_soft_one_hot_equals_hard():
    cfg = parent().config
    arch = Architecture(hidden=24, mamba_heads=4, attn_heads=2, mlp_ffn=32, moe_ffn=8, experts=4, depth=7)
    soft, hard = soft_mask(cfg, one_hot(arch), SPACE), hard_mask(cfg, arch)
    dense_soft, dense_hard = mask_as_dense(cfg, soft), mask_as_dense(cfg, hard)
    assert dense_soft.keys() == dense_hard.keys()
    for key in dense_hard:
        assert torch.equal(dense_soft[key], dense_hard[key]), key
    torch.testing.assert_close(parent()(ids(), mask=soft).logits, parent()(ids(), mask=hard).logits, atol=TOL, rtol=0)


@torch.no_grad()
def test_soft_per_layer_one_hot_equals_per_layer_arch():
    cfg = parent().config  # Mamba layers 0, 3, 7: choose 2, 4, 6 heads
    probs = {"mamba_heads": torch.eye(3)[[2, 1, 0]], "hidden": torch.tensor([0.0, 1.0, 0.0])}
    arch = Architecture(hidden=40, layers={0: {"mamba_heads": 2}, 3: {"mamba_heads": 4}})
    got = parent()(ids(), mask=soft_mask(cfg, probs, SPACE)).logits
    torch.testing.assert_close(got, extract(parent(), arch)(ids()).logits, atol=TOL, rtol=0)


def test_soft_mask_is_differentiable():
    cfg = parent().config
    logits = {a: torch.randn(3, requires_grad=True) for a in SPACE.elastic_axes}
    probs = {a: torch.softmax(v, -1) for a, v in logits.items()}
    out = parent()(ids(), mask=soft_mask(cfg, probs, SPACE)).logits
    out.square().mean().backward()
    for a, v in logits.items():
        assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0, a


def test_soft_mask_rejects_bad_probabilities():
    cfg = parent().config
    with pytest.raises(ValueError, match="hidden.*candidates \\[48, 40, 24\\]"):
        soft_mask(cfg, {"hidden": torch.ones(2) / 2}, SPACE)
    with pytest.raises(ValueError, match="3 mamba layers"):
        soft_mask(cfg, {"mamba_heads": torch.ones(2, 3) / 3}, SPACE)
    with pytest.raises(ValueError, match="per_layer=True"):
        soft_mask(cfg, {"experts": torch.ones(2, 3) / 3}, SPACE.model_copy(update={"per_layer": False}))


# ---------------------------------------------------------------------- checkpoints and views
@torch.no_grad()
def test_extracted_model_saves_and_reloads(tmp_path):
    arch = Architecture(hidden=24, mamba_heads=4, attn_heads=2, moe_ffn=8, experts=4, depth=7)
    small = extract(parent("biased"), arch)
    small.save_pretrained(tmp_path / "small")
    loaded = HybridLM.from_pretrained(tmp_path / "small")
    assert loaded.config.pattern == small.config.pattern
    assert torch.equal(loaded(ids()).logits, small(ids()).logits)


def test_per_layer_config_needs_opt_in():
    arch = Architecture(layers={0: {"mamba_heads": 2}})
    with pytest.raises(ValueError, match="mamba_num_heads"):
        extract_config(parent().config, arch)
    assert extract_config(parent().config, arch, allow_per_layer=True).mamba_num_heads == 6


@torch.no_grad()
def test_views_share_storage_where_prefixes():
    model = parent()
    arch = Architecture(hidden=40, mamba_heads=4, moe_ffn=16)
    small = extract(model, arch, view=True)
    emb = small.model.embeddings.weight
    assert emb.data_ptr() == model.model.embeddings.weight.data_ptr()
    # grouped Mamba heads are not a prefix: a copy
    assert small.model.layers[0].mixer.A_log.data_ptr() != model.model.layers[0].mixer.A_log.data_ptr()
    torch.testing.assert_close(small(ids()).logits, extract(model, arch)(ids()).logits, atol=0, rtol=0)


def test_extracted_config_sizes():
    cfg = extract_config(parent().config, Architecture(hidden=24, mamba_heads=4, attn_heads=2, experts=4, depth=7))
    assert (cfg.hidden_size, cfg.mamba_num_heads, cfg.num_attention_heads, cfg.n_routed_experts) == (24, 4, 2, 4)
    assert (cfg.n_groups, cfg.num_key_value_heads, cfg.mamba_d_inner) == (2, 2, 32)
    assert cfg.pattern == CFG["pattern"][:7]


# ---------------------------------------------------------------------- errors and (de)serialisation
@pytest.mark.parametrize(
    "arch, space, expected",
    [
        (dict(hidden=32), SPACE, r"hidden: 32 not allowed; allowed values \[48, 40, 24\]"),
        (dict(hidden=64), None, r"hidden: 64 not allowed; allowed values \[48, 47, \.\.\., 1\]"),
        (dict(mamba_heads=3), None, r"mamba_heads: 3 not allowed; allowed values \[6, 4, 2\]"),
        (dict(attn_heads=8), None, r"attn_heads: 8 not allowed; allowed values \[6, 4, 2\]"),
        (dict(experts=1), None, r"experts: 1 not allowed; allowed values \[6, 5, 4, 3, 2\]"),
        (dict(depth=9), None, r"depth: 9 not allowed"),
        (dict(layers={1: {"mamba_heads": 2}}), SPACE, r"layers\[1\]\.mamba_heads: layer 1 is a attention layer"),
        (dict(layers={9: {"experts": 2}}), None, r"layers: layer index 9 out of range; allowed 0\.\.7"),
        (dict(layers={2: {"experts": 3}}), SPACE, r"layers\[2\]\.experts: 3 not allowed; allowed values \[6, 4, 2\]"),
    ],
)
def test_bad_architectures_are_named(arch, space, expected):
    with pytest.raises(ValueError, match=expected):
        Architecture(**arch).validate(parent().config, space)
    with pytest.raises(ValueError, match=expected):
        extract(parent(), Architecture(**arch), space=space)


def test_per_layer_overrides_need_a_per_layer_space():
    space = SPACE.model_copy(update={"per_layer": False})
    with pytest.raises(ValueError, match="per_layer=True"):
        hard_mask(parent().config, Architecture(layers={0: {"mamba_heads": 2}}), space=space)


def test_bad_depth_orders_are_named():
    cfg = parent().config
    with pytest.raises(ValueError, match=r"depth_order: layer indices \[8\] out of range"):
        hard_mask(cfg, Architecture(depth=7), [8])
    with pytest.raises(ValueError, match="depth_order: repeated"):
        hard_mask(cfg, Architecture(depth=7), [1, 1])
    with pytest.raises(ValueError, match=r"depth: 5 drops 3 layers but depth_order lists only 2"):
        hard_mask(cfg, Architecture(depth=5), [1, 2])


def test_bad_spaces_are_named():
    cfg = parent().config
    with pytest.raises(ValueError, match="strictly descending"):
        ElasticSpace(hidden=[24, 48])
    with pytest.raises(ValueError, match="hiden"):
        ElasticSpace(hiden=[48])
    with pytest.raises(ValueError) as err:
        ElasticSpace(hidden=[40, 24], mamba_heads=[6, 3], experts=[6, 1]).validate_against(cfg)
    msg = str(err.value)
    assert "hidden: first candidate 40 must be the full size 48" in msg
    assert "mamba_heads: [3] not allowed; allowed values [6, 4, 2] (multiples of n_groups=2)" in msg
    assert "experts: [1] not allowed; allowed values [6, 5, 4, 3, 2] (at least num_experts_per_tok=2)" in msg
    with pytest.raises(ValueError, match="experts.*n_group=2"):
        ElasticSpace(experts=[6, 4]).validate_against(cfg.replace(n_group=2, topk_group=1))
    with pytest.raises(ValueError) as err:
        ElasticSpace(hidden=[48, 40], mamba_heads=[6, 4], mlp_ffn=[40, 32], nvfp4_aligned=True).validate_against(cfg)
    msg = str(err.value)
    assert "hidden: 40 gives 40 channels, not a multiple of 16" in msg
    assert "mamba_heads: 6 gives 24 channels per Mamba group" in msg
    assert "mlp_ffn: 40 gives 40 channels" in msg and "mlp_ffn: 32" not in msg


def test_architecture_dict_round_trip():
    import json

    arch = Architecture(hidden=40, experts=4, layers={3: {"mamba_heads": 2}})
    data = json.loads(json.dumps(arch.to_dict()))  # layer keys become strings in JSON
    assert data == {"hidden": 40, "experts": 4, "layers": {"3": {"mamba_heads": 2}}}
    assert Architecture.from_dict(data) == arch
    assert Architecture.from_dict({}).to_dict() == {}
    with pytest.raises(ValueError, match="widht"):
        Architecture.from_dict({"widht": 3})
