"""Elastic distillation on real Ray Train: 2 CPU workers, gloo, DeepSpeed ZeRO-3 / ZeRO-0 / ZeRO-1, MLflow on SQLite.

One tiny random parent (with the tokenizer beside it) serves every test. Starting a Ray Train fit
costs tens of seconds here, so phase 1 runs ONCE at ZeRO-3 (sharded teacher and student, per-rank
checkpoint shards, chunked KD loss, activation checkpointing), with a worker crash injected mid-run,
and the tests read it: (a) the run finished and recorded KD losses, sharded checkpoints and MLflow
params/metrics, and its consolidated output equals DeepSpeed's own reading of the shards; (c) it
resumed from its last checkpoint with a continuous step counter; (d) the same 8 steps at ZeRO-0
(replicated, reference KD loss on full logits, no crash) give the same losses and outputs; and (b)
phase 2 starts from its output at ZeRO-1 (while a phase-2 config without ``init_from`` fails before
any worker starts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

import components.distill.stage as stage
from components.data import TextTokenizer, make_data_batch
from components.distill import DistillConfig, ckpt, run_distill, run_export
from components.tracking import MlflowTracker
from model.checkpoint import read_tensors, to_canonical
from model.elastic.export import read_elastic
from model.hybrid import HybridLM
from tests.helpers import save_tiny_parent
from tests.integration import distill_faults

pytestmark = pytest.mark.integration

BUDGETS = [{"name": "full", "fraction": 1.0}, {"name": "mid", "fraction": 0.75}, {"name": "small", "fraction": 0.55}]
SPACE = {"hidden": [32, 24, 16], "mamba_heads": [4, 2], "moe_ffn": [16, 8], "experts": [4, 3]}


@pytest.fixture(scope="module")
def parent_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny parent (every layer kind) with the character tokenizer beside it."""
    return save_tiny_parent(tmp_path_factory.mktemp("parent"))


def base_config(parent: Path, out: Path, **changes) -> dict:
    """A few-step phase-1 config for 2 CPU workers at ZeRO-1."""
    cfg = {
        "teacher_uri": str(parent),
        "output_dir": str(out),
        "space": SPACE,
        "budgets": BUDGETS,
        "data": {"sources": [{"type": "generator", "max_steps": 3}]},
        "steps": 6,
        "micro_batch_size": 4,
        "seq_len": 64,
        "checkpoint_every": 3,
        "log_every": 1,
        "num_workers": 2,
        "zero_stage": 1,
    }
    cfg.update(changes)
    return cfg


@pytest.fixture(scope="module")
def phase1(ray_runtime, parent_dir, tmp_path_factory):
    """Phase 1 at ZeRO-3, run once: (outputs, config, MLflow tracking URI, run id).

    8 steps with checkpoints after steps 3, 6 and 8; the last rank kills its own process at step
    index 4 (after 4 steps), once (:func:`distill_faults.exit_last_rank_once`, the config's step callback);
    ``max_failures=1`` lets Ray Train restart the worker group. The KD
    loss runs in chunks of 100 tokens (256 per rank: three chunks, the last one short).
    """
    root = tmp_path_factory.mktemp("phase1")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    tracker = MlflowTracker(uri, "distill-test", run_name="phase1")
    changes = dict(steps=8, step_callback=distill_faults.CALLBACK, max_failures=1, zero_stage=3, kd_chunk_tokens=100)
    cfg = DistillConfig(**base_config(parent_dir, root / "out", activation_checkpointing=True, **changes))
    out = run_distill(cfg, tracker)
    tracker.finish()
    return out, cfg, uri, tracker.run_id


@pytest.fixture(scope="module")
def phase1_zero0(ray_runtime, parent_dir, tmp_path_factory):
    """The same 8 steps at ZeRO-0 (teacher and student replicated), the reference KD loss, no crash."""
    root = tmp_path_factory.mktemp("phase1-zero0")
    cfg = DistillConfig(**base_config(parent_dir, root / "out", steps=8, zero_stage=0, kd_chunk_tokens=0))
    return run_distill(cfg), cfg


