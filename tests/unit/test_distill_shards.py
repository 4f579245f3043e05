"""Pieces of sharded distillation that need no process group: the checkpoint stream, partition slices, the
streamed safetensors writer, the pickle-free loader and the KD loss inside the trained module."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from components.distill import ckpt, zero3
from components.distill.worker import ElasticStudent
from model.checkpoint import CheckpointError
from model.config import HybridConfig
from model.elastic.budgets import BudgetSet
from model.elastic.router import BudgetRouter
from model.elastic.space import ElasticSpace
from model.hybrid import HybridLM
from tests.conftest import TINY


def _shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return zero3.full_shapes(HybridLM(config))


# ---------------------------------------------------------------------- streaming a checkpoint
def test_iter_canonical_matches_the_loader_for_every_layout(tmp_path: Path):
    config = HybridConfig(**TINY)
    model = HybridLM(config).init_weights(3)
    folder = model.save_pretrained(tmp_path / "hf", prefix="backbone", expert_layout="per_expert")
    reference = HybridLM.from_pretrained(folder).state_dict()
    got = dict(zero3.iter_canonical(folder, _shapes(config)))
    assert got.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(got[name], tensor), name
    as_bf16 = dict(zero3.iter_canonical(folder, _shapes(config), torch.bfloat16))
    assert as_bf16["lm_head.weight"].dtype == torch.bfloat16
    assert as_bf16["model.layers.3.mixer.gate.e_score_correction_bias"].dtype == torch.float32  # kept float32


def test_iter_canonical_ties_lm_head_and_names_what_is_missing(tmp_path: Path):
    config = HybridConfig(**TINY)
    folder = HybridLM(config).init_weights(1).save_pretrained(tmp_path / "m")
    (folder / "manifest.json").unlink()
    tensors = load_file(str(folder / "model.safetensors"))
    embedding = tensors["backbone.embeddings.weight"].clone()
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors \\['lm_head.weight'\\]"):
        list(zero3.iter_canonical(folder, _shapes(config)))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    got = dict(zero3.iter_canonical(folder, _shapes(config)))
    assert torch.equal(got["lm_head.weight"], embedding)


class _FakeZeroParam:
    """What :func:`zero3.load_into_partitions` reads of a ZeRO-3 parameter (rank 0 or 1 of 2)."""

    def __init__(self, shape: tuple[int, ...], rank: int) -> None:
        self.ds_id, self.ds_shape, self.ds_process_group, self.rank = 0, shape, None, rank
        self.ds_numel = int(torch.tensor(shape).prod())
        self.ds_tensor = torch.full((-(-self.ds_numel // 2),), -1.0)


def test_partition_slices_cover_the_tensor_with_zero_padding(monkeypatch):
    full = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # 15 elements over 2 ranks: 8 + 7 and one pad
    parts = []
    for rank in (0, 1):
        fake = _FakeZeroParam((3, 5), rank)
        monkeypatch.setattr(zero3.dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(zero3.dist, "get_rank", lambda group=None, r=rank: r)
        module = torch.nn.Module()
        monkeypatch.setattr(module, "named_parameters", lambda p=fake: iter([("w", p)]))
        assert zero3.load_into_partitions(module, [("w", full)]) == {"w"}
        parts.append(fake.ds_tensor)
    assert parts[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert parts[1].tolist() == [8, 9, 10, 11, 12, 13, 14, 0]


def test_load_into_partitions_refuses_unknown_names_and_shapes():
    module = torch.nn.Linear(3, 2, bias=False)
    with pytest.raises(KeyError, match="bias"):
        zero3.load_into_partitions(module, [("bias", torch.zeros(2))])
    with pytest.raises(ValueError, match="does not fit"):
        zero3.load_into_partitions(module, [("weight", torch.zeros(3, 2))])
    zero3.load_into_partitions(module, [("weight", torch.ones(2, 3))])
    assert torch.equal(module.weight.detach(), torch.ones(2, 3))


# ---------------------------------------------------------------------- writing and reading files
def test_streamed_safetensors_read_back_like_save_file(tmp_path: Path):
    from model.layout import write_weights

    tensors = {
        "b": torch.randn(3, 4).to(torch.bfloat16),
        "a": torch.randn(5),
        "idx": torch.tensor([3, 1, 2]),
        "flag": torch.tensor([True, False]),
    }
    entries = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    for order, folder in ((tensors.items(), "s"), (reversed(tensors.items()), "r")):  # any order: same file
        (tmp_path / folder).mkdir()
        write_weights(tmp_path / folder, entries, iter(list(order)))
        back = load_file(str(tmp_path / folder / "model.safetensors"))
        assert back.keys() == tensors.keys()
        for name, t in tensors.items():
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert (tmp_path / "s" / "model.safetensors").read_bytes() == (tmp_path / "r" / "model.safetensors").read_bytes()
    (tmp_path / "bad").mkdir()
    with pytest.raises(ValueError, match=r"b \(4, 3\) does not match its entry"):
        write_weights(tmp_path / "bad", entries, iter([("b", torch.zeros(4, 3, dtype=torch.bfloat16))]))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_safe_load_refuses_pickled_code(tmp_path: Path):
    torch.save({"ok": torch.ones(2), "evil": _RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        ckpt.safe_load(tmp_path / "evil.pt")
    torch.save({"ok": torch.ones(2), "n": 3, "s": "x"}, tmp_path / "plain.pt")
    assert ckpt.safe_load(tmp_path / "plain.pt")["n"] == 3


def test_each_rank_fetches_only_its_own_shards():
    files = [
        "state.json",
        "deepspeed/zero/zero_pp_rank_1_mp_rank_00_model_states.pt",
        "deepspeed/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "deepspeed/zero/bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt",
        "deepspeed/zero/mp_rank_00_model_states.pt",
        "deepspeed/zero/zero_to_fp32.py",
    ]
    assert [f for f in files if ckpt.rank_needs(f, 1)] == files[:3] + files[4:5]
    assert [f for f in files if ckpt.rank_needs(f, 12)] == [files[0], files[3], files[4]]
    assert [f for f in files if ckpt.consolidation_needs(f, 1)] == [files[0], files[1], files[4]]
    assert [f for f in files if ckpt.consolidation_needs(f, 3)] == files[:5]


# ---------------------------------------------------------------------- the loss inside the trained module
def test_chunked_kd_in_the_student_matches_the_reference_loss():
    config = HybridConfig(**TINY)
    space = ElasticSpace(hidden=[32, 24], experts=[4, 3])
    budgets = BudgetSet.of({"full": 1.0, "small": 0.7})
    teacher = HybridLM(config).init_weights(0).requires_grad_(False)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.rand(2, 24, generator=torch.Generator().manual_seed(1)) > 0.3
    hidden = teacher(ids, skip_logits=True).hidden
    results = []
    for chunk in (0, 7):
        torch.manual_seed(0)
        model = ElasticStudent(HybridLM(config).init_weights(1), BudgetRouter(config, space, budgets))
        gen = torch.Generator().manual_seed(5)
        kd, _ = model(ids, budgets.one_hot("small"), 3, 10, gen, False, hidden, teacher.lm_head.weight, mask, chunk)
        kd.backward()
        results.append((kd.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert got_grads.keys() == ref_grads.keys() and "student.lm_head.weight" in got_grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
