"""Fixtures shared by the integration tests: one local Ray runtime for the whole session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_runtime():
    """A local Ray runtime with 2 CPUs, started once per session (reused if one is already up).

    Starting Ray costs tens of seconds here, so every integration test that needs Ray shares it.
    Ray Train V2 runs a 2-worker job on these 2 CPUs.

    Ray's processes inherit this environment. The AWS C++ SDK inside pyarrow (Ray Train's storage
    layer) sends checksummed aws-chunked uploads by default, which the S3 test server (SeaweedFS)
    rejects; ``when_required`` turns that off for checkpoints written to ``s3://`` storage.
    """
    import os

    import ray

    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
        ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    if started:
        ray.shutdown()


# ---------------------------------------------------------------------- serving
def build_tiny_nested_checkpoint(out_dir, seed: int = 0):
    """A tiny random nested checkpoint with three hand-chosen budgets and the demo character tokenizer.

    Returns the checkpoint folder. Budgets (largest first): ``full``; ``medium`` (hidden, expert
    width and expert count shrink); ``small`` (also Mamba heads and the shared expert).
    """
    from pathlib import Path

    from components.data.tokenizer import TextTokenizer, build_demo_tokenizer
    from model.config import HybridConfig
    from model.elastic import Architecture, ElasticSpace, count_params
    from model.elastic.budgets import BudgetSet
    from model.elastic.export import export_nested
    from model.hybrid import HybridLM
    from model.layout import tokenizer_files

    out = Path(out_dir)
    tok = TextTokenizer(build_demo_tokenizer())
    cfg = HybridConfig(
        vocab_size=tok.vocab_size, hidden_size=32, pattern="M*ME-E", num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
        chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=32,
    )  # fmt: skip
    space = ElasticSpace(hidden=[32, 24, 16], mamba_heads=[4, 2], moe_ffn=[16, 8], experts=[4, 3], shared_ffn=[32, 16])
    archs = {
        "full": Architecture(),
        "medium": Architecture(hidden=24, moe_ffn=8, experts=3),
        "small": Architecture(hidden=16, mamba_heads=2, moe_ffn=8, experts=3, shared_ffn=16),
    }
    model = HybridLM(cfg).init_weights(seed).eval()
    full = count_params(cfg).active
    budgets = BudgetSet.of({n: round(count_params(cfg, a).active / full, 4) for n, a in archs.items()})
    files = tokenizer_files(tok.save(out / "tokenizer"))  # tokenizer.json, its config, the chat template
    return export_nested(model, archs, budgets, space, out / "nested", extra_files=files)


@pytest.fixture(scope="session")
def tiny_nested_checkpoint(tmp_path_factory):
    """Folder of a tiny random nested checkpoint (see :func:`build_tiny_nested_checkpoint`)."""
    return build_tiny_nested_checkpoint(tmp_path_factory.mktemp("serving-ckpt"))


@pytest.fixture(scope="session")
def serve_http(ray_runtime):
    """Ray Serve started once on a free 127.0.0.1 port; yields the port. Apps are added per module."""
    from ray import serve

    from tests.conftest import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


# ---------------------------------------------------------------------- DeepSpeed outside Ray
@pytest.fixture(scope="module")
def single_process_group():
    """A one-rank gloo process group in this process, for DeepSpeed engines outside Ray."""
    import os

    import torch.distributed as dist

    from tests.conftest import free_port

    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    yield deepspeed
    if created:  # leave no process group behind for later tests in this session, nor DeepSpeed's copies of it
        deepspeed.comm.destroy_process_group()
