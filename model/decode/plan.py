"""A decode plan: the single-token cached step of a model, built from its layers, in fewer operators.

:class:`DecodePlan` walks a :class:`~model.hybrid.HybridLM` once and keeps one step per layer
(:mod:`model.decode.layers`); calling it runs the model's forward for one token per row on a cache,
``input_ids`` (batch, 1) -> :class:`~model.hybrid.CausalLMOutput` with logits (batch, 1, vocab), the residual
stream kept as (batch, hidden). It computes the function :meth:`HybridLM.forward` computes (up to float
rounding), in the model's dtype and on its device; the model and its layers do not know about it.

A plan is built for one set of weights: the structure is captured, and a few small tensors are derived
from the weights once (the Mamba steps' ``A = -exp(A_log)``, float32 ``D`` / ``dt_bias``, time-major conv
taps). Most weights are read at every step, and a derived tensor whose source is replaced (``.to()``,
``.data =``, a new parameter) is derived again; but after changing weights in place (an optimiser step,
``load_state_dict``, ``copy_``) build a new plan (:meth:`DecodePlan.stale` tells whether one is needed).
Build a new plan after replacing a module of its model, too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import HybridCache
from model.decode.kernels import prepare_decode_linears
from model.decode.layers import STEPS, ReferenceStep
from model.decode.ops import cast, linear, rms_norm
from model.hybrid import CausalLMOutput, HybridLM
from model.masks import ModelMask


class DecodePlan:
    """The fast single-token step of ``model`` (see the module docstring).

    Use :meth:`accepts` to check that a call is one it covers: one token per row, a cache, no mask, no
    logits-free forward, autograd off. Everything else is the model's own forward.
    """

    def __init__(self, model: HybridLM, max_copy_bytes: int | None = None) -> None:
        """``max_copy_bytes``: the memory its projections' kernel copies may take
        (:func:`~model.decode.kernels.prepare_decode_linears`; None: the default bound)."""
        backbone = model.model
        self.model = model
        self.embeddings = backbone.embeddings
        self.norm_f = backbone.norm_f
        self.lm_head = model.lm_head
        self.float_residual = model.config.residual_in_fp32
        self.steps = [STEPS.get(block.kind, ReferenceStep)(block) for block in backbone.layers]
        self.kernels = prepare_decode_linears(model, max_copy_bytes=max_copy_bytes)  # measured fastest kernels

    def stale(self) -> bool:
        """Whether a weight changed in place since the plan was built, so that tensors it derived from the
        weights are out of date (build a new plan). It derives them again to compare: a check for tests
        and after weight updates, not for every step."""
        return any(step.stale() for step in self.steps)

    @staticmethod
    def accepts(
        input_ids: Tensor, cache: HybridCache | None, mask: ModelMask | None = None, skip_logits: bool = False
    ) -> bool:
        """Whether a forward with these arguments is a step this plan computes."""
        return (
            cache is not None
            and mask is None
            and input_ids.shape[1] == 1
            and not skip_logits
            and not torch.is_grad_enabled()
        )

    def __call__(self, input_ids: Tensor, cache: HybridCache, return_hidden: bool = False) -> CausalLMOutput:
        """input_ids: (batch, 1) -> logits (batch, 1, vocab); ``cache`` is updated (and returned)."""
        emb = self.embeddings
        if type(emb) is nn.Embedding and emb.padding_idx is None and emb.max_norm is None:
            x = F.embedding(input_ids.view(-1), emb._parameters["weight"])  # (batch, hidden)
        else:
            x = emb(input_ids.view(-1))
        if self.float_residual:
            x = cast(x, torch.float32)
        for i, step in enumerate(self.steps):
            x = step(x, cache, i)
        cache.seen_tokens += 1
        weight = self.norm_f._parameters["weight"]
        h = rms_norm(cast(x, weight.dtype), weight, self.norm_f.eps)
        logits = linear(self.lm_head, h)[:, None]
        return CausalLMOutput(logits=logits, cache=cache, hidden=h[:, None] if return_hidden else None)


def decode_plan(model: nn.Module) -> DecodePlan | None:
    """The plan a model's cached single-token steps can take, or None when there is none.

    A :class:`~model.decode.budget_view.BudgetModel` keeps its own (None when it applies a budget mask);
    any other :class:`~model.hybrid.HybridLM` gets a new plan; other modules get None.
    """
    own = getattr(model, "decode_plan", None)
    if callable(own):
        return own()
    return DecodePlan(model) if isinstance(model, HybridLM) else None


__all__ = ["DecodePlan", "decode_plan"]
