"""Shared fixtures: tiny configs with every layer kind, built in memory."""

from __future__ import annotations

import pytest
import torch

from model.config import HybridConfig

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    pattern="M*ME-E",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=8,
    chunk_size=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
)


@pytest.fixture
def tiny_config() -> HybridConfig:
    return HybridConfig(**TINY)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield
