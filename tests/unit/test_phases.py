"""Budget views (shared storage, same logits as the mask), think-then-answer budget control, multi-token markers."""

from __future__ import annotations

import pytest
import torch

from model.config import HybridConfig
from model.decode.budget_view import BudgetRegistry, budget_model, copied_bytes
from model.elastic import Architecture, extract, hard_mask
from model.generate import RowStart, SamplingParams, decode_rows, generate
from model.hybrid import HybridLM
from model.phases import (
    PhaseTokens,
    budget_control,
    carry_incompatibility,
    cut_thinking,
    drop_partial_marker,
    resume_target,
    think_then_answer,
)
from tests.conftest import TINY

MID = Architecture(hidden=24, moe_ffn=8, experts=3, shared_ffn=16)
SMALL = Architecture(hidden=16, mamba_heads=2, attn_heads=2, mlp_ffn=32, moe_ffn=8, shared_ffn=16, experts=2, depth=5)


@pytest.fixture(scope="module")
def full() -> HybridLM:
    torch.set_num_threads(1)
    model = HybridLM(HybridConfig(**TINY)).init_weights(1).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-trivial values where the init leaves constants (zero routers tie every expert)
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias", "conv1d.bias", "gate.weight")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _prompts(seeds: list[int], lengths: list[int]) -> list[list[int]]:
    out = []
    for s, n in zip(seeds, lengths, strict=True):
        g = torch.Generator().manual_seed(s)
        out.append(torch.randint(3, 64, (n,), generator=g).tolist())
    return out


PROMPTS = _prompts([1, 2, 3, 4, 5], [6, 6, 6, 8, 5])


def _decode(ids) -> str:
    return "".join(chr(65 + (i % 58)) for i in ids)


# ---------------------------------------------------------------------- budget views
@pytest.mark.parametrize("arch", [Architecture(), MID, SMALL, Architecture(attn_heads=2, mamba_heads=2)])
def test_budget_view_shares_storage_and_equals_the_mask(full, arch):
    view = budget_model(full, arch)
    assert view.mode == "view"
    storages = {t.untyped_storage().data_ptr() for t in full.parameters()}
    for name, p in view.named_parameters():
        if p.ndim >= 2 and "conv1d" not in name:  # every matrix is a view of the parent
            assert p.untyped_storage().data_ptr() in storages, name
    weight_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    assert copied_bytes(view, full) < 0.03 * weight_bytes  # only small per-channel Mamba tensors
    if arch.mamba_heads is None:
        assert copied_bytes(view, full) == 0 or arch.mamba_heads is None
    x = torch.randint(0, 64, (2, 13))
    with torch.no_grad():
        ref = full(x, mask=hard_mask(full.config, arch)).logits
        got = view(x).logits
        assert (got - ref).abs().max() <= 1e-5
        assert (got - extract(full, arch)(x).logits).abs().max() <= 1e-5
    assert view.num_parameters() == extract(full, arch).num_parameters()


def test_masked_fallback_and_registry(full):
    masked = budget_model(full, MID, prefer="masked")
    assert masked.mode == "masked" and masked.model is full.model and copied_bytes(masked, full) == 0
    x = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.allclose(masked(x).logits, full(x, mask=hard_mask(full.config, MID)).logits)
    with pytest.raises(ValueError, match="own mask"):
        masked(x, mask=hard_mask(full.config, MID))
    reg = BudgetRegistry(full, {"small": SMALL, "full": Architecture(), "mid": MID})
    assert reg.names == ["full", "mid", "small"]
    assert all(v < 0.03 * full.num_parameters() * 4 for v in reg.copied_bytes().values())
    with pytest.raises(ValueError, match=r"think_budget: unknown budget 'huge'.*\['full', 'mid', 'small'\]"):
        budget_control(reg, "huge", "full", PhaseTokens(1, frozenset({2})), PROMPTS, 4, 4)
    with pytest.raises(TypeError, match="extract"):
        reg.get("mid").save_pretrained("/nonexistent")


