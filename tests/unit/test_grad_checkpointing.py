"""Per-block activation checkpointing (``HybridLM.gradient_checkpointing``): same loss, same gradients."""

from __future__ import annotations

import pytest
import torch

from model.config import HybridConfig
from model.elastic import ElasticSpace
from model.elastic.build_masks import soft_mask
from model.elastic.kd_chunked import chunked_kd_loss
from model.hybrid import HybridLM
from tests.conftest import TINY

CFG = HybridConfig(**TINY)
SPACE = ElasticSpace(
    hidden=[32, 24],
    mamba_heads=[4, 2],
    attn_heads=[4, 2],
    mlp_ffn=[48, 32],
    moe_ffn=[16, 8],
    experts=[4, 3],
    depth=[6, 5],
)


def _model() -> HybridLM:
    return HybridLM(CFG).init_weights(seed=3).train()


def _step(model: HybridLM, masked: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients (parameters, and the mask probabilities' logits) of one KD step."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CFG.vocab_size, (2, 19), generator=g)
    teacher = torch.randn(2, 19, CFG.vocab_size, generator=g)
    logits = {axis: torch.randn(2, generator=g).requires_grad_() for axis in SPACE.elastic_axes}
    mask = soft_mask(CFG, {a: torch.softmax(z, -1) for a, z in logits.items()}, SPACE) if masked else None
    out = model(ids, mask=mask, skip_logits=True)
    loss = chunked_kd_loss(out.hidden, model.lm_head.weight, teacher, chunk_size=16)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if masked:
        grads.update({f"router.{a}": z.grad.clone() for a, z in logits.items()})
    return loss.detach(), grads


@pytest.mark.parametrize("masked", [False, True])
def test_gradients_equal_with_and_without_checkpointing(masked):
    plain, ckpt = _model(), _model()
    ckpt.gradient_checkpointing = True
    loss_plain, grads_plain = _step(plain, masked)
    loss_ckpt, grads_ckpt = _step(ckpt, masked)
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
    assert grads_ckpt.keys() == grads_plain.keys()
    for name, grad in grads_plain.items():
        # every weight learns; an axis whose smaller candidate changes nothing here (e.g. an expert no token
        # picks) may get an exact 0, but the mask probabilities as a whole must get a gradient
        assert name.startswith("router.") or grad.abs().sum() > 0, f"{name}: no gradient at all"
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    if masked:
        assert sum(g.abs().sum() for n, g in grads_plain.items() if n.startswith("router.")) > 0


def _saved_bytes(model: HybridLM, ids: torch.Tensor) -> int:
    """Bytes autograd saves for the backward outside checkpointed regions, during one forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, skip_logits=True).hidden.sum().backward()
    return total


def test_checkpointing_keeps_fewer_activations():
    ids = torch.randint(0, CFG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    plain, ckpt = _model(), _model()
    ckpt.gradient_checkpointing = True
    kept_plain, kept_ckpt = _saved_bytes(plain, ids), _saved_bytes(ckpt, ids)
    # outside the blocks only the final norm saves anything: its (2, 64, 32) float32 input and a few rows
    assert kept_ckpt < 0.1 * kept_plain, (kept_ckpt, kept_plain)


def test_inference_paths_ignore_the_switch():
    model = _model().eval()
    ids = torch.randint(0, CFG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        model.gradient_checkpointing = True
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
        cached = model(ids[:, :5], use_cache=True)
        step = model(ids[:, 5:6], cache=cached.cache)
    torch.testing.assert_close(step.logits[:, -1], want[:, 5], rtol=1e-5, atol=1e-5)


def test_skip_logits_returns_the_hidden_states_lm_head_reads():
    model = _model().eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, return_hidden=True)
        hidden_only = model(ids, skip_logits=True)
    assert hidden_only.logits is None
    torch.testing.assert_close(model.lm_head(hidden_only.hidden), full.logits, rtol=0, atol=0)
