"""`star-elastic plan`: memory terms written out by hand for tiny configs, the fit verdict, time, JSON and MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from components.plan import (
    PhaseShape,
    PlanHardware,
    activation_bytes,
    layer_activation_bytes,
    log_plan,
    make_plan,
    plan_phase,
)
from components.plan_time import flops_per_token
from model.config import HybridConfig
from model.elastic.params import count_params

REPO = Path(__file__).resolve().parents[2]

# three dense-MLP blocks: embedding 10 x 4 = 40, lm_head 40, final norm 4; per block norm 4 + up 6 x 4 + down 4 x 6
MLP3 = HybridConfig(vocab_size=10, hidden_size=4, pattern="---", intermediate_size=6)
MLP3_PARAMS = 40 + 40 + 4 + 3 * (4 + 24 + 24)  # 240
BLOCK = 4 + 24 + 24  # 52 params: the largest layer (the vocabulary matrices have 40)


def _phase(stage: int, bf16: bool = True, **kw) -> PhaseShape:
    base = dict(name="p", steps=10, seq_len=8, micro_batch_size=2, num_workers=4, zero_stage=stage, bf16=bf16)
    return PhaseShape(**{**base, "kd_chunk_tokens": 4, "activation_checkpointing": True, **kw})


def _items(stage: int, bf16: bool = True, **kw) -> dict[str, float]:
    plan = plan_phase(MLP3, _phase(stage, bf16, **kw), PlanHardware())
    return {i.name: i.bytes for i in plan.items}


def test_parameter_count_of_the_tiny_config():
    assert count_params(MLP3).total == MLP3_PARAMS == 240


def test_zero0_replicates_everything():
    items = _items(0)
    assert items["teacher weights"] == 240 * 2
    assert items["student weights"] == 240 * 2
    assert items["student gradients"] == 240 * 2
    assert items["optimizer state"] == 240 * 12  # fp32 master + Adam m + v
    assert items["gradient all-reduce buffer"] == 240 * 2  # DeepSpeed's flattened copy of every gradient
    assert "teacher gathered layers" not in items and "student gathered layers" not in items


def test_each_zero_stage_partitions_one_more_term():
    z1, z2, z3 = _items(1), _items(2), _items(3)
    assert z1["optimizer state"] == 240 * 12 / 4 and z1["student gradients"] == 240 * 2
    assert z2["optimizer state"] == 240 * 12 / 4 and z2["student gradients"] == 240 * 2 / 4
    assert z2["student weights"] == 240 * 2 and z2["teacher weights"] == 240 * 2
    assert z3["student weights"] == 240 * 2 / 4 and z3["teacher weights"] == 240 * 2 / 4
    assert z3["teacher gathered layers"] == 2 * BLOCK * 2  # 2 live layers x 52 params x 2 bytes
    assert z3["student gathered layers"] == 3 * BLOCK * 2  # + one layer's gradient before the reduce-scatter
    assert all("gradient all-reduce buffer" not in z for z in (z1, z2, z3))


def test_float32_weights_have_no_master_copy():
    items = _items(1, bf16=False)
    assert items["student weights"] == 240 * 4 and items["student gradients"] == 240 * 4
    assert items["optimizer state"] == 240 * 8 / 4  # Adam m + v only


def test_activations_with_and_without_checkpointing():
    # per MLP block and token (bf16, soft masks): norm 4 + 2*4*2 + 2*4*2 (mixer output before / after the
    # mask) = 36, plus up output, activation and masked activation 3*6*2 = 36 -> 72; 16 tokens
    acts = activation_bytes(MLP3, tokens=16, seq_len=8, act_bytes=2, device="cuda")
    assert acts == {"inputs": 16 * 3 * 4 * 2, "blocks": 16 * 3 * 72, "largest_block": 16 * 72, "head": 16 * 20}
    with_ckpt = _items(0)["activations (checkpointed)"]
    assert with_ckpt == 384 + 2 * 1152 + 320
    without = _items(0, activation_checkpointing=False)["activations"]
    assert without == 384 + 3456 + 1152 + 320
    plan = plan_phase(MLP3, _phase(0), PlanHardware())
    assert plan.not_counted[0].name == "activations without checkpointing" and plan.not_counted[0].bytes == without


def test_kd_chunk_term():
    # chunk 4 x vocab 10 x (3 fp32 + bool + 2 bf16) = 680; lm_head grad fp32 + bf16 40 x 6 = 240;
    # teacher hidden + hidden grad 16 x 4 x 2 x 2 = 256; at ZeRO-3 both lm_heads gathered 2 x 40 x 2 = 160
    assert _items(0)["KD logits chunk"] == 680 + 240 + 256
    assert _items(3)["KD logits chunk"] == 680 + 240 + 256 + 160
    # the reference loss on full logits: 16 tokens x vocab 10 x (2 bf16 logits + 5 fp32) = 3840; lm_head grad
    # 40 x 2 = 80; hidden + hidden grad 256
    assert _items(0, kd_chunk_tokens=0)["KD logits chunk"] == 3840 + 80 + 256


def test_layer_activation_terms_by_hand():
    cfg = HybridConfig(
        vocab_size=16, hidden_size=32, pattern="*E", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
    )  # fmt: skip
    # attention, bf16, masked: norm 4 + 64*2 + 64*2 = 260; q x3 (q, output, masked copy) 3*32*2 = 192,
    # k, v 2*16*2 = 64; logsumexp 4 heads x 4 = 16
    assert layer_activation_bytes(cfg, "attention", 2, 64, "cuda") == 260 + 192 + 64 + 16
    assert layer_activation_bytes(cfg, "attention", 2, 64, "cuda", masked=False) == 132 + 128 + 64 + 16
    # moe, bf16, unmasked: norm 132; router 16 + 16 + 4 + 8; order/token 32, weights 8;
    # 2 * (3*2*32 + 2*2*16 + 2*24) = 2 * 304 = 608
    assert layer_activation_bytes(cfg, "moe", 2, 64, "cuda", masked=False) == 132 + 44 + 40 + 608
    with pytest.raises(ValueError, match="unknown layer kind"):
        layer_activation_bytes(cfg, "conv", 2, 64)


def _saved_bytes_per_token(model, ids, mask) -> float:
    """Bytes of the distinct storages autograd saves during one forward (parameters left out), per token."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, mask=mask, skip_logits=True)
    return sum(seen.values()) / ids.numel()