# ---------------------------------------------------------------------- thinking caps
def test_cut_thinking_hand_built():
    nl = frozenset({10})
    assert cut_thinking([1, 2, 10, 3, 4, 10, 5, 6], 8, nl) == [1, 2, 10, 3, 4, 10]
    assert cut_thinking([1, 2, 10, 3, 4, 10, 5, 6], 5, nl) == [1, 2, 10]
    assert cut_thinking([1, 2, 3, 4], 3, nl) == [1, 2, 3]  # no line break inside the cap: cut at the cap
    assert cut_thinking([1, 2, 10], 3, nl) == [1, 2, 10]
    assert cut_thinking([10, 1, 2], 3, nl) == [10]
    assert cut_thinking([], 3, nl) == []


def _free(model, prompts, n=12):
    return generate(model, prompts, SamplingParams(max_new_tokens=n))[0]


def test_cap_cuts_at_last_line_break_then_answers_from_the_cut(full):
    free = _free(full, PROMPTS)
    unused = next(i for i in range(64) if all(i not in f for f in free))
    breaks = frozenset({free[0][3], free[3][1]})
    tokens = PhaseTokens(think_close=unused, line_breaks=breaks, answer_stop_ids=(unused,))
    for cap in (0, 3, 12):
        res = think_then_answer(full, full, tokens, PROMPTS, cap, 5)
        kept = [cut_thinking(f, cap, breaks) for f in free]
        refs = generate(full, [p + k + [unused] for p, k in zip(PROMPTS, kept, strict=True)], SamplingParams(5))[0]
        for k, ref, r in zip(kept, refs, res, strict=True):
            assert r.think_tokens == k
            assert r.think_stop == ("none" if cap == 0 else "cap")
            assert r.answer_start == ("prefill" if cap == 0 else "continued")
            if cap:
                assert r.answer_fed <= 2  # only </think> (and an unfed cap token) is fed: no re-prefill
            assert r.answer_tokens == ref  # continuing from the cut state == decoding the cut text afresh


def test_close_token_ends_thinking(full):
    free = _free(full, PROMPTS)
    close = free[1][5]
    tokens = PhaseTokens(think_close=close, line_breaks=frozenset(), answer_stop_ids=(), decode=_decode)
    res = think_then_answer(full, full, tokens, PROMPTS, None, 4, think_limit=12)
    r = res[1]
    assert r.think_stop == "close" and r.think_tokens == free[1][: free[1].index(close)]
    assert r.think_text == _decode(r.think_tokens) and r.answer_text == _decode(r.answer_tokens)
    assert r.think_seconds > 0 and r.answer_seconds > 0


# ---------------------------------------------------------------------- elastic control and carried state
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=4)])
def test_elastic_with_the_same_budget_equals_standard_and_carry_equals_re_prefill(full, sampling):
    a, b = budget_model(full, MID), budget_model(full, MID)  # two objects: the elastic code path
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    free = _free(a, prompts)
    tokens = PhaseTokens(think_close=free[2][6], line_breaks=frozenset({free[0][2], free[1][4]}))
    runs = {}
    for cap in (3, None):
        std = think_then_answer(a, a, tokens, prompts, cap, 5, sampling, think_limit=9)
        ela = think_then_answer(a, b, tokens, prompts, cap, 5, sampling, think_limit=9)
        car = think_then_answer(a, b, tokens, prompts, cap, 5, sampling, carry_state=True, think_limit=9)
        assert {r.answer_start for r in std} == {"continued"}
        assert {r.answer_start for r in ela} == {"re_prefill"}
        assert {r.answer_start for r in car} == {"carried"}
        for x, y, z in zip(std, ela, car, strict=True):
            assert x.think_tokens == y.think_tokens == z.think_tokens
            assert x.answer_tokens == y.answer_tokens == z.answer_tokens
            assert z.answer_fed < y.answer_fed and z.carry_note is None
        runs[cap] = ela
    again = think_then_answer(a, b, tokens, prompts, 3, 5, sampling, think_limit=9)  # deterministic for a seed
    assert [r.answer_tokens for r in again] == [r.answer_tokens for r in runs[3]]


