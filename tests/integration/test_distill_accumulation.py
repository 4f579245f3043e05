"""Gradient accumulation with a budget per micro-batch, on a real DeepSpeed engine (one rank, gloo, no Ray).

The engine built from :func:`deepspeed_config` with ``grad_accum_steps=2`` must leave the weights alone
after the first micro-batch and, after the second, hold exactly what a plain PyTorch AdamW step on the
mean of the two micro-batches' losses (each with its own budget) gives, clip included.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from components.data import TextTokenizer, build_demo_tokenizer, make_data_batch
from components.distill import DistillConfig
from components.distill.draws import draw_budget, router_generator
from components.distill.step import ElasticSpec, ElasticStudent, elastic_loss
from components.distill.worker import deepspeed_config, param_groups
from model.config import HybridConfig
from model.elastic.router import BudgetRouter
from model.hybrid import HybridLM
from tests.conftest import TINY

pytestmark = pytest.mark.integration


def test_one_update_mixes_the_budgets_of_its_micro_batches(single_process_group, tmp_path: Path):
    deepspeed = single_process_group
    tok = TextTokenizer(build_demo_tokenizer())
    tok_dir = tok.save(tmp_path / "tok")
    parent = HybridLM(HybridConfig(**{**TINY, "vocab_size": tok.vocab_size})).init_weights(0)
    parent_dir = parent.save_pretrained(tmp_path / "parent", extra_files={p.name: p for p in tok_dir.iterdir()})
    cfg = DistillConfig(
        teacher_uri=str(parent_dir),
        output_dir=str(tmp_path / "out"),
        space={"hidden": [32, 24, 16], "experts": [4, 3]},
        budgets=[{"name": "full", "fraction": 1.0}, {"name": "small", "total": 0.6, "active": 0.6}],
        data={"sources": [{"type": "generator", "max_steps": 3}]},
        micro_batch_size=2,
        grad_accum_steps=2,
        zero_stage=1,
        grad_clip=0.01,  # small enough to clip: the reference must clip the accumulated gradient the same way
    )
    teacher = HybridLM.from_pretrained(parent_dir).requires_grad_(False)
    budgets = cfg.budget_set
    spec = ElasticSpec.of(teacher.config, cfg.space, budgets, alpha=cfg.alpha)
    # step 6's two micro-batches draw different budgets (checked), so the update mixes them
    step = 6
    draws = [draw_budget(cfg.seed, 1, step, [0.5, 0.5], m) for m in range(2)]
    assert sorted(draws) == [0, 1]
    batches = [
        make_data_batch(cfg.data, tok, batch_size=2, seq_len=64, seed=0, phase="accum", step=2 * step + m)
        for m in range(2)
    ]

    def micro_loss(model, m: int) -> torch.Tensor:
        loss, *_ = elastic_loss(
            model, teacher, spec, batches[m].input_ids, batches[m].loss_mask, draws[m], (step, 10),
            router_generator(cfg.seed, 1, step, m, rank=0), hard=False,
        )  # fmt: skip
        return loss

    student = HybridLM.from_pretrained(parent_dir)
    model = ElasticStudent(student, BudgetRouter(teacher.config, cfg.space, budgets, cfg.router))
    reference = copy.deepcopy(model)
    engine = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(param_groups(model, cfg)), config=deepspeed_config(cfg, 1)
    )[0]
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.backward(micro_loss(engine, 0))
    engine.step()
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())  # no update yet
    engine.backward(micro_loss(engine, 1))
    engine.step()

    opt = torch.optim.AdamW(param_groups(reference, cfg))
    ((micro_loss(reference, 0) + micro_loss(reference, 1)) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
    assert norm > cfg.grad_clip
    opt.step()
    got = dict(engine.module.named_parameters())
    moved = 0
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name].detach(), p.detach(), atol=1e-6, rtol=1e-5, msg=name)
        moved += int(not torch.equal(p, before[name]))
    assert moved > 0
