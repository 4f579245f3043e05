"""Component importance from calibration activations, and the rankings it produces.

For every hooked activation ``a`` of shape (batch, seq, channels): ``acc += (|a|.mean(seq))^2
.sum(batch)``, score ``sqrt(acc)`` (METHOD section 4). :class:`ImportanceAccumulator` holds only
additive float64 sums, so calibration splits over batches, processes or Ray tasks and merges by
addition. Scores are kept per ORIGINAL component index; a ranking's ``order`` maps storage position
-> original index, most important first. Depth is optional (:mod:`model.elastic.depth`).

What is hooked per axis, and design notes: docs/elastic.md ("Importance and rankings").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from model.elastic.depth import DepthRanking, depth_ranking
from model.elastic.reap import (
    MoECalibration,
    combine_expert_scores,
    count_key,
    expert_ffn_key,
    expert_order,
    reap_key,
    reap_scores,
)

AXES: tuple[str, ...] = ("hidden", "mamba_heads", "attn_heads", "mlp_ffn", "moe_ffn", "shared_ffn", "experts")
"""Axes ranked from activations (names as in :mod:`model.elastic.space`); depth is a separate flag."""

ExpertScore = Literal["reap", "frequency", "reap_sum"]
"""Expert ordering score, see :func:`model.elastic.reap.combine_expert_scores`."""


def activation_stat(a: Tensor) -> Tensor:
    """a: (batch, seq, channels) -> (channels,) float64 ``sum_b (mean_s |a|)^2``."""
    return a.detach().float().abs().mean(dim=1).double().pow(2).sum(0)


class ImportanceAccumulator:
    """Additive calibration statistics, keyed ``"<axis>.<layer>"`` (``"hidden.<layer>"`` per norm).

    ``update(key, a)`` applies the aggregation rule to an activation (batch, seq, channels);
    ``add(key, x)`` adds an already reduced statistic (REAP sums, counts). ``merge`` sums two
    accumulators; ``state_dict`` / ``from_state_dict`` move them between processes (CPU tensors).
    """

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.num_batches = 0
        self.num_sequences = 0
        self.num_tokens = 0

    def add(self, key: str, value: Tensor) -> None:
        """Add a reduced statistic (any shape, float64) to ``key``."""
        value = value.double()
        if key in self.sums:
            self.sums[key] += value.to(self.sums[key].device)
        else:
            self.sums[key] = value.clone()

    def update(self, key: str, activation: Tensor) -> None:
        """Accumulate an activation (batch, seq, channels) under ``key`` by the aggregation rule."""
        self.add(key, activation_stat(activation))

    def count_batch(self, input_ids: Tensor) -> None:
        """Book-keeping for one calibration batch of input ids (batch, seq)."""
        self.num_batches += 1
        self.num_sequences += int(input_ids.shape[0])
        self.num_tokens += int(input_ids.numel())

    def merge(self, other: ImportanceAccumulator) -> ImportanceAccumulator:
        """Add ``other`` into ``self`` (in place) and return ``self``."""
        for key, value in other.sums.items():
            self.add(key, value)
        self.num_batches += other.num_batches
        self.num_sequences += other.num_sequences
        self.num_tokens += other.num_tokens
        return self

    def state_dict(self) -> dict[str, Any]:
        """A picklable snapshot with CPU tensors."""
        return {
            "sums": {k: v.detach().cpu() for k, v in self.sums.items()},
            "num_batches": self.num_batches,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ImportanceAccumulator:
        acc = cls()
        acc.sums = {k: v.double().clone() for k, v in state["sums"].items()}
        acc.num_batches = int(state["num_batches"])
        acc.num_sequences = int(state["num_sequences"])
        acc.num_tokens = int(state["num_tokens"])
        return acc

    def scores(self) -> dict[str, Tensor]:
        """Final scores (CPU float64): ``sqrt(acc)`` for activation keys; for MoE layer i also
        ``reap.<i>`` (mean of g*||f|| over routed tokens) and ``frequency.<i>`` (token counts)."""
        out: dict[str, Tensor] = {}
        for key, value in self.sums.items():
            v = value.detach().cpu()
            if key.startswith("reap_sum."):
                layer = key.split(".", 1)[1]
                out[f"reap.{layer}"] = reap_scores(v, self.sums[f"routed_count.{layer}"].cpu())
            elif key.startswith("routed_count."):
                out[f"frequency.{key.split('.', 1)[1]}"] = v.clone()
            else:
                out[key] = v.clamp_min(0).sqrt()
        return out


# ---------------------------------------------------------------------- hooks
@contextlib.contextmanager
def calibration_hooks(model, acc: ImportanceAccumulator, axes: Sequence[str] = AXES) -> Iterator[None]:
    """Register the hooks that feed ``acc`` for ``axes`` on a :class:`~model.hybrid.HybridLM`; removed on exit."""
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise ValueError(f"unknown ranking axes {unknown}; known {list(AXES)} (depth is a separate flag)")
    handles: list[Any] = []
    moe_hooks: list[MoECalibration] = []

    def out_hook(key: str, lo: int | None = None, hi: int | None = None):
        def hook(module, args, output):
            acc.update(key, output[..., lo:hi])

        return hook

    def in_hook(key: str):
        def hook(module, args):
            acc.update(key, args[0])

        return hook

    for i, block in enumerate(model.model.layers):
        mixer = block.mixer
        if "hidden" in axes:
            handles.append(block.norm.register_forward_hook(out_hook(f"hidden.{i}")))
        if block.kind == "mamba" and "mamba_heads" in axes:
            d = mixer.d_inner
            handles.append(mixer.in_proj.register_forward_hook(out_hook(f"mamba_heads.{i}", d, 2 * d)))
        elif block.kind == "attention" and "attn_heads" in axes:
            handles.append(mixer.o_proj.register_forward_pre_hook(in_hook(f"attn_heads.{i}")))
        elif block.kind == "mlp" and "mlp_ffn" in axes:
            handles.append(mixer.down_proj.register_forward_pre_hook(in_hook(f"mlp_ffn.{i}")))
        elif block.kind == "moe":
            if mixer.shared_experts is not None and "shared_ffn" in axes:
                handles.append(mixer.shared_experts.down_proj.register_forward_pre_hook(in_hook(f"shared_ffn.{i}")))
            if "experts" in axes or "moe_ffn" in axes:
                moe_hooks.append(MoECalibration(mixer, i, acc, reap="experts" in axes, expert_ffn="moe_ffn" in axes))
    try:
        for m in moe_hooks:
            m.attach()
        yield
    finally:
        for m in reversed(moe_hooks):
            m.detach()
        for h in handles:
            h.remove()


def _input_ids(batch: Any) -> Tensor:
    """Input ids (batch, seq) of a tensor or of anything with ``.input_ids`` (e.g. ``TrainBatch``)."""
    return batch if isinstance(batch, Tensor) else batch.input_ids


@torch.no_grad()
def calibrate(
    model,
    batches: Iterable[Any],
    axes: Sequence[str] = AXES,
    progress: bool = True,
    acc: ImportanceAccumulator | None = None,
    total: int | None = None,
) -> ImportanceAccumulator:
    """Run ``model`` over ``batches`` (input ids (batch, seq) or objects with ``.input_ids``) with hooks.

    Returns the accumulator (``acc`` if given, updated in place). Only the full model is run: the
    statistics describe the parent, never a masked sub-model.
    """
    acc = acc if acc is not None else ImportanceAccumulator()
    was_training = model.training
    model.eval()
    it: Iterable[Any] = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc="calibrate", unit="batch", total=total)
    try:
        with calibration_hooks(model, acc, axes):
            for batch in it:
                ids = _input_ids(batch).to(model.device)
                model(ids, logits_to_keep=1)  # the logits are not needed: skip the big lm_head matmul
                acc.count_batch(ids)
    finally:
        model.train(was_training)
    return acc


# ---------------------------------------------------------------------- rankings
class Ranking(BaseModel):
    """Scores per original component index and the storage order (position -> original index)."""

    model_config = ConfigDict(extra="forbid")

    scores: list[float]
    order: list[int]


class LayerRanking(BaseModel):
    """Rankings inside one layer; fields that do not apply to the layer's kind stay ``None``."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    mamba_heads: Ranking | None = None
    attn_heads: Ranking | None = None
    mlp_ffn: Ranking | None = None
    shared_ffn: Ranking | None = None
    moe_ffn: list[Ranking] | None = Field(None, description="One ranking per routed expert, by original expert index.")
    experts: Ranking | None = Field(None, description="Experts ordered by the Rankings' expert_score.")
    expert_reap: list[float] | None = None
    expert_frequency: list[float] | None = None


