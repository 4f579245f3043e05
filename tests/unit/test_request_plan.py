"""The request planner: its checks, its choices and the one seeding rule, and that a planned row samples the same
tokens wherever it sits in a batch (``model.phases.think_then_answer``)."""

from __future__ import annotations

import pytest
import torch

from model.config import HybridConfig
from model.generate import SamplingParams, row_seed
from model.hybrid import HybridLM
from model.phases import PhaseTokens, think_then_answer
from model.request_plan import ChoiceSeeds, Fields, Limits, PlanError, Request, decode_seeds, phase_seed, plan
from tests.conftest import TINY

LIMITS = Limits({"full": 300, "mid": 200, "small": 100}, max_tokens_limit=64)
SERVER = Fields(answer="model", think="think_model", cap="reasoning_budget")


def test_the_seeding_rule():
    s = 1234
    assert ChoiceSeeds.of(s, 0) == ChoiceSeeds(row_seed(s, 0), row_seed(s, 1))  # choice 0: the request's seed
    assert ChoiceSeeds.of(s, 2) == ChoiceSeeds(row_seed(row_seed(s, 2), 0), row_seed(row_seed(s, 2), 1))
    assert phase_seed(s, 3, "plain") == phase_seed(s, 3, "think") == ChoiceSeeds.of(s, 3).plain
    assert ChoiceSeeds.of(None, 4) == ChoiceSeeds(None, None)
    every = [seed for k in range(8) for seed in (phase_seed(s, k, "think"), phase_seed(s, k, "answer"))]
    assert len(set(every)) == len(every)  # no two phases or choices share a stream
    assert decode_seeds([ChoiceSeeds.of(None)] * 2, "think") is None  # decode_rows draws fresh ones itself
    mixed = decode_seeds([ChoiceSeeds.of(s, 1), ChoiceSeeds.of(None)], "answer")
    assert mixed is not None and mixed[0] == phase_seed(s, 1, "answer") and isinstance(mixed[1], int)


def test_plan_gives_every_choice_its_phases_and_seeds():
    choices = plan(Request([5, 6, 7], "full", 8, think_model="small", think_cap=4, n=3, seed=9), LIMITS)
    assert [c.choice for c in choices] == [0, 1, 2]
    assert {(c.answer_model, c.think_model, c.think_cap, c.max_tokens) for c in choices} == {("full", "small", 4, 8)}
    assert [c.seeds for c in choices] == [ChoiceSeeds.of(9, k) for k in range(3)]
    (standard,) = plan(Request([5], "mid", 8), LIMITS)
    assert (standard.think_model, standard.think_cap) == ("mid", None)  # the answering budget thinks
    (plain,) = plan(Request([5], "mid", 8, thinks=False, think_cap=3), LIMITS)
    assert (plain.think_model, plain.think_cap) == (None, None)


@pytest.mark.parametrize(
    ("request_", "param", "match"),
    [
        (Request([1], "huge", 8), "model", r"model: unknown budget 'huge'; valid budgets \['full', 'mid', 'small'\]"),
        (Request([1], "mid", 8, think_model="tiny"), "think_model", "think_model: unknown budget 'tiny'"),
        (Request([1], "mid", 8, think_model="full"), "think_model", r"'full' \(300 active parameters\) is larger"),
        (Request([1], "mid", 0), "max_tokens", "max_tokens: must be an integer between 1 and 64, got 0"),
        (Request([1], "mid", 65), "max_tokens", "between 1 and 64, got 65"),
        (Request([1], "mid", 8, think_cap=-1), "reasoning_budget", "between 0 and 64, got -1"),
        (Request([1], "mid", 8, think_cap=True), "reasoning_budget", "got True"),
        (Request([1], "mid", 8, n=0), "n", "n: must be an integer >= 1"),
        (
            Request([1], "mid", 8, thinks=False, thinking_fields=("think_model", "reasoning_budget")),
            "think_model",
            "think_model / reasoning_budget: this prompt has no thinking phase .*'<think>'",
        ),
    ],
)
def test_plan_refuses_naming_the_callers_field(request_, param, match):
    with pytest.raises(PlanError, match=match) as err:
        plan(request_, LIMITS, SERVER)
    assert err.value.param == param
    assert err.value.unknown_budget == ("unknown budget" in str(err.value))


def test_a_larger_thinking_budget_when_allowed():
    allowed = Limits(LIMITS.active_params, allow_think_larger=True)
    (c,) = plan(Request([1], "small", 8, think_model="full"), allowed)
    assert (c.think_model, c.answer_model) == ("full", "small")


@pytest.fixture(scope="module")
def model() -> HybridLM:
    torch.set_num_threads(1)
    return HybridLM(HybridConfig(**TINY)).init_weights(2).eval()


def test_a_planned_choice_samples_the_same_wherever_it_sits(model):
    """Choices of one request, batched with another request's in two orders, sample the same tokens; another
    seed samples others."""
    g = torch.Generator().manual_seed(0)
    prompt, other_prompt = (torch.randint(3, 64, (n,), generator=g).tolist() for n in (7, 9))
    tokens = PhaseTokens(think_close=1, line_breaks=frozenset({2}))
    sampling = SamplingParams(temperature=1.0)
    limits = Limits({"full": 1})

    def run(seed: int, order: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        mine = plan(Request(prompt, "full", 6, think_cap=5, n=3, seed=seed), limits)
        other = plan(Request(other_prompt, "full", 6, think_cap=5, n=2, seed=seed + 1), limits)
        batch = [(mine + other)[i] for i in order]
        outs = think_then_answer(model, model, tokens, [c.prompt for c in batch], 5, 6, sampling,
                                 seeds=[c.seeds for c in batch])  # fmt: skip
        return {c.choice: (o.think_tokens, o.answer_tokens) for c, o in zip(batch, outs, strict=True) if c in mine}

    first = run(7, [0, 1, 2, 3, 4])
    assert first == run(7, [3, 2, 4, 0, 1])
    assert len({str(v) for v in first.values()}) > 1  # the choices differ
    assert run(8, [0, 1, 2, 3, 4]) != first
