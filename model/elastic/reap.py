"""Expert statistics of MoE layers: REAP scores, routing frequency, and per-expert FFN activations.

REAP scores expert ``j`` by ``S_j = mean over tokens routed to j of g_j(x) * ||f_j(x)||_2`` (``g_j``
the renormalised top-k gate weight); the routing frequency and ``reap_sum`` (REAP x frequency) are
kept next to it. Everything is gathered through :attr:`model.moe.MoE.observer` plus a pre-hook on
the MoE input, so the MoE forward is untouched; statistics are additive sums, merged by addition.

Design notes (when frequency beats REAP, per-expert FFN importance): docs/elastic.md ("Expert statistics (REAP)").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from model.masks import LayerMask, ModelMask, prefix_mask
from model.mlp import relu2
from model.moe import MoE

if TYPE_CHECKING:
    from model.config import HybridConfig


class StatisticSink(Protocol):
    """Where :class:`MoECalibration` adds its statistics: any additive store of named sums, such as
    :class:`~model.elastic.importance.ImportanceAccumulator` (which also turns them into scores)."""

    def add(self, key: str, value: Tensor) -> None:
        """Add the reduced statistic ``value`` (any shape) to the running sum under ``key``."""


def reap_key(layer: int) -> str:
    """Accumulator key of ``sum g_j * ||f_j||`` (E,) of MoE layer ``layer``."""
    return f"reap_sum.{layer}"


def count_key(layer: int) -> str:
    """Accumulator key of the number of tokens routed to each expert (E,) of layer ``layer``."""
    return f"routed_count.{layer}"


def expert_ffn_key(layer: int) -> str:
    """Accumulator key of the per-expert FFN activation statistic (E, moe_ffn) of layer ``layer``."""
    return f"moe_ffn.{layer}"


class MoECalibration:
    """Attaches to one :class:`~model.moe.MoE` and feeds its statistics into an accumulator.

    ``reap``: gather REAP sums and routing counts; ``expert_ffn``: gather per-expert FFN channel
    statistics. Use as a context manager (or call :meth:`attach` / :meth:`detach`); any observer
    already set on the MoE is restored on detach.
    """

    def __init__(self, moe: MoE, layer: int, acc: StatisticSink, reap: bool = True, expert_ffn: bool = True) -> None:
        self.moe = moe
        self.layer = layer
        self.acc = acc
        self.reap = reap
        self.expert_ffn = expert_ffn
        self._input: Tensor | None = None
        self._previous = None
        self._handle = None

    # -------------------------------------------------------------- wiring
    def attach(self) -> MoECalibration:
        self._previous = self.moe.observer
        self.moe.observer = self._observe
        if self.expert_ffn:
            self._handle = self.moe.register_forward_pre_hook(self._remember_input)
        return self

    def detach(self) -> None:
        self.moe.observer = self._previous
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._input = None

    def __enter__(self) -> MoECalibration:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _remember_input(self, module: nn.Module, args: tuple) -> None:
        self._input = args[0].detach()  # (batch, seq, hidden)

    # -------------------------------------------------------------- statistics
    @torch.no_grad()
    def _observe(self, idx: Tensor, weights: Tensor, norms: Tensor) -> None:
        """idx, weights, norms: (T, k) from :class:`~model.moe.Experts` (T = batch * seq tokens)."""
        if self._previous is not None:
            self._previous(idx, weights, norms)
        n_exp = self.moe.experts.num_experts
        flat = idx.reshape(-1)
        if self.reap:
            g = weights.double() / self.moe.gate.scaling
            contrib = (g * norms.double()).reshape(-1)
            self.acc.add(reap_key(self.layer), torch.bincount(flat, weights=contrib, minlength=n_exp))
            self.acc.add(count_key(self.layer), torch.bincount(flat, minlength=n_exp).double())
        if self.expert_ffn and self._input is not None:
            self.acc.add(expert_ffn_key(self.layer), self._expert_channels(idx))

    def _expert_channels(self, idx: Tensor) -> Tensor:
        """(E, moe_ffn) float64: per expert, ``sum_b (mean_s |h_e|)^2`` with h_e zero off its tokens."""
        x = self._input
        assert x is not None
        b, s, hdim = x.shape
        flat_x = x.reshape(-1, hdim)
        up = self.moe.experts.up_proj  # (E, F, H)
        n_exp, f = up.shape[0], up.shape[1]
        out = torch.zeros(n_exp, f, dtype=torch.float64, device=x.device)
        k = idx.shape[1]
        tokens = torch.arange(idx.shape[0], device=idx.device).repeat_interleave(k)
        flat = idx.reshape(-1)
        for e in range(n_exp):
            tok = tokens[flat == e]
            if tok.numel() == 0:
                continue
            h = relu2(flat_x[tok] @ up[e].t()).float().abs()  # (n, F)
            per_row = torch.zeros(b, f, dtype=torch.float32, device=x.device).index_add_(0, tok // s, h) / s
            out[e] = per_row.double().pow(2).sum(0)
        return out


# ---------------------------------------------------------------------- scores
EXPERT_SCORES = ("reap", "frequency", "reap_sum")
"""How experts can be ordered: REAP (the method's default), routing frequency, or their product."""


def combine_expert_scores(reap: Tensor, frequency: Tensor, kind: str) -> Tensor:
    """(E,) ordering score of kind ``reap`` (mean of g*||f|| over routed tokens), ``frequency``
    (routed token count) or ``reap_sum`` (REAP x frequency = the sum of g*||f|| over all tokens,
    i.e. the expert's expected contribution per token up to a constant)."""
    if kind == "reap":
        return reap
    if kind == "frequency":
        return frequency
    if kind == "reap_sum":
        return reap * frequency
    raise ValueError(f"unknown expert score {kind!r}; choose from {list(EXPERT_SCORES)}")


def reap_scores(reap_sum: Tensor, counts: Tensor) -> Tensor:
    """(E,) REAP score: mean of ``g * ||f||`` over routed tokens; 0 for an expert never routed to."""
    return torch.where(counts > 0, reap_sum / counts.clamp_min(1), torch.zeros_like(reap_sum))


def expert_order(scores: Tensor, n_group: int = 1) -> Tensor:
    """(E,) storage order, most important first; inside each expert group when ``n_group > 1``.

    Group-limited routing picks experts by their contiguous group, so moving an expert to another
    group would change which tokens it sees; sorting inside groups keeps the model exact.
    """
    e = scores.shape[0]
    per = e // n_group
    grouped = scores.reshape(n_group, per)
    local = torch.sort(grouped, dim=1, descending=True, stable=True).indices
    return (local + torch.arange(n_group, device=scores.device)[:, None] * per).reshape(-1)


# ---------------------------------------------------------------------- pruning helpers
def expert_prune_mask(config: HybridConfig, keep: int) -> ModelMask:
    """A :class:`ModelMask` keeping the first ``keep`` experts of every MoE layer (storage order).

    Apply after permuting experts by a ranking, so the kept prefix is the top-``keep`` experts.
    """
    if not config.num_experts_per_tok <= keep <= config.n_routed_experts:
        raise ValueError(
            f"keep={keep} experts: must be between num_experts_per_tok ({config.num_experts_per_tok}) "
            f"and n_routed_experts ({config.n_routed_experts})"
        )
    layers = [
        LayerMask(experts=prefix_mask(config.n_routed_experts, keep)) if kind == "moe" else LayerMask()
        for kind in config.layer_kinds
    ]
    return ModelMask(layers=layers)