def test_carry_falls_back_when_cache_shapes_differ(full):
    small, big = budget_model(full, SMALL), budget_model(full, MID)
    assert "layers" in carry_incompatibility(small, big)
    assert carry_incompatibility(budget_model(full, Architecture(hidden=16)), big) is None
    heads = budget_model(full, Architecture(mamba_heads=2))
    assert "Mamba" in carry_incompatibility(heads, big)
    tokens = PhaseTokens(think_close=1, line_breaks=frozenset({2}))
    res = think_then_answer(heads, big, tokens, PROMPTS, 4, 3, carry_state=True)
    ref = think_then_answer(heads, big, tokens, PROMPTS, 4, 3)
    assert {r.answer_start for r in res} == {"re_prefill"} and "Mamba" in res[0].carry_note
    assert [r.answer_tokens for r in res] == [r.answer_tokens for r in ref]


def test_bad_requests(full):
    reg = BudgetRegistry(full, {"full": Architecture(), "mid": MID})
    tokens = PhaseTokens(think_close=1, line_breaks=frozenset({2}))
    with pytest.raises(ValueError, match="think_cap"):
        think_then_answer(full, full, tokens, PROMPTS, -1, 4)
    with pytest.raises(ValueError, match="think_cap"):
        budget_control(reg, "mid", "full", tokens, PROMPTS, -3, 4)
    with pytest.raises(ValueError, match="answer_budget: unknown budget 'tiny'"):
        budget_control(reg, "mid", "tiny", tokens, PROMPTS, 4, 4)
    with pytest.raises(ValueError, match="allow_think_larger"):
        budget_control(reg, "full", "mid", tokens, PROMPTS, 4, 4)
    ok = budget_control(reg, "full", "mid", tokens, PROMPTS[:1], 2, 2, allow_think_larger=True)
    assert len(ok) == 1
    with pytest.raises(ValueError, match="empty"):
        think_then_answer(full, full, tokens, [[]], 4, 4)


# ---------------------------------------------------------------------- multi-token close markers
def _first_close(tokens: list[int], close: tuple[int, ...]) -> int | None:
    """Slow reference: index where ``close`` first occurs in ``tokens`` (None if it never does)."""
    for j in range(len(tokens) - len(close) + 1):
        if tuple(tokens[j : j + len(close)]) == close:
            return j
    return None


def test_phase_tokens_take_an_id_or_a_sequence():
    assert PhaseTokens(7, frozenset()).think_close == (7,)
    assert PhaseTokens([7, 8], frozenset()).think_close == (7, 8)
    with pytest.raises(ValueError, match="think_close"):
        PhaseTokens((), frozenset())


def test_stop_sequences_are_suffix_matches(full):
    free = _free(full, PROMPTS, 16)
    pair = (free[0][6], free[0][7])
    outs = decode_rows(full, [RowStart(p) for p in PROMPTS], SamplingParams(16, stop_sequences=(pair,)))
    for f, o in zip(free, outs, strict=True):
        j = _first_close(f, pair)
        if j is None:
            assert o.tokens == f and o.stop_reason == "length"
        else:
            assert o.tokens == f[: j + 2] and o.stop_reason == "stop_sequence"
    # the sequence's last id alone (after any other id) does not stop a row
    last = free[0][7]
    never = next(t for t in range(64) if all(_first_close(f, (t, last)) is None for f in free))
    outs = decode_rows(full, [RowStart(p) for p in PROMPTS], SamplingParams(16, stop_sequences=((never, last),)))
    assert [o.tokens for o in outs] == free and {o.stop_reason for o in outs} == {"length"}
    with pytest.raises(ValueError, match="stop_sequences"):
        SamplingParams(stop_sequences=((),))


