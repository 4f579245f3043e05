"""Batched decoding: greedy equals the step-by-step argmax, sampling is seeded, stops and resumed states."""

from __future__ import annotations

import pytest
import torch

from model.config import HybridConfig
from model.generate import (
    RowStart,
    SamplingParams,
    decode_rows,
    generate,
    rewind,
    truncate_at_stop,
)
from model.hybrid import HybridLM
from tests.conftest import TINY


@pytest.fixture(scope="module")
def model() -> HybridLM:
    torch.set_num_threads(1)
    return HybridLM(HybridConfig(**TINY)).init_weights(1).eval()


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]


def _decode(ids) -> str:
    """A stub tokenizer: every id is one character."""
    return "".join(chr(65 + (i % 58)) for i in ids)


@torch.no_grad()
def test_greedy_equals_argmax_of_full_forward(model):
    prompts = _prompts([5, 7, 5])
    tokens, stopped = generate(model, prompts, SamplingParams(max_new_tokens=8))
    assert stopped == [False] * 3
    for p, out in zip(prompts, tokens, strict=True):
        seq = list(p)
        for _ in range(8):  # no cache: the whole sequence every step
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out == seq[len(p) :]


def test_sampling_is_deterministic_for_a_seed_and_batch_independent(model):
    prompts = _prompts([4, 6, 4, 6])
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a, _ = generate(model, prompts, params)
    b, _ = generate(model, prompts, params)
    assert a == b
    c, _ = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=8))
    assert a != c
    # a row's draw depends on its seed, not on its batch neighbours
    rows = decode_rows(model, [RowStart(prompts[2])], params, seeds=[decode_rows_seed(params, 2)])
    assert rows[0].tokens == a[2]


def decode_rows_seed(params: SamplingParams, row: int) -> int:
    from model.generate import row_seed

    return row_seed(params.seed, row)


def test_stop_ids_end_rows_and_are_kept(model):
    prompts = _prompts([5, 6])
    free, _ = generate(model, prompts, SamplingParams(max_new_tokens=8))
    stop = free[0][3]
    tokens, stopped = generate(model, prompts, SamplingParams(max_new_tokens=8, stop_ids=(stop,)))
    first = free[0].index(stop)
    assert tokens[0] == free[0][: first + 1] and stopped[0]
    if stop not in free[1]:
        assert tokens[1] == free[1] and not stopped[1]


def test_stop_strings_check_decoded_tails(model):
    prompts = _prompts([5, 5])
    free, _ = generate(model, prompts, SamplingParams(max_new_tokens=10))
    target = _decode(free[0][4:6])  # a two-character string spanning two tokens
    tokens, stopped = generate(model, prompts, SamplingParams(max_new_tokens=10, stop=(target,)), decode=_decode)
    end = _decode(free[0]).find(target) + len(target)
    assert tokens[0] == free[0][:end] and stopped[0]
    assert truncate_at_stop(_decode(tokens[0]), [target]) == _decode(free[0])[: end - 2]
    with pytest.raises(ValueError, match="decode"):
        generate(model, prompts, SamplingParams(max_new_tokens=2, stop=("x",)))


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=("",))
    assert generate(model, [[5]], SamplingParams(max_new_tokens=0)) == ([[]], [False])


def test_resuming_from_a_saved_state_equals_decoding_through(model):
    """A row's final state (and a rewound line-break snapshot) continue exactly like one long decode."""
    prompt = _prompts([6], seed=2)[0]  # a prompt whose greedy continuation does not repeat at once
    free, _ = generate(model, [prompt], SamplingParams(max_new_tokens=12))
    mark = free[0][4]
    j = max(i for i, t in enumerate(free[0][:-1]) if t == mark)  # the latest fed occurrence
    out = decode_rows(
        model, [RowStart(prompt)], SamplingParams(max_new_tokens=12), keep_state=True, snapshot_ids=[mark]
    )
    row = out[0]
    assert row.state.length == len(prompt) + 11 and row.snapshot.length == len(prompt) + j + 1
    # continue from the final state: feed the last (unfed) token
    tail = decode_rows(model, [RowStart(row.tokens[-1:], row.state)], SamplingParams(max_new_tokens=4))[0].tokens
    ref, _ = generate(model, [prompt + row.tokens], SamplingParams(max_new_tokens=4))
    assert tail == ref[0]
    # resume from the snapshot (Mamba) + truncated KV: as if generation had been cut after the mark
    state = rewind(row.state, row.snapshot)
    extra = [9, 10]
    tail = decode_rows(model, [RowStart(extra, state)], SamplingParams(max_new_tokens=4))[0].tokens
    ref, _ = generate(model, [prompt + row.tokens[: j + 1] + extra], SamplingParams(max_new_tokens=4))
    assert tail == ref[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_take_the_first_largest_logit_in_any_dtype(dtype):
    """Half precision is compared in float32 (exactly), so the pick is the logits' own argmax, ties to the
    lowest id, in the logits' own dtype."""
    from model.generate import greedy_tokens

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, 17] = logits[1, 700] = logits[1].max() + 1  # a tie: the lower id wins
    picks = greedy_tokens(logits)
    assert picks.tolist() == logits.argmax(-1).tolist()
    assert picks[1].item() == 17
    assert greedy_tokens(logits[0]).item() == picks[0].item()
