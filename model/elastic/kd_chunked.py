"""The KD loss computed from hidden states chunk by chunk: no (tokens x vocabulary) tensor in float32.

:func:`chunked_kd_loss` computes :func:`~model.elastic.losses.kd_loss` (the reference, on full
(batch, seq, vocab) logits) from the student's final hidden states (N, hidden) and the ``lm_head``
weight (vocab, hidden), ``chunk_size`` token rows at a time, so the largest float32 temporaries are
(chunk_size, vocab). The gradient is computed in the forward pass (fused linear + loss): nothing of
size (N, vocab) is kept for the backward. Only the token axis is chunked.

Design notes (same numbers as the reference, the gradient, the teacher's inputs, memory):
docs/elastic.md ("The chunked KD loss").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK = 1024
"""Token rows per chunk: (1024, 131072) float32 temporaries are 0.5 GB each."""


def _chunk_kl_and_grad(log_s: Tensor, log_t: Tensor, w: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One chunk: log_s, log_t (c, V) float32 student / teacher log-probabilities (both are overwritten),
    w (c,) token weights or None (no gradient). Returns (per-token KL (c,), gradient of
    ``sum_n w_n KL_n`` w.r.t. the student's float32 logits (c, V), or None)."""
    p_t = log_t.exp()
    diff = log_t.sub_(log_s)  # log_t - log_s, in log_t's storage
    # the reference's where(p_t > 0, p_t * diff, 0): 0 * log 0 counts as 0 (diff is -inf there)
    term = diff.mul_(p_t).masked_fill_(p_t <= 0, 0.0)
    per_token = term.sum(-1)
    del diff, term
    if w is None:
        return per_token, None
    # d/d log_s of w * sum_v where(p_t > 0, p_t (log_t - log_s), 0) is -w p_t (0 where p_t == 0, as p_t is
    # there); log_softmax's backward maps g to g - exp(log_s) * sum(g), which is what autograd computes
    g = p_t.mul_(-w[:, None])  # in p_t's storage
    grad = log_s.exp_().mul_(g.sum(-1, keepdim=True)).neg_().add_(g)  # in log_s's storage
    return per_token, grad


