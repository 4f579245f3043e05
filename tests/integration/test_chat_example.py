"""The shipped bring-your-own example end to end, in few steps: ``pipelines/configs/chat-example.yaml``.

Every input differs from the demo: a byte-level BPE tokenizer with a ChatML chat template, chat JSONL
rows with reasoning traces mixed 70 / 30 with plain-text rows, a JSONL evaluation set answered as
``\\boxed{}``, and a parent written by transformers' ``save_pretrained``. The whole pipeline runs on it
(real Ray, DeepSpeed workers, SQLite MLflow), then an extracted budget opens in transformers with
``AutoTokenizer`` + ``apply_chat_template``, and Ray Serve answers a multi-turn chat with a system
message rendered through the checkpoint's chat template.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[2] / "pipelines" / "configs" / "chat-example.yaml"
ASSETS = "runs/chat-example/assets"
FEW_STEPS = [
    "parent.train.steps=6",
    "parent.train.batch_size=8",
    "parent.train.eval.limit=8",
    "rank.calibration.num_samples=16",
    "rank.calibration.batch_size=8",
    "distill_phase1.steps=4",
    "distill_phase1.micro_batch_size=4",
    "distill_phase1.checkpoint_every=4",
    "distill_phase1.log_every=2",
    "distill_phase2.steps=2",
    "distill_phase2.micro_batch_size=2",
    "distill_phase2.checkpoint_every=2",
    "distill_phase2.log_every=1",
    "export.allow_off_target=true",
    "evaluate.eval_sets=[{path: ASSETS/eval.jsonl, group_by: level, limit: 8}]",
    "evaluate.think_caps=[0, null]",
    "evaluate.think_limit=12",
    "evaluate.max_answer_tokens=12",
    "quantize.formats=[fp8]",
    "quantize.calibration.num_batches=1",
    "register.gate.default_min_accuracy=0.0",
    "register.gate.max_regression=1.0",
]


@pytest.fixture(scope="module")
def example_run(tmp_path_factory, ray_runtime):
    """Assets made by ``star-elastic example chat``; the pipeline run on them; returns (run dir, assets)."""
    from pipelines.example_assets import make_chat_example
    from pipelines.run import run_pipeline

    root = tmp_path_factory.mktemp("chat-example")
    assets = root / "assets"
    info = make_chat_example(assets, n_chat=800, n_text=200, n_eval_per_level=4)
    assert info["vocab_size"] >= 1000  # a BPE vocabulary of at least 1k tokens
    config = root / "chat-example.yaml"
    config.write_text(CONFIG.read_text().replace(ASSETS, str(assets)))
    overrides = [o.replace("ASSETS", str(assets)) for o in FEW_STEPS]
    overrides += [f"runs_dir={root / 'runs'}", f"tracking_uri=sqlite:///{root / 'mlflow.db'}"]
    assert run_pipeline(str(config), overrides=overrides) == 0
    return root / "runs" / "chat-example", assets


def test_parent_is_a_transformers_checkpoint(example_run):
    run_dir, _ = example_run
    parent = run_dir / "parent" / "checkpoint"
    config = json.loads((parent / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert "transformers_version" in config  # written by transformers, not by this project's writer
    assert not (parent / "manifest.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (parent / name).is_file(), name


def test_every_stage_carries_the_tokenizer_files(example_run):
    run_dir, _ = example_run
    for folder in (
        run_dir / "rank" / "permuted",
        run_dir / "distill_phase2" / "student",
        run_dir / "export" / "nested",
    ):
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            assert (folder / name).is_file(), f"{folder}: {name}"


def test_extracted_budget_opens_in_transformers(example_run, tmp_path):
    from transformers import AutoTokenizer, NemotronHForCausalLM

    from model.elastic.export import extract_budget
    from model.hybrid import HybridLM

    run_dir, _ = example_run
    out = extract_budget(run_dir / "export" / "nested", "small", tmp_path / "small")
    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 1 + 2, modulo 10."}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n<think>") and "<|im_start|>system\nBe brief." in text
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    hf = NemotronHForCausalLM.from_pretrained(out).eval()
    ours = HybridLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max().item() < 1e-4


def test_evaluation_reads_the_jsonl_set(example_run):
    run_dir, _ = example_run
    results = json.loads((run_dir / "evaluate" / "results.json").read_text())
    assert "small" in json.dumps(results) and "full" in json.dumps(results)


def test_serve_answers_a_multi_turn_chat_through_the_template(example_run, serve_http):
    from ray import serve

    from components.data.tokenizer import TextTokenizer
    from components.serving.app import build_app

    run_dir, _ = example_run
    nested = run_dir / "export" / "nested"
    serve.run(build_app({"model_uri": str(nested)}), name="chat-example", route_prefix="/chat-example")
    url = f"http://127.0.0.1:{serve_http}/chat-example"
    deadline = time.time() + 90
    while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
        assert time.time() < deadline, "the app never became ready"
        time.sleep(0.5)
    messages = [
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": "Compute 3 + 4 from left to right, modulo 10."},
        {"role": "assistant", "content": "The answer is \\boxed{7}."},
        {"role": "user", "content": "Compute 7 * 3 from left to right, modulo 10."},
    ]
    body = {"model": "small", "messages": messages, "max_tokens": 8}
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["prompt_tokens"] == len(TextTokenizer.load(nested).prompt_ids(messages))
        text = (choice["message"].get("content") or "") + (choice["message"].get("reasoning_content") or "")
        assert "<|im_end|>" not in text and "<|im_start|>" not in text  # special tokens never leak
    finally:
        serve.delete("chat-example")
