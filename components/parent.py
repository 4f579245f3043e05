"""Train the small demo parent on the built-in reasoning task (the embedded default).

The parent has every nemotron_h layer kind (Mamba2, attention, MoE, dense MLP) and
is sized to train on 2 CPU cores in minutes. It learns the task well enough that
thinking clearly beats answering directly and accuracy falls as chains get longer,
so budgets and thinking caps make measurable differences downstream.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from components.data import ProblemConfig, eval_prompts, generate_eval_sets, make_batch
from components.data.tokenizer import CharTokenizer
from components.lm_eval import task_accuracy
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
    """How the demo parent is built and trained."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str = Field("runs/demo-parent/parent", description="Where the parent checkpoint is written.")
    architecture: dict[str, Any] = Field(
        default_factory=lambda: dict(DEMO_PARENT_ARCH), description="nemotron_h fields of the parent."
    )
    data: ProblemConfig = Field(default_factory=ProblemConfig, description="Training problems.")
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


def evaluate_parent(model: HybridLM, tok: CharTokenizer, eval_sets: dict[int, list]) -> dict[str, float]:
    """Accuracy per level with full thinking and answering directly."""
    out: dict[str, float] = {}
    model.eval()
    for level, problems in eval_sets.items():
        out[f"acc_think_L{level}"] = task_accuracy(model, tok, problems, think=True).accuracy
        out[f"acc_direct_L{level}"] = task_accuracy(model, tok, problems, think=False).accuracy
    n = len(eval_sets)
    out["acc_think"] = sum(out[f"acc_think_L{lv}"] for lv in eval_sets) / n
    out["acc_direct"] = sum(out[f"acc_direct_L{lv}"] for lv in eval_sets) / n
    return out


def train_parent(cfg: ParentTrainConfig, tracker: Tracker | None = None) -> dict[str, Any]:
    """Train, evaluate and save the demo parent; returns the metrics (also in ``metrics.json``)."""
    tracker = tracker or NullTracker()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    config = HybridConfig(vocab_size=tok.vocab_size, **cfg.architecture)
    model = HybridLM(config).init_weights(cfg.seed)
    tracker.log_params({"parent": cfg.model_dump(), "num_parameters": model.num_parameters()})
    eval_sets = generate_eval_sets(cfg.eval_levels, cfg.eval_per_level, cfg.seed, cfg.data)
    exclude = eval_prompts(eval_sets)
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
    bar = tqdm(range(cfg.steps), desc="parent", unit="step", mininterval=2.0)
    for step in bar:
        batch = make_batch(cfg.data, tok, cfg.batch_size, cfg.seq_len, cfg.seed, step, exclude=exclude)
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
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            row = {
                "loss": loss.item(),
                "lr": lr_at(step, cfg),
                "tokens_per_s": rate,
                "expert_load_max_over_mean": imbalance,
            }
            history.append({"step": step, **row})
            tracker.log_metrics(row, step=step)
    train_s = time.perf_counter() - start
    if balancer is not None:
        balancer.detach()
    metrics = {"train_seconds": train_s, "tokens_seen": tokens_seen, "final_loss": history[-1]["loss"]}
    metrics.update(evaluate_parent(model, tok, eval_sets))
    metrics["num_parameters"] = model.num_parameters()
    tracker.log_metrics({k: v for k, v in metrics.items() if isinstance(v, int | float)})
    out = Path(cfg.output_dir)
    tok_dir = out.parent / ".tokenizer-staging"
    tok.save(tok_dir)
    extra = {p.name: p for p in tok_dir.iterdir()}
    model.save_pretrained(out, extra_files=extra)
    for p in tok_dir.iterdir():
        p.unlink()
    tok_dir.rmdir()
    (out.parent / "metrics.json").write_text(json.dumps({"metrics": metrics, "history": history}, indent=2))
    tracker.log_artifact(out.parent / "metrics.json")
    return metrics
