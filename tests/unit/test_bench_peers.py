"""The peer benchmark's own logic: what llama.cpp can take, the widths and space of the benchmark's family,
and where two token sequences part. Nothing here builds or runs llama.cpp."""

from __future__ import annotations

import pytest

from benchmarks.peers_family import BUDGETS, PARENT, QUICK_BUDGETS, QUICK_PARENT, budget_widths, elastic_space
from benchmarks.peers_llamacpp import first_divergence, llama_cpp_problems
from model.config import HybridConfig
from model.elastic import Architecture


def _family(fields: dict, budgets: dict) -> tuple[HybridConfig, dict[str, Architecture]]:
    return HybridConfig(**fields), {name: Architecture(**kw) for name, kw in budgets.items()}


@pytest.mark.parametrize(("fields", "budgets"), [(PARENT, BUDGETS), (QUICK_PARENT, QUICK_BUDGETS)])
def test_the_benchmark_family_is_one_llama_cpp_takes(fields, budgets):
    config, archs = _family(fields, budgets)
    assert llama_cpp_problems(config, budget_widths(config, archs), nvfp4=True) == []
    space = elastic_space(config, archs)
    space.validate_against(config)  # every budget's size is a candidate, the full size first
    for arch in archs.values():
        for axis in space.elastic_axes:
            value = getattr(arch, axis)
            assert value is None or value in space.choices(axis)


def test_a_dense_layer_beside_experts_is_refused_with_the_reason():
    config, archs = _family(dict(PARENT, pattern="M*EMEM-E"), {"full": {}})
    problems = llama_cpp_problems(config, budget_widths(config, archs), nvfp4=False)
    assert len(problems) == 1
    assert "'M*EMEM-E'" in problems[0] and "'-'" in problems[0] and "nemotron-h.cpp" in problems[0]
    # a dense model (no experts) may have '-' layers
    dense, _ = _family(dict(PARENT, pattern="M*M-M-"), {"full": {}})
    assert llama_cpp_problems(dense, budget_widths(dense, archs), nvfp4=False) == []


def test_nvfp4_widths_must_fill_ggml_blocks_of_64():
    config, archs = _family(PARENT, {"full": {}, "odd": dict(hidden=656, moe_ffn=96, experts=6)})
    widths = budget_widths(config, archs)
    assert widths["odd"] == {"hidden": 656, "mamba_inner": 512, "moe_ffn": 96, "shared_ffn": 256}
    problems = llama_cpp_problems(config, widths, nvfp4=True)
    assert len(problems) == 1
    assert "'odd'" in problems[0] and "'hidden': 656" in problems[0] and "'moe_ffn': 96" in problems[0]
    assert "mamba_inner" not in problems[0]
    assert llama_cpp_problems(config, widths, nvfp4=False) == []  # float formats have no blocks
    attn = {"full": {"attention": 12 * 64}, "half": {"attention": 6 * 40}}
    assert llama_cpp_problems(config, attn, nvfp4=True) == []  # attention stays dense by default
    assert "'half'" in llama_cpp_problems(config, attn, nvfp4=True, quantized_attention=True)[0]


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([4, 2, 3], [1, 2, 3]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2