def test_phase1_records_kd_and_writes_checkpoint(phase1, parent_dir):
    out, cfg, uri, run_id = phase1
    folder = Path(out.checkpoint_uri)
    # the output folder: student (nemotron_h), router, tokenizer, summary, history
    student = HybridLM.from_pretrained(folder)
    assert student.config == HybridLM.from_pretrained(parent_dir).config
    assert TextTokenizer.load(folder).vocab_size <= student.config.vocab_size
    assert (folder / "chat_template.jinja").is_file()  # the chat template travels with the student
    assert set(load_file(str(folder / "router.safetensors")))
    summary = json.loads((folder / "distill.json").read_text())
    assert set(summary["architectures"]) == {"full", "mid", "small"}
    assert summary["budget_probs"] == pytest.approx([1 / 3] * 3)
    history = json.loads((folder / "history.json").read_text())
    assert [r["step"] for r in history] == list(range(1, cfg.steps + 1))
    assert all(r["kd"] >= 0 and r["tokens_per_s"] > 0 for r in history)
    assert out.metrics["steps"] == cfg.steps
    # the Ray checkpoint: state and each rank's own DeepSpeed shard, readable without pickles
    ray_ckpt = Path(out.ray_checkpoint)
    assert json.loads((ray_ckpt / "state.json").read_text())["next_step"] == cfg.steps
    shards = ray_ckpt / "deepspeed" / "zero"
    n_params = sum(v.numel() for f in ("model", "router") for v in load_file(str(folder / f"{f}.safetensors")).values())
    held = 0
    for rank in (0, 1):
        optim = ckpt.safe_load(shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert optim["zero_stage"] == 3 and optim["partition_count"] == 2
        assert optim["optimizer_state_dict"]["state"]  # Adam moments of this rank's partition
        held += sum(g.numel() for g in optim["fp32_flat_groups"])
        module = ckpt.safe_load(shards / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")["module"]
        assert all(v.numel() == 0 for k, v in module.items() if k.endswith(".weight"))  # no weights in full
    assert n_params - 8 <= held <= n_params + 1000  # two partitions: every weight once (+ padding; not the 8 buffers)
    # the consolidated output equals DeepSpeed's own reading of the shards (float32 training: exactly)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    reference = get_fp32_state_dict_from_zero_checkpoint(str(ray_ckpt / "deepspeed"), tag="zero")
    written = to_canonical(read_tensors(folder))  # published layout read back under the module's names
    router = load_file(str(folder / "router.safetensors"))
    assert set(reference) == {f"student.{k}" for k in written} | {f"router.{k}" for k in router}
    for name, tensor in written.items():
        assert torch.equal(tensor, reference[f"student.{name}"]), name
    for name, tensor in router.items():
        assert torch.equal(tensor, reference[f"router.{name}"]), name
    # MLflow: the config as params (once, by rank 0) and per-step metrics
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.params["distill.phase"] == "1"
    assert json.loads(run.data.params["distill.budgets"])[0]["name"] == "full"
    metrics = run.data.metrics
    for key in ("kd", "budget_loss", "tau", "scale", "tokens_per_s", "router/small/hidden/p0"):
        assert key in metrics, key
    assert any(k.startswith("kd/") for k in metrics)
    assert metrics["params/full/expected_active"] > metrics["params/small/expected_active"]
    assert sorted({m.step for m in client.get_metric_history(run_id, "kd")}) == list(range(1, cfg.steps + 1))


def test_worker_crash_resumes_from_last_checkpoint(phase1):
    out, cfg, uri, run_id = phase1
    assert out.metrics["attempts"] == 2  # one crash, one restart
    history = json.loads((Path(out.checkpoint_uri) / "history.json").read_text())
    assert [r["step"] for r in history] == list(range(1, cfg.steps + 1))  # continuous: nothing repeated or lost
    assert [r["attempt"] for r in history] == [0, 0, 0, 1, 1, 1, 1, 1]  # resumed after the step-3 checkpoint
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    assert [m.value for m in client.get_metric_history(run_id, "resume/from_step")] == [3.0]
    kd_steps = [m.step for m in client.get_metric_history(run_id, "kd")]
    assert all(kd_steps.count(s) == 1 for s in (1, 2, 3))  # the retry did not start again from step 0


def test_zero0_and_zero3_runs_agree(phase1, phase1_zero0, tmp_path):
    """ZeRO-3 (sharded, chunked KD, activation checkpointing, one crash and resume) and ZeRO-0 (replicated,
    reference KD on full logits) train the same 8 steps: same losses, same outputs, same nested checkpoint."""
    out3, _, _, _ = phase1
    out0, _ = phase1_zero0
    h3 = json.loads((Path(out3.checkpoint_uri) / "history.json").read_text())
    h0 = json.loads((Path(out0.checkpoint_uri) / "history.json").read_text())
    assert [r["step"] for r in h3] == [r["step"] for r in h0] == list(range(1, 9))
    for r3, r0 in zip(h3, h0, strict=True):
        assert r3["kd"] == pytest.approx(r0["kd"], rel=1e-4, abs=1e-6), (r3["step"], r3["kd"], r0["kd"])
        assert r3["budget_loss"] == pytest.approx(r0["budget_loss"], rel=1e-4, abs=1e-6)
    for name in ("model.safetensors", "router.safetensors"):
        w3 = load_file(str(Path(out3.checkpoint_uri) / name))
        w0 = load_file(str(Path(out0.checkpoint_uri) / name))
        assert w3.keys() == w0.keys()
        for key in w0:
            torch.testing.assert_close(w3[key], w0[key], rtol=1e-3, atol=2e-5, msg=f"{name} {key}")
    nested3 = run_export(out3.checkpoint_uri, tmp_path / "n3", allow_off_target=True)
    nested0 = run_export(out0.checkpoint_uri, tmp_path / "n0", allow_off_target=True)
    assert (
        json.loads((nested3 / "config.json").read_text())["elastic"]
        == json.loads((nested0 / "config.json").read_text())["elastic"]
    )
    n3, n0 = load_file(str(nested3 / "model.safetensors")), load_file(str(nested0 / "model.safetensors"))
    assert n3.keys() == n0.keys()
    for key in n0:
        torch.testing.assert_close(n3[key], n0[key], rtol=1e-3, atol=2e-5, msg=key)


def test_phase2_without_init_from_fails_before_workers(parent_dir, tmp_path, monkeypatch):
    def no_trainer(config):  # any attempt to start Ray Train is a failure of this test
        raise AssertionError("a worker was about to start")

    monkeypatch.setattr(stage, "build_trainer", no_trainer)
    with pytest.raises(ValidationError, match="phase 2 needs init_from"):
        DistillConfig(**base_config(parent_dir, tmp_path / "p2", phase=2))
    missing = DistillConfig(**base_config(parent_dir, tmp_path / "p2", phase=2, init_from=str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="init_from"):
        run_distill(missing)
    with pytest.raises(FileNotFoundError, match="not a distillation output"):
        bad = DistillConfig(**base_config(parent_dir, tmp_path / "p2", phase=2, init_from=str(tmp_path)))
        run_distill(bad)
    with pytest.raises(ValidationError, match="budget_probs has 2 entries"):
        DistillConfig(**base_config(parent_dir, tmp_path / "p2", budget_probs=[0.5, 0.5]))


def test_phase2_starts_from_phase1_and_exports(phase1, parent_dir, tmp_path, s3_server):
    p1, _, _, _ = phase1
    # near-zero learning rates: the phase-2 result must then equal its initialisation, phase 1's output;
    # Ray Train keeps this phase's checkpoints in the S3 test server
    cfg = DistillConfig(
        **base_config(
            parent_dir,
            tmp_path / "p2",
            phase=2,
            init_from=p1.checkpoint_uri,
            seq_len=128,
            steps=3,
            lr=1e-12,
            router_lr=1e-12,
            storage_path="s3://test-bucket/distill",
        )
    )
    assert cfg.sampling_probs == [0.5, 0.3, 0.2]
    out = run_distill(cfg)
    assert out.ray_checkpoint.startswith("test-bucket/distill/distill-phase2-")
    assert out.ray_checkpoint.endswith("/step_00000003")
    teacher = load_file(str(parent_dir / "model.safetensors"))
    first = load_file(str(Path(p1.checkpoint_uri) / "model.safetensors"))
    second = load_file(str(Path(out.checkpoint_uri) / "model.safetensors"))
    moved = max((first[k] - teacher[k]).abs().max().item() for k in teacher)
    drift = max((second[k] - first[k]).abs().max().item() for k in teacher)
    assert moved > 1e-4 and drift < 1e-6, (moved, drift)
    r1 = load_file(str(Path(p1.checkpoint_uri) / "router.safetensors"))
    r2 = load_file(str(Path(out.checkpoint_uri) / "router.safetensors"))
    assert all(torch.allclose(r1[k], r2[k], atol=1e-6) for k in r1)
    # the ONE nested checkpoint from the phase-2 output
    nested = run_export(out.checkpoint_uri, tmp_path / "nested", allow_off_target=True)
    info = read_elastic(nested)
    assert [b.name for b in info.budgets] == ["full", "mid", "small"]
    assert info.budgets[0].active_params >= info.budgets[-1].active_params
    assert (nested / "tokenizer.json").exists()


def test_checkpoint_round_trip_resumes_exactly(single_process_group, parent_dir, tmp_path):
    """ZeRO-3 + bf16 (the Ray tests cover float32): save after 2 steps in DeepSpeed's format, rebuild fresh
    engines from the parent, load the shard, and the next steps' losses match exactly (the float32 master
    weights and moments come back, not just the bf16 weights). The consolidated weights are the bf16
    weights the engine trains, and DeepSpeed's float32 masters rounded to bf16. One rank; no Ray."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from components.distill import zero3
    from components.distill.draws import router_generator
    from components.distill.step import ElasticSpec, elastic_loss
    from components.distill.worker import build_engine, build_student, build_teacher
    from model.checkpoint import read_config

    cfg = DistillConfig(**base_config(parent_dir, tmp_path / "o", zero_stage=3, bf16=True, micro_batch_size=2))
    config = read_config(parent_dir)[0]
    cpu = torch.device("cpu")
    teacher = build_teacher(cfg, parent_dir, config, cpu, 1)
    assert zero3.is_partitioned(teacher.module.lm_head.weight)  # the teacher is its own ZeRO-3 engine
    tok = TextTokenizer.load(parent_dir)
    spec = ElasticSpec.of(config, cfg.space, cfg.budget_set, kd_chunk_tokens=16)

    def engine():
        return build_engine(cfg, build_student(cfg, config, parent_dir, cpu, 1), 1, config)[0]

    def step(eng, i: int) -> float:
        batch = make_data_batch(cfg.data, tok, batch_size=2, seq_len=32, seed=0, phase="resume", step=i)
        loss, *_ = elastic_loss(
            eng, teacher, spec, batch.input_ids, batch.loss_mask, i % 3, (i, 8), router_generator(0, 1, i)
        )
        eng.backward(loss)
        eng.step()
        return loss.item()

    first = engine()
    assert zero3.is_partitioned(first.module.student.lm_head.weight)
    for i in range(2):
        step(first, i)
    folder = tmp_path / "ck"
    ckpt.save_checkpoint(first, folder, 0, ckpt.TrainState(next_step=2, world_size=1, zero_stage=3))
    second = engine()
    with pytest.raises(ValueError, match="num_workers=1 and zero_stage=3"):
        ckpt.load_checkpoint(second, folder, 2, 3)
    assert ckpt.load_checkpoint(second, folder, 1, 3).next_step == 2
    (tmp_path / "w").mkdir()
    ckpt.consolidate(folder, tmp_path / "w", tmp_path / "r.safetensors", torch.bfloat16)
    written = to_canonical(read_tensors(tmp_path / "w"))
    reference = get_fp32_state_dict_from_zero_checkpoint(str(folder / "deepspeed"), tag="zero")
    with zero3.gathered(list(first.module.parameters())):
        live = {k: v.detach().clone() for k, v in first.module.student.state_dict().items()}
    assert written.keys() == live.keys()
    for name, tensor in written.items():
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16  # as the loader keeps it
        assert tensor.dtype == want and torch.equal(tensor, live[name].to(want)), name
        assert torch.equal(tensor, reference[f"student.{name}"].to(want)), name
    expected = [step(first, i) for i in range(2, 5)]
    assert [step(second, i) for i in range(2, 5)] == expected