class Rankings(BaseModel):
    """Everything the rank stage decides; JSON round trip via :meth:`to_dict` / :meth:`from_dict`."""

    model_config = ConfigDict(extra="forbid")

    axes: list[str]
    expert_score: ExpertScore = "reap"
    expert_groups: int = Field(1, description="Routing groups (n_group); experts are ordered inside each.")
    hidden: Ranking | None = None
    layers: list[LayerRanking]
    depth: DepthRanking | None = None
    num_sequences: int = 0
    num_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rankings:
        return cls.model_validate(data)

    def with_expert_score(self, expert_score: ExpertScore) -> Rankings:
        """A copy whose expert orders follow ``expert_score`` (REAP, routing frequency or their product)."""
        out = self.model_copy(deep=True)
        out.expert_score = expert_score
        for lr in out.layers:
            if lr.experts is not None:
                assert lr.expert_reap is not None and lr.expert_frequency is not None
                scores = combine_expert_scores(
                    torch.tensor(lr.expert_reap, dtype=torch.float64),
                    torch.tensor(lr.expert_frequency, dtype=torch.float64),
                    expert_score,
                )
                lr.experts = _ranking(scores, self.expert_groups)
        return out


def descending_order(scores: Tensor, n_groups: int = 1) -> Tensor:
    """(n,) order sorting ``scores`` descending inside each of ``n_groups`` contiguous groups (stable)."""
    return expert_order(scores, n_groups)