@pytest.mark.parametrize("masked", [False, True])
def test_activation_model_matches_what_autograd_keeps_on_cpu(masked):
    from model.elastic import ElasticSpace
    from model.elastic.build_masks import soft_mask
    from model.hybrid import HybridLM

    cfg = HybridConfig(
        vocab_size=64, hidden_size=96, pattern="M*ME-E", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=80, mamba_num_heads=16, mamba_head_dim=8, n_groups=4, ssm_state_size=32, chunk_size=64,
        n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=64, moe_shared_expert_intermediate_size=40,
    )  # fmt: skip
    space = ElasticSpace(
        hidden=[96, 64], mamba_heads=[16, 8], attn_heads=[4, 2], mlp_ffn=[80, 40], moe_ffn=[64, 32], experts=[8, 6]
    )
    model = HybridLM(cfg).init_weights(0).train()
    ids = torch.randint(0, 64, (2, 512), generator=torch.Generator().manual_seed(0))
    probs = {a: torch.softmax(torch.randn(2), -1).requires_grad_() for a in space.elastic_axes}
    measured = _saved_bytes_per_token(model, ids, soft_mask(cfg, probs, space) if masked else None)
    acts = activation_bytes(cfg, tokens=1024, seq_len=512, act_bytes=4, device="cpu", masked=masked)
    predicted = (acts["inputs"] + acts["blocks"] + acts["head"]) / 1024
    assert abs(predicted / measured - 1) < 0.1, (predicted, measured)


def test_verdict_names_the_largest_item_and_compares_with_device_memory():
    total = sum(_items(0).values())  # 4 x 480 + 2880 + 3008 + 1176 = 8984 bytes
    assert total == 4 * 480 + 2880 + 3008 + 1176 == 8984
    fits = plan_phase(MLP3, _phase(0), PlanHardware(gpu_mem_gb=total / 1e9))
    assert fits.fits and fits.total_bytes == total and fits.largest == "activations (checkpointed)"
    tight = plan_phase(MLP3, _phase(0), PlanHardware(gpu_mem_gb=(total - 1) / 1e9))
    assert not tight.fits
    assert plan_phase(MLP3, _phase(0, activation_checkpointing=False), PlanHardware()).largest == "activations"


def test_time_and_tokens():
    # matmul parameters one token uses: 240 - 40 (the embedding is a lookup) = 200; forward 2 x 200 = 400 FLOPs;
    # student forward + backward + recompute 4 x 400; teacher 400 -> 2000 per token
    assert flops_per_token(MLP3, 8, checkpointing=True) == {"teacher": 400, "student": 1600, "total": 2000}
    assert flops_per_token(MLP3, 8, checkpointing=False)["total"] == 400 + 3 * 400
    # 1000 FLOP/s peak, 500 sustained; 8e-7 Gb/s = 100 bytes/s between ranks
    hw = PlanHardware(gpus=4, peak_tflops=1e-9, utilization=0.5, interconnect_gbps=8e-7)
    plan = plan_phase(MLP3, _phase(3), hw)
    assert plan.tokens_per_step == 4 * 2 * 8 and plan.tokens == 10 * 64
    assert plan.compute_time_s == pytest.approx(2000 * 16 / 500)
    # ZeRO-3: teacher gather + student gather (forward, backward) + reduce-scatter, each 3/4 of 480 bytes
    assert plan.comm_bytes_per_step == pytest.approx(4 * 360)
    assert plan.comm_time_s == pytest.approx(14.4)
    assert plan.step_time_s == pytest.approx(64 + 14.4)
    assert plan.gpu_hours == pytest.approx(plan.hours * 4)
    # per optimizer step: ZeRO-0 / 1 all-reduce once (2 x 360), ZeRO-2 reduce-scatters every micro-step and
    # gathers the weights once, ZeRO-3 moves 4 x 360 every micro-step
    by_stage = [plan_phase(MLP3, _phase(s, grad_accum_steps=3), hw).comm_bytes_per_step for s in (0, 1, 2, 3)]
    assert by_stage == pytest.approx([720, 720, 4 * 360, 12 * 360])
    cfg = HybridConfig(
        vocab_size=10, hidden_size=4, pattern="*", num_attention_heads=2, num_key_value_heads=1, head_dim=2
    )
    # one attention layer at 8 tokens: 4 x (8 / 2) x 2 heads x 2 dims = 64 FLOPs beside the matmuls
    assert flops_per_token(cfg, 8, True)["teacher"] == 2 * (count_params(cfg).active - 40) + 64


