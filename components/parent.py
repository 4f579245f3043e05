"""Train a small parent from scratch: the demo's, or one on any tokenizer and data mixture.

The parent has every nemotron_h layer kind (Mamba2, attention, MoE, dense MLP) and trains on 2 CPU
cores in minutes. One path for every parent: an ``AutoTokenizer``, rows from the ``data`` mixture
through the chat template, accuracy on an evaluation set; ``writer: transformers`` saves with
``NemotronHForCausalLM.save_pretrained``.

Design notes: docs/stages.md ("The parent").
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from components.data import (
    DataConfig,
    GeneratorSource,
    ReasoningMarkers,
    TextTokenizer,
    build_demo_tokenizer,
    held_out_prompts,
    make_data_batch,
)
from components.data.answers import AnswerFormat
from components.eval_sets import EvalItem, EvalSetConfig, builtin_items, load_eval_set
from components.lm_eval import task_accuracy
from components.progress import progress_bar
from components.tracking import NullTracker, Tracker
from model.config import HybridConfig
from model.hybrid import HybridLM

DEMO_PARENT_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "pattern": "M*EMEM-E",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "chunk_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 64,
}
"""Architecture of the demo parent (vocab size comes from the tokenizer)."""


class ParentTrainConfig(BaseModel):
    """How a parent is built and trained (the demo's by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # resolved once, then only read

    output_dir: str = Field("runs/demo-parent/parent", description="Where the parent checkpoint is written.")
    architecture: dict[str, Any] = Field(
        default_factory=lambda: dict(DEMO_PARENT_ARCH), description="nemotron_h fields of the parent."
    )
    tokenizer: str | None = Field(
        None,
        description="Folder (or s3:// URI) with the tokenizer files (tokenizer.json, tokenizer_config.json, chat "
        "template, generation_config.json); null: the demo's character tokenizer.",
    )
    markers: ReasoningMarkers = Field(default_factory=ReasoningMarkers, description="Reasoning markers.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training mixture (default: the generator).")
    eval: EvalSetConfig | None = Field(
        None,
        description="Evaluation set (JSONL); null: the generator's held-out levels (eval_levels x eval_per_level).",
    )
    max_new_tokens: int = Field(96, ge=1, description="Thinking + answer tokens per evaluated problem.")
    writer: Literal["native", "transformers"] = Field(
        "native",
        description="Who writes the checkpoint: this project's writer, or transformers' "
        "NemotronHForCausalLM.save_pretrained (as a published checkpoint is written).",
    )
    steps: int = Field(900, ge=1, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Sequences per step.")
    seq_len: int = Field(64, ge=8, description="Tokens per sequence (one problem per row).")
    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    min_lr_ratio: float = Field(0.05, ge=0, le=1, description="Final lr as a fraction of the peak (cosine).")
    warmup_steps: int = Field(40, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    seed: int = Field(0, description="Seed of the weights and of the data stream.")
    threads: int = Field(2, ge=1, description="torch CPU threads.")
    eval_levels: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6], description="Steps per eval level.")
    eval_per_level: int = Field(50, ge=1, description="Held-out problems per level.")
    log_every: int = Field(25, ge=1, description="Steps between logged metrics.")
    balance_rate: float = Field(
        0.0,
        ge=0,
        description="Aux-loss-free load balancing: per step, e_score_correction_bias moves by this much towards "
        "under-loaded experts (0: off, as for the shipped demo parent).",
    )


class LoadBalancer:
    """Aux-loss-free MoE load balancing through ``e_score_correction_bias`` (selection-only bias).

    Each step counts the tokens routed to every expert of every MoE layer and nudges the
    bias of under-loaded experts up and of over-loaded ones down by ``rate`` (sign update).
    The bias only changes which experts are selected, never the gate weights, so the
    balancing costs no gradient interference. Without it a small MoE collapses onto a few
    experts, which makes expert importance a mere proxy of routing frequency.
    """

    def __init__(self, model: HybridLM, rate: float) -> None:
        from model.moe import MoE

        self.rate = rate
        self.layers = [b.mixer for b in model.model.layers if isinstance(b.mixer, MoE)]
        self.counts = [torch.zeros(m.gate.num_experts) for m in self.layers]
        for i, moe in enumerate(self.layers):
            moe.observer = self._observer(i)

    def _observer(self, i: int):
        def record(idx: torch.Tensor, weights: torch.Tensor, norms: torch.Tensor) -> None:
            self.counts[i] += torch.bincount(idx.reshape(-1), minlength=self.counts[i].numel()).float()

        return record

    @torch.no_grad()
    def step(self) -> float:
        """Apply the update; returns the worst max/mean load ratio over layers (1.0 = balanced)."""
        worst = 1.0
        for moe, c in zip(self.layers, self.counts, strict=True):
            if c.sum() > 0:
                worst = max(worst, (c.max() / c.mean()).item())
                moe.gate.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            c.zero_()
        return worst

    def detach(self) -> None:
        for moe in self.layers:
            moe.observer = None


def lr_at(step: int, cfg: ParentTrainConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def masked_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on positions whose next token is a target.

    logits (b, l, V), input_ids (b, l), loss_mask (b, l) bool: True where position t predicts token t+1.
    """
    pred = logits[:, :-1]
    tgt = input_ids[:, 1:]
    m = loss_mask[:, :-1]
    return F.cross_entropy(pred[m], tgt[m])


def evaluate_parent(
    model: HybridLM, tok: TextTokenizer, sets: dict[str, list[EvalItem]], max_new_tokens: int = 96
) -> dict[str, float]:
    """Accuracy per set label with full thinking and answering directly (``acc_think_L1`` for level 1)."""
    out: dict[str, float] = {}
    model.eval()
    for label, items in sets.items():
        key = f"L{label}" if label.isdigit() else label
        out[f"acc_think_{key}"] = task_accuracy(model, tok, items, think=True, max_new_tokens=max_new_tokens).accuracy
        out[f"acc_direct_{key}"] = task_accuracy(model, tok, items, think=False, max_new_tokens=max_new_tokens).accuracy
    n = len(sets)
    out["acc_think"] = sum(v for k, v in out.items() if k.startswith("acc_think_")) / n
    out["acc_direct"] = sum(v for k, v in out.items() if k.startswith("acc_direct_")) / n
    return out


def load_parent_tokenizer(cfg: ParentTrainConfig) -> TextTokenizer:
    """The configured tokenizer, or the demo's character tokenizer written to a temporary folder and
    loaded through the same ``AutoTokenizer`` path."""
    from components.storage import materialize

    if cfg.tokenizer is not None:
        return TextTokenizer.load(materialize(cfg.tokenizer), cfg.markers)
    with tempfile.TemporaryDirectory() as tmp:
        build_demo_tokenizer().save_pretrained(tmp)
        return TextTokenizer.load(tmp, cfg.markers)


def eval_items(cfg: ParentTrainConfig) -> dict[str, list[EvalItem]]:
    """Label -> evaluation items: the configured JSONL set, or the generator's held-out levels."""
    if cfg.eval is None:
        return builtin_items(cfg.eval_levels, cfg.eval_per_level, cfg.seed, AnswerFormat())
    return load_eval_set(cfg.eval, cfg.eval.answer_format or AnswerFormat(), prefix=False)


def excluded_prompts(cfg: ParentTrainConfig, sets: dict[str, list[EvalItem]]) -> set[str]:
    """User turns never trained on: every evaluation question, and the generator's held-out prompts."""
    out = {m["content"] for items in sets.values() for item in items for m in item.messages if m["role"] == "user"}
    for source in cfg.data.sources:
        if isinstance(source, GeneratorSource):
            held = held_out_prompts(cfg.eval_levels, cfg.eval_per_level, cfg.seed, source.problem_config())
            out |= held or set()
    return out


def save_with_transformers(model: HybridLM, out: Path, extra_files: dict[str, Path]) -> Path:
    """Write ``model`` with transformers' ``NemotronHForCausalLM.save_pretrained`` (plus ``extra_files``).

    The weights go through this project's writer into a temporary folder that transformers loads
    (checking every tensor name and shape), then transformers writes the checkpoint itself.
    """
    import shutil

    from transformers import NemotronHForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "ours")
        hf = NemotronHForCausalLM.from_pretrained(Path(tmp) / "ours", dtype=model.lm_head.weight.dtype)
        out.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(out)
    for name, path in extra_files.items():
        shutil.copyfile(path, out / name)
    return out


def train_parent(cfg: ParentTrainConfig, tracker: Tracker | None = None) -> dict[str, Any]:
    """Train, evaluate and save a parent; returns the metrics (also in ``metrics.json``)."""
    tracker = tracker or NullTracker()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = load_parent_tokenizer(cfg)
    vocab = -(-tok.vocab_size // 16) * 16  # embedding rows rounded up to a multiple of 16
    ids = {"pad_token_id": tok.pad_id, "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    config = HybridConfig(vocab_size=vocab, passthrough=ids, **cfg.architecture)
    model = HybridLM(config).init_weights(cfg.seed)
    tracker.log_params({"parent": cfg.model_dump(mode="json"), "num_parameters": model.num_parameters()})
    sets = eval_items(cfg)
    exclude = excluded_prompts(cfg, sets)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    balancer = LoadBalancer(model, cfg.balance_rate) if cfg.balance_rate > 0 else None
    model.train()
    tokens_seen = 0
    start = time.perf_counter()
    history: list[dict[str, float]] = []
    bar = progress_bar(cfg.steps, "parent", unit="step")
    for step in range(cfg.steps):
        batch = make_data_batch(
            cfg.data, tok, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, phase="parent", step=step,
            exclude=exclude,
        )  # fmt: skip
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = masked_lm_loss(model(batch.input_ids).logits, batch.input_ids, batch.loss_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        imbalance = balancer.step() if balancer is not None else float("nan")
        tokens_seen += batch.input_ids.numel()
        rate = tokens_seen / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{rate:,.0f}")
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            row = {
                "loss": loss.item(),
                "lr": lr_at(step, cfg),
                "tokens_per_s": rate,
                "expert_load_max_over_mean": imbalance,
            }
            history.append({"step": step, **row})
            tracker.log_metrics(row, step=step)
    bar.close()
    train_s = time.perf_counter() - start
    if balancer is not None:
        balancer.detach()
    metrics = {"train_seconds": train_s, "tokens_seen": tokens_seen, "final_loss": history[-1]["loss"]}
    metrics.update(evaluate_parent(model, tok, sets, cfg.max_new_tokens))
    metrics["num_parameters"] = model.num_parameters()
    tracker.log_metrics({k: v for k, v in metrics.items() if isinstance(v, int | float)})
    out = Path(cfg.output_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        extra = {p.name: p for p in Path(tmp).iterdir() if p.is_file()}
        if cfg.writer == "transformers":
            save_with_transformers(model, out, extra)
        else:
            model.save_pretrained(out, extra_files=extra)
    (out.parent / "metrics.json").write_text(json.dumps({"metrics": metrics, "history": history}, indent=2))
    tracker.log_artifact(out.parent / "metrics.json")
    return metrics