def _ranking(scores: Tensor, n_groups: int = 1) -> Ranking:
    return Ranking(scores=scores.tolist(), order=descending_order(scores, n_groups).tolist())


def head_scores(channel_scores: Tensor, n_heads: int) -> Tensor:
    """(heads * head_dim,) channel scores -> (heads,): L2 over head_dim."""
    return channel_scores.reshape(n_heads, -1).pow(2).sum(-1).sqrt()


def rankings_from_accumulator(
    acc: ImportanceAccumulator,
    config,
    axes: Sequence[str] = AXES,
    expert_score: ExpertScore = "reap",
    depth: DepthRanking | None = None,
) -> Rankings:
    """Turn accumulated statistics into :class:`Rankings` for a model with :class:`HybridConfig` ``config``."""
    s = acc.scores()
    c = config
    hidden = None
    if "hidden" in axes:
        per_layer = [s[f"hidden.{i}"] for i in range(c.num_hidden_layers) if f"hidden.{i}" in s]
        if not per_layer:
            raise ValueError("no hidden statistics: calibrate with the 'hidden' axis first")
        hidden = _ranking(torch.stack(per_layer).sum(0))
    layers: list[LayerRanking] = []
    for i, kind in enumerate(c.layer_kinds):
        lr = LayerRanking(kind=kind)
        if kind == "mamba" and f"mamba_heads.{i}" in s:
            lr.mamba_heads = _ranking(head_scores(s[f"mamba_heads.{i}"], c.mamba_num_heads), c.n_groups)
        elif kind == "attention" and f"attn_heads.{i}" in s:
            heads = head_scores(s[f"attn_heads.{i}"], c.num_attention_heads)
            lr.attn_heads = _ranking(heads, c.num_key_value_heads)
        elif kind == "mlp" and f"mlp_ffn.{i}" in s:
            lr.mlp_ffn = _ranking(s[f"mlp_ffn.{i}"])
        elif kind == "moe":
            if f"shared_ffn.{i}" in s:
                lr.shared_ffn = _ranking(s[f"shared_ffn.{i}"])
            if expert_ffn_key(i) in s:
                lr.moe_ffn = [_ranking(row) for row in s[expert_ffn_key(i)]]
            if reap_key(i) in acc.sums:
                lr.expert_reap = s[f"reap.{i}"].tolist()
                lr.expert_frequency = acc.sums[count_key(i)].cpu().tolist()
                chosen = combine_expert_scores(s[f"reap.{i}"], s[f"frequency.{i}"], expert_score)
                lr.experts = _ranking(chosen, c.n_group)
        layers.append(lr)
    return Rankings(
        axes=list(axes),
        expert_score=expert_score,
        expert_groups=c.n_group,
        hidden=hidden,
        layers=layers,
        depth=depth,
        num_sequences=acc.num_sequences,
        num_tokens=acc.num_tokens,
    )


def rank_model(
    model,
    batches: Iterable[Any],
    axes: Sequence[str] = AXES,
    depth: bool = False,
    progress: bool = True,
    expert_score: ExpertScore = "reap",
) -> Rankings:
    """Calibrate ``model`` on ``batches`` and return its :class:`Rankings` (the model is not changed).

    ``batches``: input ids (batch, seq) or objects with ``.input_ids``; materialised once when
    ``depth`` is set (the greedy depth search passes over them many times). ``"depth"`` in ``axes``
    is the same as ``depth=True``.
    """
    depth = depth or "depth" in axes
    axes = [a for a in axes if a != "depth"]
    data = list(batches) if depth else batches
    acc = calibrate(model, data, axes, progress)
    depth_rank = None
    if depth:
        depth_rank = depth_ranking(model, [_input_ids(b) for b in data], progress)  # type: ignore[union-attr]
    out = rankings_from_accumulator(acc, model.config, axes, expert_score, depth_rank)
    if depth:
        out.axes.append("depth")
    return out