class _ChunkedKD(torch.autograd.Function):
    """Scalar KD loss of rows ``h`` (N, hidden) against ``weight`` (V, hidden); gradients made in the forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h: Tensor,
        weight: Tensor,
        mask: Tensor | None,
        teacher: Tensor | None,
        teacher_hidden: Tensor | None,
        teacher_weight: Tensor | None,
        chunk_size: int,
    ) -> Tensor:
        """mask: (N,) float32 or None; teacher: (N, V) logits, or teacher_hidden (N, H_t) with teacher_weight
        (V, H_t). Returns the float32 scalar loss."""
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = h.shape[0]
        # each token's share of the loss: the reference's mean (1/N) or masked mean (mask / max(sum, 1))
        if mask is None:
            token_w = torch.full((n,), 1.0 / max(n, 1), dtype=torch.float32, device=h.device)
        else:
            token_w = mask / mask.sum().clamp_min(1.0)
        per_token = torch.empty(n, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h_c = h[start:stop]
            # what log_softmax(lm_head(h).float()) gives for these rows; the (c, V) logits are temporaries
            log_s = F.log_softmax(F.linear(h_c, weight).float(), dim=-1)
            if teacher is not None:
                log_t = F.log_softmax(teacher[start:stop].float(), dim=-1)
            else:
                log_t = F.log_softmax(F.linear(teacher_hidden[start:stop], teacher_weight).float(), dim=-1)
            kl, g = _chunk_kl_and_grad(log_s, log_t, token_w[start:stop] if need_h or need_w else None)
            del log_s, log_t
            per_token[start:stop] = kl
            if g is not None:
                g_low = g.to(h.dtype)  # the backward of .float(): the logits' gradient in their dtype
                if g_low is not g:
                    g.copy_(g_low)  # the rounded values, in float32 storage for the float32 sum into grad_w
                if grad_h is not None:
                    torch.mm(g_low, weight, out=grad_h[start:stop])
                if grad_w is not None:
                    grad_w.addmm_(g.t(), h_c.float())
                del g, g_low
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        # the reference's reduction, term for term
        if mask is None:
            return per_token.mean()
        return (per_token * mask).sum() / mask.sum().clamp_min(1.0)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        out_h = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
        out_w = None if grad_w is None else grad_w * grad_out.to(grad_w.dtype)
        return out_h, out_w, None, None, None, None, None


def chunked_kd_loss(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    teacher_logits: Tensor | None = None,
    loss_mask: Tensor | None = None,
    *,
    teacher_hidden: Tensor | None = None,
    teacher_lm_head_weight: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor:
    """``kd_loss(student_hidden @ lm_head_weight^T, teacher_logits, loss_mask)`` without the full logits.

    student_hidden: (..., hidden), e.g. (batch, seq, hidden), the student's final (normed) hidden
    states; lm_head_weight: (vocab, hidden). The teacher is either ``teacher_logits`` (..., vocab) or
    ``teacher_hidden`` (..., teacher_hidden) with ``teacher_lm_head_weight`` (vocab, teacher_hidden).
    loss_mask: (...) bool or 0/1 (None = every token). Returns a float32 scalar whose gradient flows to
    ``student_hidden`` and ``lm_head_weight``; the teacher never receives one.
    """
    if chunk_size < 1:
        raise ValueError(f"chunked_kd_loss: chunk_size must be >= 1, got {chunk_size}")
    if (teacher_logits is None) == (teacher_hidden is None):
        raise ValueError("chunked_kd_loss: give exactly one of teacher_logits or teacher_hidden")
    if teacher_hidden is not None and teacher_lm_head_weight is None:
        raise ValueError("chunked_kd_loss: teacher_hidden needs teacher_lm_head_weight (the teacher's lm_head)")
    lead = tuple(student_hidden.shape[:-1])
    vocab = lm_head_weight.shape[0]
    if lm_head_weight.shape[1] != student_hidden.shape[-1]:
        raise ValueError(
            f"chunked_kd_loss: lm_head_weight {tuple(lm_head_weight.shape)} does not take hidden states of "
            f"width {student_hidden.shape[-1]}"
        )
    if teacher_logits is not None:
        if tuple(teacher_logits.shape) != (*lead, vocab):
            raise ValueError(
                f"chunked_kd_loss: teacher logits {tuple(teacher_logits.shape)} must have shape {(*lead, vocab)} "
                "(the student's hidden states' leading shape and the student's vocabulary)"
            )
        teacher = teacher_logits.detach().reshape(-1, vocab)
        t_hidden = t_weight = None
    else:
        if tuple(teacher_hidden.shape[:-1]) != lead or tuple(teacher_lm_head_weight.shape) != (
            vocab,
            teacher_hidden.shape[-1],
        ):
            raise ValueError(
                f"chunked_kd_loss: teacher hidden {tuple(teacher_hidden.shape)} and lm_head "
                f"{tuple(teacher_lm_head_weight.shape)} must give logits of shape {(*lead, vocab)}"
            )
        teacher = None
        t_hidden = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
        t_weight = teacher_lm_head_weight.detach()
    mask = None
    if loss_mask is not None:
        if tuple(loss_mask.shape) != lead:
            raise ValueError(
                f"chunked_kd_loss: loss_mask has shape {tuple(loss_mask.shape)}; expected {lead} "
                "(the hidden states' shape without the hidden dimension)"
            )
        mask = loss_mask.reshape(-1).to(torch.float32)
    h = student_hidden.reshape(-1, student_hidden.shape[-1])
    return _ChunkedKD.apply(h, lm_head_weight, mask, teacher, t_hidden, t_weight, chunk_size)
