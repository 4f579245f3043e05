"""One seeded request samples the same tokens on every path that serves it: over HTTP on the real server,
through the MLflow pyfunc (``mlflow.pyfunc.load_model(...).predict``) wherever the request sits in the input,
and through the evaluator's generation function (``model.phases.budget_control``) wherever its choices sit in
the batch. All three plan it with ``model.request_plan``; the model is the tiny random nested checkpoint
with the demo tokenizer (one token per character), sampled at temperature 1 so the seeds matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.serving_app import running_app

pytestmark = pytest.mark.integration

APP = "parity-test"
LIMITS = {"max_tokens_limit": 64, "default_max_tokens": 8, "think_limit": 16}
CONFIG = {
    **LIMITS,
    "api_key_env": None,
    "batch_wait_timeout_s": 0.02,
    "num_cpus_per_replica": 1,
    "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 4},
}
MESSAGES = [{"role": "user", "content": "Q:7+5*3-2\n"}]
OTHER = [{"role": "user", "content": "Q:4-2*3\n"}]
N, CAP, MAX_TOKENS, SEED = 3, 10, 10, 21
SAMPLING = {"temperature": 1.0, "top_p": 0.95}
"""Elastic budget control: ``small`` thinks, ``full`` answers."""


@pytest.fixture(scope="module")
def oai(serve_http, tiny_nested_checkpoint):
    import openai

    with running_app(APP, tiny_nested_checkpoint, CONFIG, serve_http) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pyfunc(tiny_nested_checkpoint, tmp_path_factory):
    """The pyfunc as the registry holds it (models-from-code, the checkpoint as an artifact), saved locally."""
    import mlflow

    import components.mlflow_model as mm

    path = tmp_path_factory.mktemp("pyfunc") / "model"
    mlflow.pyfunc.save_model(
        path, python_model=str(Path(mm.__file__).with_name("mlflow_model_code.py")),
        artifacts={mm.CHECKPOINT_ARTIFACT: str(tiny_nested_checkpoint)}, code_paths=mm.code_paths(),
        pip_requirements=mm.pip_requirements(), model_config=LIMITS,
    )  # fmt: skip
    return mlflow.pyfunc.load_model(str(path))


@pytest.fixture(scope="module")
def loaded(tiny_nested_checkpoint):
    from components.serving.config import ServingConfig
    from components.serving.loading import LoadedModel

    return LoadedModel.load(tiny_nested_checkpoint, ServingConfig(api_key_env=None, **LIMITS))


def evaluate_path(loaded, seed: int) -> list[tuple[str, str, list[str], int]]:
    """Choices ``0..N-1`` of the request through ``budget_control``, in one batch with another request's choices
    and in shuffled positions: per choice (reasoning, answer text, answer tokens, thinking tokens decoded)."""
    from components.eval_sets import thinking_prompt
    from components.serving.prompts import PromptRules
    from model.generate import SamplingParams
    from model.phases import budget_control
    from model.request_plan import Limits, Request, plan

    tok, rules = loaded.tokenizer, PromptRules(loaded.tokenizer)
    prompt = thinking_prompt(tok, MESSAGES)
    assert prompt == rules.chat(MESSAGES)[0]  # the evaluator's prompt is the server's
    limits = Limits(loaded.registry.active_params)
    mine = plan(Request(prompt, "full", MAX_TOKENS, think_model="small", think_cap=CAP, n=N, seed=seed), limits)
    other = plan(Request(thinking_prompt(tok, OTHER), "full", MAX_TOKENS, think_model="small", think_cap=CAP, n=2,
                         seed=seed + 100), limits)  # fmt: skip
    batch = [other[0], mine[2], mine[0], other[1], mine[1]]
    outs = budget_control(
        loaded.registry, "small", "full", loaded.tokens, [c.prompt for c in batch], CAP, MAX_TOKENS,
        SamplingParams(**SAMPLING), seeds=[c.seeds for c in batch],
    )  # fmt: skip
    got, ours = {}, {id(c) for c in mine}
    for c, o in zip(batch, outs, strict=True):
        if id(c) in ours:
            answer = o.answer_tokens[:-1] if o.answer_stop == "stop_id" else o.answer_tokens
            texts = (rules.visible_text(o.think_tokens), rules.visible_text(answer))
            got[c.choice] = (*texts, [tok.decode([i]) for i in o.answer_tokens], o.think_generated)
    return [got[k] for k in range(N)]


def test_a_seeded_request_samples_the_same_tokens_on_every_path(oai, pyfunc, loaded):
    reference = evaluate_path(loaded, SEED)
    assert len({(r[0], r[1]) for r in reference}) > 1  # the choices differ: each samples with its own seeds
    assert evaluate_path(loaded, SEED + 1) != reference  # another seed samples other tokens

    # (a) over HTTP: n choices of one request
    http = oai.chat.completions.create(
        model="full", messages=MESSAGES, n=N, max_tokens=MAX_TOKENS, seed=SEED, logprobs=True, **SAMPLING,
        extra_body={"think_model": "small", "reasoning_budget": CAP},
    )  # fmt: skip
    over_http = [
        (c.message.reasoning_content, c.message.content, [e.token for e in c.logprobs.content]) for c in http.choices
    ]
    assert over_http == [r[:3] for r in reference]

    # (b) the MLflow model: the request first, then third, among requests it shares a batched call with
    request = {"messages": MESSAGES, "budget": "full", "think_model": "small", "reasoning_budget": CAP,
               "max_tokens": MAX_TOKENS, "seed": SEED, "n": N, **SAMPLING}  # fmt: skip
    others = [{**request, "seed": SEED + 100, "n": 2}, {**request, "messages": OTHER}]
    first = pyfunc.predict([request, *others])[0]
    third = pyfunc.predict([*others, request])[2]
    assert first.model_dump() == third.model_dump()
    assert (first.text, first.reasoning) == (first.choices[0].text, first.choices[0].reasoning)
    via_mlflow = [(c.reasoning, c.text, c.completion_tokens - c.reasoning_tokens, c.reasoning_tokens)
                  for c in first.choices]  # fmt: skip
    assert via_mlflow == [(r[0], r[1], len(r[2]), r[3]) for r in reference]