def test_multi_token_marker_closes_on_the_whole_sequence(full):
    free = _free(full, PROMPTS, 16)
    close = (free[1][2], free[1][3])  # a bigram the model produces in several rows
    tokens = PhaseTokens(think_close=close, line_breaks=frozenset(), decode=_decode)
    res = think_then_answer(full, full, tokens, PROMPTS, None, 5, think_limit=16)
    closed = 0
    for p, f, r in zip(PROMPTS, free, res, strict=True):
        j = _first_close(f, close)
        if j is not None and j + 2 <= 16:
            closed += 1
            assert r.think_stop == "close" and r.think_tokens == f[:j]
            assert r.answer_start == "continued" and r.answer_fed == 1  # only the marker's last id is fed
        else:
            assert r.think_stop == "limit" and r.think_tokens == f[:16]
        ref = generate(full, [p + r.think_tokens + list(close)], SamplingParams(5))[0][0]
        assert r.answer_tokens == ref  # continuing == decoding prompt + thinking + whole marker afresh
    assert closed >= 3
    # elastic re-prefill feeds prompt + thinking + the whole marker
    other = budget_model(full, Architecture())
    ela = think_then_answer(full, other, tokens, PROMPTS, None, 5, think_limit=16)
    for p, r, e in zip(PROMPTS, res, ela, strict=True):
        assert e.answer_start == "re_prefill" and e.answer_fed == len(p) + len(r.think_tokens) + 2
        assert e.answer_tokens == r.answer_tokens


def test_multi_token_cap_counts_tokens_between_the_markers(full):
    free = _free(full, PROMPTS, 16)
    close = (free[1][2], free[1][3])
    tokens = PhaseTokens(think_close=close, line_breaks=frozenset())
    cap = 4
    res = think_then_answer(full, full, tokens, PROMPTS, cap, 3)
    for f, r in zip(free, res, strict=True):
        j = _first_close(f, close)
        if j is not None and j <= cap - 1:  # thinking of at most cap-1 tokens, then the two marker ids
            assert r.think_stop == "close" and r.think_tokens == f[:j]
            assert r.think_generated == j + 2
        else:
            assert r.think_stop == "cap" and r.think_tokens == f[:cap] and r.think_generated == cap + 1
    # a cut that ends inside the marker drops the partial marker before appending the whole one
    broken = (free[1][2], next(t for t in range(64) if all(_first_close(f, (free[1][2], t)) is None for f in free)))
    tokens = PhaseTokens(think_close=broken, line_breaks=frozenset())
    r = think_then_answer(full, full, tokens, [PROMPTS[1]], 3, 3)[0]
    assert free[1][2] == broken[0] and r.think_stop == "cap" and r.think_tokens == free[1][:2]
    ref = generate(full, [PROMPTS[1] + free[1][:2] + list(broken)], SamplingParams(3))[0][0]
    assert r.answer_tokens == ref


def test_partial_marker_and_resume_target_hand_built():
    assert drop_partial_marker([1, 2, 7], (7, 8, 9)) == [1, 2]
    assert drop_partial_marker([1, 7, 8], (7, 8, 9)) == [1]
    assert drop_partial_marker([1, 7, 8, 9], (7, 8, 9)) == [1, 7, 8, 9]  # a whole marker is not partial
    assert drop_partial_marker([1, 2, 3], (7,)) == [1, 2, 3]
    assert drop_partial_marker([], (7, 8)) == []
    # closed on its own: the state consumed prompt + thinking + marker[:-1]; the marker's last id is left
    assert resume_target(5, [1, 2, 7, 8], [1, 2, 7, 8]) == 5 + 3
    # cut at a line break: the state must not have consumed past the kept thinking
    assert resume_target(5, [1, 10, 3, 4], [1, 10, 7, 8]) == 5 + 2
    # single-id marker: prompt + thinking, then the marker is fed
    assert resume_target(5, [1, 2, 7], [1, 2, 7]) == 5 + 2
    assert resume_target(5, [], [7]) == 5
