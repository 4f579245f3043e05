"""The rank stage's permutation task: its row-by-row logits check against a whole-batch reference, and the
resources the shipped configs give it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from components.rank import RankConfig, check_permutation
from components.stage_task import TaskResources
from model.config import HybridConfig
from model.elastic.permute import permute_hidden
from model.hybrid import HybridLM
from pipelines.config import load_pipeline_config
from pipelines.runner import PipelineRunner
from pipelines.stages import pipeline_stages
from tests.conftest import TINY

CONFIGS = Path(__file__).resolve().parents[2] / "pipelines" / "configs"


def _model() -> HybridLM:
    model = HybridLM(HybridConfig(**TINY)).init_weights(0)
    with torch.no_grad():  # norms away from 1 so a hidden permutation applied to half the model would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p, generator=torch.Generator().manual_seed(1)))
    return model


def _whole_batch_diff(model: HybridLM, ids: torch.Tensor, permute) -> tuple[float, float]:
    """The obvious check: the whole batch's logits before and after, compared at once."""
    with torch.no_grad():
        before = model(ids).logits.float()
        permute(model)
        after = model(ids).logits.float()
    return (after - before).abs().max().item(), max(1.0, before.abs().max().item())


IDS = torch.randint(0, TINY["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(2))


def test_a_true_permutation_passes_the_check():
    order = torch.randperm(TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    model = _model()
    diff, scale = check_permutation(model, IDS, lambda m: permute_hidden(m, order))
    assert diff <= 1e-5 and scale >= 1.0
    assert not torch.equal(model.model.embeddings.weight, _model().model.embeddings.weight)  # it did permute


def test_the_row_by_row_check_finds_what_the_whole_batch_check_finds():
    def slip(m: HybridLM) -> None:  # a permutation bug: one projection left out of a hidden permutation
        m.model.embeddings.weight.copy_(m.model.embeddings.weight[:, torch.arange(TINY["hidden_size"]).flip(0)])

    reference_model = _model()
    expected = _whole_batch_diff(reference_model, IDS, slip)
    got = check_permutation(_model(), IDS, slip)
    assert expected[0] > 0.1  # the slip changes the logits
    assert got == pytest.approx(expected, rel=1e-5)


def test_the_check_permutes_in_place_once():
    calls = []
    model = _model()
    snapshot = copy.deepcopy(model.state_dict())
    check_permutation(model, IDS, calls.append)
    assert calls == [model]
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())  # the check itself moves nothing


def test_rank_task_resources_default_to_the_demo_and_are_validated():
    config = RankConfig(parent_uri="p", output_dir="o")
    assert config.resources == TaskResources() and config.resources.describe() == "2 CPU"
    with pytest.raises(ValidationError, match="resources.num_gpu"):
        RankConfig(parent_uri="p", output_dir="o", resources={"num_gpu": 1})


def test_shipped_configs_size_the_rank_task(tmp_path):
    configs = {}
    for name in ("demo", "real"):
        cfg = load_pipeline_config(CONFIGS / f"{name}.yaml", [f"runs_dir={tmp_path}"])
        configs[name] = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir).build_configs()["rank"]
    assert configs["demo"].resources == TaskResources()  # `make run` on a 2-core laptop
    real = configs["real"].resources
    assert (real.num_cpus, real.num_gpus, real.memory_gib) == (8, 1, 96)  # the bf16 parent on one GPU