def test_gpus_override_world_and_json_round_trip():
    plan = make_plan(MLP3, [_phase(3), _phase(3, name="q", seq_len=16)], PlanHardware(gpus=2))
    assert [p.world for p in plan.phases] == [2, 2]
    data = json.loads(json.dumps({**plan.model_dump(mode="json"), "fits": plan.fits}))
    assert data["phases"][0]["items"][0] == {
        "name": "teacher weights",
        "bytes": 240.0,
        "note": "240 params x 2 B / 2 ranks (frozen ZeRO-3 engine)",
    }


def test_log_plan_into_an_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    from components.tracking import make_tracker

    plan = make_plan(MLP3, [_phase(3)], PlanHardware())
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with make_tracker(uri, "plan-test", run_name="plan") as tracker:
        log_plan(plan, tracker)
    client = MlflowClient(tracking_uri=uri)
    metrics = client.get_run(tracker.run_id).data.metrics
    assert metrics["plan.p.optimizer_state_gb"] == pytest.approx(240 * 12 / 4 / 1e9)
    assert metrics["plan.fits"] == 1.0
    local = client.download_artifacts(tracker.run_id, "plan.json", str(tmp_path))
    assert json.loads(Path(local).read_text())["phases"][0]["name"] == "p"


def test_cli_plans_the_real_config_and_says_it_fits(capsys):
    from pipelines.cli import main

    assert main(["plan", str(REPO / "pipelines/configs/real.yaml"), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and [p["world"] for p in data["phases"]] == [64, 64]
    assert data["parent_config"].endswith("nemotron-nano-v3-bf16.json")
    assert data["total_params"] == 31_577_937_344
    # the same phases on 32 ranks of 40 GB do not fit, and the exit status says so
    assert main(["plan", str(REPO / "pipelines/configs/real.yaml"), "--gpus", "32", "--gpu-mem", "40"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_cli_reads_checkpointing_and_kd_chunk_from_each_phase(capsys):
    from pipelines.cli import main

    real = str(REPO / "pipelines/configs/real.yaml")

    def phases(*extra: str) -> tuple[int, list[dict]]:
        status = main(["plan", real, "--json", "-", *extra])
        return status, json.loads(capsys.readouterr().out)["phases"]

    def item(phase: dict, prefix: str) -> dict:
        return next(i for i in phase["items"] if i["name"].startswith(prefix))

    status, (p1, p2) = phases()
    assert status == 0
    assert item(p1, "activations")["name"] == item(p2, "activations")["name"] == "activations (checkpointed)"
    assert item(p1, "KD logits")["note"].startswith("1024 x 131,072 chunk")
    # phase 1 without checkpointing: its own setting, read from the config, and it no longer fits in 80 GB
    status, (p1, p2) = phases("--set", "distill_phase1.activation_checkpointing=false")
    assert status == 1
    assert item(p1, "activations")["name"] == "activations" and item(p1, "activations")["bytes"] > 70e9
    assert item(p2, "activations")["name"] == "activations (checkpointed)"
    status, (p1, _) = phases("--set", "distill_phase1.activation_checkpointing=false", "--checkpointing")
    assert status == 0 and item(p1, "activations")["name"] == "activations (checkpointed)"
    _, (_, p2) = phases("--set", "distill_phase2.kd_chunk_tokens=256")
    assert item(p2, "KD logits")["note"].startswith("256 x 131,072 chunk")
    # ZeRO-3 traffic per step: 4 micro-steps x 4 x 63/64 of the bf16 model (31,577,937,344 x 2 bytes), at the
    # stated interconnect
    _, (p1, _) = phases("--interconnect-gbps", "800")
    assert p1["comm_bytes_per_step"] == pytest.approx(16 * 63 / 64 * 31_577_937_344 * 2)
    assert p1["comm_time_s"] == pytest.approx(p1["comm_bytes_per_step"] / 100e9)
