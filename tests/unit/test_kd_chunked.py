"""The chunked KD loss equals the reference ``kd_loss`` on full logits: value and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.elastic.kd_chunked import chunked_kd_loss
from model.elastic.losses import kd_loss

B, T, H, V = 2, 13, 16, 50
CHUNKS = [1, 5, 7, 13, 26, 1000]  # 5 and 7 do not divide the 26 rows; 1000 is one chunk


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    teacher = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    teacher[0, 0, 3] = -math.inf  # a teacher probability of exactly 0: the 0 * log 0 term
    mask = torch.rand(B, T, generator=g) > 0.4
    return h, w, teacher, mask


def _reference(h, w, teacher, mask):
    loss = kd_loss(F.linear(h, w), teacher, mask)
    return (loss, *torch.autograd.grad(loss, [h, w]))


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("masked", [False, True])
def test_float32_matches_reference(chunk, masked):
    h, w, teacher, mask = _inputs(torch.float32)
    mask = mask if masked else None
    ref, ref_h, ref_w = _reference(h, w, teacher, mask)
    got = chunked_kd_loss(h, w, teacher, mask, chunk_size=chunk)
    got_h, got_w = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("chunk", [3, 8, 26])
@pytest.mark.parametrize("masked", [False, True])
def test_bfloat16_matches_reference(chunk, masked):
    h, w, teacher, mask = _inputs(torch.bfloat16, seed=1)
    mask = mask if masked else None
    ref, ref_h, ref_w = _reference(h, w, teacher, mask)
    got = chunked_kd_loss(h, w, teacher, mask, chunk_size=chunk)
    got_h, got_w = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float32 and got_h.dtype == got_w.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(got_h.float(), ref_h.float(), rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(got_w.float(), ref_w.float(), rtol=2e-2, atol=1e-4)


def test_hand_computed_value_and_gradient():
    # one token, vocab 2, hidden 1: student logits [0, 0] (h = 1, W = [[0], [0]]), teacher p = [1/4, 3/4]
    h = torch.ones(1, 1, requires_grad=True)
    w = torch.zeros(2, 1, requires_grad=True)
    teacher = torch.tensor([[0.0, math.log(3.0)]])
    loss = chunked_kd_loss(h, w, teacher)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d loss / d logits = softmax(s) - p_t = [0.25, -0.25]; d logits / d W = h = 1; d logits / d h = W = 0
    torch.testing.assert_close(w.grad, torch.tensor([[0.25], [-0.25]]))
    assert h.grad.abs().sum().item() == 0.0


def test_teacher_hidden_equals_teacher_logits():
    h, w, _, mask = _inputs(torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    t_hidden = torch.randn(B, T, 24, generator=g)
    t_weight = torch.randn(V, 24, generator=g) * 0.3
    from_logits = chunked_kd_loss(h, w, F.linear(t_hidden, t_weight), mask, chunk_size=4)
    grads_logits = torch.autograd.grad(from_logits, [h, w])
    from_hidden = chunked_kd_loss(
        h, w, loss_mask=mask, teacher_hidden=t_hidden, teacher_lm_head_weight=t_weight, chunk_size=4
    )
    grads_hidden = torch.autograd.grad(from_hidden, [h, w])
    torch.testing.assert_close(from_hidden, from_logits, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_hidden, grads_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_upstream_gradient_scales_and_only_needed_grads():
    h, w, teacher, mask = _inputs(torch.float32, seed=4)
    ref = kd_loss(F.linear(h, w), teacher, mask)
    (ref_w,) = torch.autograd.grad(3.0 * ref, [w])
    frozen_h = h.detach()  # only the weight trains
    got = chunked_kd_loss(frozen_h, w, teacher, mask, chunk_size=6)
    (got_w,) = torch.autograd.grad(3.0 * got, [w])
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        assert not chunked_kd_loss(h, w, teacher, mask).requires_grad


def test_all_zero_mask_gives_zero_loss_with_a_graph():
    h, w, teacher, _ = _inputs(torch.float32)
    loss = chunked_kd_loss(h, w, teacher, torch.zeros(B, T), chunk_size=5)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert h.grad.abs().sum().item() == 0.0 and w.grad.abs().sum().item() == 0.0


def test_rejects_bad_shapes_and_arguments():
    h, w, teacher, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="teacher logits"):
        chunked_kd_loss(h, w, teacher[..., :7])
    with pytest.raises(ValueError, match="loss_mask"):
        chunked_kd_loss(h, w, teacher, torch.ones(T, B))
    with pytest.raises(ValueError, match="exactly one"):
        chunked_kd_loss(h, w)
    with pytest.raises(ValueError, match="teacher_lm_head_weight"):
        chunked_kd_loss(h, w, teacher_hidden=h.detach())
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_kd_loss(h, w, teacher, chunk_size=0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_kd_loss(h, w[:, :5], teacher)
