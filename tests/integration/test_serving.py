"""The serving application for real: Ray Serve on a local Ray, HTTP on loopback, httpx and the openai client.

One app per module (``serve.run`` costs ~10 s here) over a tiny random nested checkpoint with three
budgets and the demo tokenizer (one token per character, its chat template). The model's text is
random; the tests check the protocol (log-probabilities against the model's own forward pass,
``echo``, ``n``, lists of prompts, neutral values of unsupported fields), budget routing, budget
control (standard and elastic), streaming against non-streaming, errors, and that the replica survives.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.integration.serving_app import running_app

pytestmark = pytest.mark.integration

APP = "serving-test"
KEY = "sk-test-key"
BUDGETS = ["full", "medium", "small"]
CONFIG = {
    "api_key": KEY,
    "max_request_bytes": 4096,
    "max_tokens_limit": 64,
    "default_max_tokens": 8,
    "think_limit": 16,
    "max_prompt_tokens": 200,
    "batch_wait_timeout_s": 0.02,
    "max_ongoing_requests": 16,
    "max_queued_requests": 32,
    "num_cpus_per_replica": 1,
    "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 4},
}
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "Q:7+5*3-2\n"}]
PROMPT_TOKENS = 1 + len("Be brief.\n") + len("Q:7+5*3-2\n") + 1  # <bos>, one token per character, <think>
SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>", "<think>", "</think>")


@pytest.fixture(scope="module")
def base_url(serve_http, tiny_nested_checkpoint):
    with running_app(APP, tiny_nested_checkpoint, CONFIG, serve_http) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_body(model: str, **kw) -> dict:
    return {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 6, "reasoning_budget": 6, **kw}


def read_sse(response: httpx.Response) -> list[dict | str]:
    """Parse an SSE body strictly: every event is ``data: ...`` followed by a blank line."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]"
    return events


# ---------------------------------------------------------------------- models
def test_models_lists_every_budget_with_parameter_counts(http, tiny_nested_checkpoint):
    section = json.loads((tiny_nested_checkpoint / "config.json").read_text())["elastic"]
    data = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == BUDGETS
    for card, budget in zip(data, section["budgets"], strict=True):
        assert card["active_params"] == budget["active_params"]
        assert card["total_params"] == budget["total_params"]
        assert card["format"] == "dense"
    assert data[0]["active_params"] > data[1]["active_params"] > data[2]["active_params"]
    assert http.get("/v1/models/small").json()["id"] == "small"
    assert http.get("/v1/models/nope").status_code == 404


def test_one_weight_copy_serves_every_budget(http):
    stats = http.get("/stats").json()
    assert stats["models"] == BUDGETS
    assert stats["copied_bytes"]["full"] == 0 and stats["copied_bytes"]["medium"] == 0
    assert stats["copied_bytes"]["small"] < 0.05 * stats["weight_bytes"]  # conv channels only
    assert stats["decode_steps"] == {name: "compiled steps off" for name in BUDGETS}  # the suite's default


# ---------------------------------------------------------------------- chat: httpx
@pytest.mark.parametrize("model", BUDGETS)
def test_chat_every_budget_stream_and_not(http, model):
    r = http.post("/v1/chat/completions", json=chat_body(model))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == model
    msg, usage = body["choices"][0]["message"], body["usage"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str) and isinstance(msg["reasoning_content"], str)
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] <= 6
    assert usage["completion_tokens"] > usage["completion_tokens_details"]["reasoning_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == PROMPT_TOKENS  # the system message and the template's tokens count
    assert body["budget_control"]["think_model"] == model and body["budget_control"]["answer_start"] == "continued"

    streamed = http.post(
        "/v1/chat/completions", json=chat_body(model, stream=True, stream_options={"include_usage": True})
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = read_sse(streamed)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])  # greedy: same text either way
    assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    assert events[-2]["usage"] == usage


def test_reasoning_budget_zero_answers_directly(http):
    body = http.post("/v1/chat/completions", json=chat_body("medium", reasoning_budget=0)).json()
    assert body["choices"][0]["message"]["reasoning_content"] == ""
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert body["budget_control"]["think_stop"] == "none"


def test_seeded_sampling_is_reproducible_and_stop_strings_are_cut(http):
    req = chat_body("small", temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    a, b = (http.post("/v1/chat/completions", json=req).json()["choices"][0] for _ in range(2))
    assert a == b
    text = a["message"]["content"]
    if len(text) >= 3:  # stop at a string the unconstrained answer contains: it ends there, without it
        stop = text[1:3]
        cut = http.post("/v1/chat/completions", json={**req, "stop": [stop]}).json()["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["message"]["content"] == text[: text.find(stop)]


# ---------------------------------------------------------------------- the official client
@pytest.mark.parametrize("model", BUDGETS)
def test_openai_client_every_budget(oai, model):
    resp = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0)
    assert resp.model == model and resp.choices[0].message.content is not None
    assert isinstance(resp.choices[0].message.reasoning_content, str)
    assert resp.usage.completion_tokens_details.reasoning_tokens > 0
    stream = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0, stream=True)
    content = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert content == resp.choices[0].message.content


def test_openai_client_elastic_pair(oai, http):
    extra = {"think_model": "small", "reasoning_budget": 5}
    resp = oai.chat.completions.create(model="full", messages=MESSAGES, max_tokens=5, temperature=0, extra_body=extra)
    control = resp.model_extra["budget_control"]
    assert control["think_model"] == "small" and control["answer_model"] == "full"
    assert control["answer_start"] == "re_prefill"  # elastic: prompt + thinking re-read by the answering budget
    assert resp.usage.completion_tokens_details.reasoning_tokens <= 5
    stream = oai.chat.completions.create(
        model="full", messages=MESSAGES, max_tokens=5, temperature=0, extra_body=extra, stream=True
    )
    chunks = [c for c in stream if c.choices]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == resp.choices[0].message.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == resp.choices[0].message.content
    # the same thinking, answered by the thinking budget itself (standard control on `small`)
    alone = http.post("/v1/chat/completions", json=chat_body("small", reasoning_budget=5, max_tokens=5)).json()
    assert alone["choices"][0]["message"]["reasoning_content"] == resp.choices[0].message.reasoning_content


def test_openai_client_completions(oai):
    plain = oai.completions.create(model="medium", prompt="<bos>Q:1+2\n", max_tokens=4, temperature=0)
    assert plain.choices[0].model_extra["reasoning_content"] is None and plain.usage.completion_tokens <= 4
    thinking = oai.completions.create(
        model="full", prompt="<bos>Q:1+2\n<think>", max_tokens=4, temperature=0,
        extra_body={"think_model": "medium", "reasoning_budget": 3},
    )  # fmt: skip
    assert thinking.usage.completion_tokens_details.reasoning_tokens <= 3
    streamed = oai.completions.create(model="medium", prompt="<bos>Q:1+2\n", max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


# ---------------------------------------------------------------------- the OpenAI API as clients use it
PROMPT = "<bos>Q:1+2\n"
PROMPT_IDS = [1, 57, 34, 25, 19, 26, 7]  # <bos> Q : 1 + 2 \n in the demo vocabulary (char c -> 8 + ord(c) - 32)


@pytest.fixture(scope="module")
def reference(tiny_nested_checkpoint):
    """The budgets' own forward pass, in this process: log-probabilities of every prompt position."""
    from components.serving.config import ServingConfig
    from components.serving.loading import LoadedModel

    loaded = LoadedModel.load(tiny_nested_checkpoint, ServingConfig(api_key_env=None))

    def logprobs(budget: str, ids: list[int]) -> list[float]:
        import torch

        with torch.inference_mode():
            logits = loaded.registry.get(budget)(torch.tensor([ids])).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]

    return logprobs


def test_completions_integer_logprobs_with_echo_as_vllm(oai, reference):
    """lm-evaluation-harness's log-likelihood request: max_tokens 1, logprobs 1, echo, a token-id prompt."""
    ctx = PROMPT_IDS[:4]  # context <bos>Q:1 ; continuation +2\n
    out = oai.completions.create(model="medium", prompt=PROMPT_IDS, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    assert lp.tokens[:7] == ["<bos>", "Q", ":", "1", "+", "2", "\n"] and len(lp.tokens) == 8  # prompt + 1 sampled
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.token_logprobs[1:7] == pytest.approx(reference("medium", PROMPT_IDS), abs=1e-4)
    assert lp.text_offset == [0, 5, 6, 7, 8, 9, 10, 11]  # characters of the token strings: "<bos>" is 5
    for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
        assert token in top and 1 <= len(top) <= 2  # the token itself plus its best alternative
    assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]  # greedy: the sampled token is the best
    assert out.choices[0].text.startswith(PROMPT)  # echo: the prompt, then what was generated
    continuation = sum(lp.token_logprobs[len(ctx) : -1])  # what lm-eval sums for the continuation
    assert continuation == pytest.approx(sum(reference("medium", PROMPT_IDS)[len(ctx) - 1 :]), abs=1e-4)
    text = oai.completions.create(model="medium", prompt=PROMPT, max_tokens=1, logprobs=0, echo=True, temperature=0)
    assert text.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert all(top is None or len(top) == 1 for top in text.choices[0].logprobs.top_logprobs)  # logprobs=0
    plain = oai.completions.create(model="medium", prompt=PROMPT, max_tokens=3, logprobs=2, temperature=0)
    assert len(plain.choices[0].logprobs.tokens) == plain.usage.completion_tokens  # no echo: generated only


def test_completions_list_of_prompts_and_n(oai):
    prompts = [PROMPT, "<bos>Q:3*3-1\n"]
    kw = {"model": "small", "max_tokens": 4, "temperature": 0.9, "seed": 5}
    out = oai.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt * n + choice, as vLLM numbers them
    assert out.usage.prompt_tokens == 7 + 9  # each prompt counted once
    assert out.usage.completion_tokens == sum(
        oai.completions.create(prompt=p, n=2, **kw).usage.completion_tokens for p in prompts
    )
    alone = [oai.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert [out.choices[0].text, out.choices[2].text] == alone  # choice 0 of each prompt: the request's seed
    by_ids = oai.completions.create(prompt=[PROMPT_IDS, PROMPT_IDS], **kw)
    assert [c.text for c in by_ids.choices] == [alone[0], alone[0]]  # token ids and text give the same tokens
    streamed = oai.completions.create(prompt=prompts, n=2, stream=True, **kw)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]


def test_chat_n_and_top_logprobs(oai):
    kw = {"model": "medium", "messages": MESSAGES, "max_tokens": 5, "temperature": 1.0, "seed": 7}
    out = oai.chat.completions.create(n=3, logprobs=True, top_logprobs=3, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content + c.message.reasoning_content for c in out.choices}) > 1  # the choices differ
    for choice in out.choices:
        entries = choice.logprobs.content
        assert "".join(e.token for e in entries if e.token not in SPECIAL) == choice.message.content
        for e in entries:
            assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
            assert len(e.top_logprobs) == 3 and e.logprob <= e.top_logprobs[0].logprob
            assert e.bytes == list(e.token.encode())
    one = oai.chat.completions.create(**kw)
    assert one.choices[0].message.content == out.choices[0].message.content  # choice 0 keeps the request's seed
    plain = oai.chat.completions.create(logprobs=True, **{**kw, "temperature": 0})
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)  # no top_logprobs asked
    stream = oai.chat.completions.create(logprobs=True, stream=True, **{**kw, "temperature": 0})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in plain.choices[0].logprobs.content]


def test_neutral_values_of_unsupported_fields_are_accepted(oai):
    chat = oai.chat.completions.create(
        model="small", messages=MESSAGES, max_tokens=3, temperature=0, n=1, presence_penalty=0, frequency_penalty=0,
        logit_bias={}, parallel_tool_calls=False, tools=[], tool_choice="none", response_format={"type": "text"},
        store=False, user="u-1", service_tier="auto", stream_options=None,
    )  # fmt: skip
    assert chat.choices[0].message.content is not None
    legacy = oai.completions.create(
        model="small", prompt=PROMPT, max_tokens=3, temperature=0, best_of=1, logit_bias={}, presence_penalty=0,
        frequency_penalty=0, suffix=None, user="u-1", echo=False,
    )  # fmt: skip
    assert legacy.choices[0].text is not None


def test_returned_text_never_holds_special_tokens(oai):
    """Sampled at a high temperature, the random model emits special tokens; none reaches the client."""
    out = oai.completions.create(model="full", prompt=[PROMPT] * 4, max_tokens=48, temperature=2.0, seed=3, logprobs=0)
    raw = [t for c in out.choices for t in c.logprobs.tokens]
    assert any(t in SPECIAL for t in raw)  # the model did generate some (this seed: checked once, fixed)
    for c in out.choices:
        assert not any(t in c.text for t in SPECIAL), c.text
    chat = oai.chat.completions.create(
        model="full",
        messages=MESSAGES,
        max_tokens=48,
        temperature=2.0,
        seed=3,
        n=4,
        extra_body={"reasoning_budget": 48},
    )
    for c in chat.choices:
        assert not any(t in c.message.content or t in c.message.reasoning_content for t in SPECIAL)


# ---------------------------------------------------------------------- errors
def _corpus() -> list[tuple[str, dict, int, str]]:
    """(what, request kwargs, expected status, expected `param` or message fragment)."""
    ok = chat_body("full")
    post = lambda body, **kw: {"method": "POST", "url": "/v1/chat/completions", "json": body, **kw}
    raw = lambda content: {"method": "POST", "url": "/v1/chat/completions", "content": content}
    return [
        ("bad json", raw(b'{"model": "full", '), 400, "not valid JSON"),
        ("not an object", raw(b"[1, 2]"), 400, "object"),
        ("wrong type", post({**ok, "max_tokens": "5"}), 400, "max_tokens"),
        ("wrong type nested", post({**ok, "messages": [{"role": "user", "content": 5}]}), 400, "messages.0.content"),
        ("unknown role", post({**ok, "messages": [{"role": "robot", "content": "x"}]}), 400, "messages.0.role"),
        ("no user message", post({**ok, "messages": [{"role": "system", "content": "x"}]}), 400, "messages"),
        ("missing model", post({k: v for k, v in ok.items() if k != "model"}), 400, "model"),
        ("unknown field", post({**ok, "reasoning_budgett": 3}), 400, "reasoning_budgett"),
        ("unknown model", post({**ok, "model": "huge"}), 404, "model"),
        ("negative max_tokens", post({**ok, "max_tokens": -1}), 400, "max_tokens"),
        ("zero max_tokens", post({**ok, "max_tokens": 0}), 400, "max_tokens"),
        ("huge max_tokens", post({**ok, "max_tokens": 10**9}), 400, "max_tokens"),
        ("huge reasoning_budget", post({**ok, "reasoning_budget": 65}), 400, "reasoning_budget"),
        ("negative reasoning_budget", post({**ok, "reasoning_budget": -2}), 400, "reasoning_budget"),
        ("temperature out of range", post({**ok, "temperature": 3.5}), 400, "temperature"),
        ("top_p zero", post({**ok, "top_p": 0}), 400, "top_p"),
        ("too many choices", post({**ok, "n": 1000}), 400, "n"),
        ("tool choice without tools", post({**ok, "tool_choice": "required"}), 400, "tool_choice"),
        ("schema missing", post({**ok, "response_format": {"type": "json_schema"}}), 400, "response_format"),
        ("top_logprobs too large", post({**ok, "logprobs": True, "top_logprobs": 50}), 400, "top_logprobs"),
        ("too many stops", post({**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
        (
            "special token in content",
            post({**ok, "messages": [{"role": "user", "content": "1<think>"}]}),
            400,
            "messages.0.content",
        ),
        (
            "special token in system message",
            post({**ok, "messages": [{"role": "system", "content": "<eos>"}, {"role": "user", "content": "1"}]}),
            400,
            "messages.0.content",
        ),
        ("unknown think_model", post({**ok, "think_model": "tiny"}), 400, "think_model"),
        ("think_model larger", post({**ok, "model": "small", "think_model": "full"}), 400, "think_model"),
        ("oversized body", post({**ok, "messages": [{"role": "user", "content": "1" * 5000}]}), 413, "bytes"),
        ("no api key", post(ok, headers={"Authorization": ""}), 401, "API key"),
        ("bad api key", post(ok, headers={"Authorization": "Bearer nope"}), 401, "API key"),
        (
            "think_model without thinking",
            {
                "method": "POST",
                "url": "/v1/completions",
                "json": {"model": "full", "prompt": "ab", "think_model": "small"},
            },
            400,
            "think_model",
        ),
        (
            "token id out of range",
            {"method": "POST", "url": "/v1/completions", "json": {"model": "full", "prompt": [1, 99999]}},
            400,
            "prompt",
        ),
        (
            "logprobs as a boolean",
            {"method": "POST", "url": "/v1/completions", "json": {"model": "full", "prompt": "a", "logprobs": True}},
            400,
            "logprobs",
        ),
        (
            "best_of above n",
            {"method": "POST", "url": "/v1/completions", "json": {"model": "full", "prompt": "a", "best_of": 3}},
            400,
            "best_of",
        ),
        (
            "echo of a thinking prompt",
            {
                "method": "POST",
                "url": "/v1/completions",
                "json": {"model": "full", "prompt": "<bos>Q:1\n<think>", "echo": True, "logprobs": 0},
            },
            400,
            "echo",
        ),
        ("unknown route", {"method": "GET", "url": "/v1/nothing"}, 404, "Not Found"),
        ("wrong method", {"method": "GET", "url": "/v1/chat/completions"}, 405, "Method Not Allowed"),
    ]


def test_malformed_requests_are_clear_4xx_and_the_replica_survives(http, base_url):
    from ray import serve

    before = http.get("/health").json()
    for what, kwargs, status, fragment in _corpus():
        r = http.request(**kwargs)
        assert r.status_code == status, (what, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, what
        assert fragment in err["message"] or fragment == err["param"], (what, err)
        assert err["message"], what
    after = httpx.get(f"{base_url}/health", timeout=30)  # probes need no key
    assert after.status_code == 200 and after.json()["status"] == "ok"
    assert (after.json()["pid"], after.json()["started_at"]) == (before["pid"], before["started_at"])
    status = serve.status().applications[APP]
    assert status.status == "RUNNING"
    assert http.post("/v1/chat/completions", json=chat_body("small")).status_code == 200


def test_metrics_per_budget(http):
    for budget in ("full", "medium", "small"):  # its own requests: the module's other tests may not run first
        assert http.post("/v1/chat/completions", json=chat_body(budget)).status_code == 200
    assert http.post("/v1/chat/completions", json={**chat_body("medium"), "max_tokens": "5"}).status_code == 400
    stats = http.get("/stats").json()
    assert stats["metrics_exported_to_ray"] is True
    ok = {(r["budget"], r["route"]) for r in stats["metrics"]["requests"] if r["status"] == 200}
    assert {("full", "chat"), ("medium", "chat"), ("small", "chat")} <= ok
    assert any(r["status"] == 400 for r in stats["metrics"]["requests"])
    kinds = {(t["budget"], t["kind"]) for t in stats["metrics"]["tokens"]}
    assert ("medium", "reasoning") in kinds and ("medium", "completion") in kinds
    assert stats["rss_bytes"] > stats["weight_bytes"] > 0
    from prometheus_client.parser import text_string_to_metric_families

    scrape = httpx.get(str(http.base_url.join("/metrics")), timeout=30)  # on the serving port, no key needed
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    samples = {(s.name, s.labels.get("budget"), s.labels.get("status")): s.value
               for f in text_string_to_metric_families(scrape.text) for s in f.samples}  # fmt: skip
    assert samples[("star_elastic_requests_total", "medium", "200")] >= 1
    assert samples[("star_elastic_engine_up", None, None)] == 1


# ---------------------------------------------------------------------- the engine against the reference
def test_engine_matches_think_then_answer(tiny_nested_checkpoint):
    """The server's incremental loop gives what model.phases.think_then_answer gives (batched, seeded)."""
    from components.serving.config import ServingConfig
    from components.serving.engine import Engine
    from components.serving.job import Job
    from components.serving.loading import LoadedModel
    from model.generate import SamplingParams
    from model.phases import think_then_answer

    cfg = ServingConfig(api_key_env=None, think_limit=12)
    loaded = LoadedModel.load(tiny_nested_checkpoint, cfg)
    engine = Engine(loaded, cfg).start()
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in ("<bos>Q:1+2*3\n<think>", "<bos>Q:4-2*3\n<think>", "<bos>Q:4-2\n<think>")]

    async def serve_all(think: str, answer: str, cap: int | None, sampling: SamplingParams):
        loop = asyncio.get_running_loop()
        jobs = [Job(p, answer, think, cap, 8, sampling, (), True, loop) for p in prompts]
        for job in jobs:
            engine.submit(job)
        out = []
        for job in jobs:
            deltas = []
            while (event := await job.events.get())[1] not in ("done", "error"):
                deltas.append(event[1:])
            assert event[1] == "done", event
            out.append((event[2], deltas))
        return out

    try:
        for think, answer in [("medium", "medium"), ("small", "full")]:  # standard and elastic control
            for cap in (None, 0, 3):
                for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)):
                    got = asyncio.run(serve_all(think, answer, cap, sampling))
                    for p, (res, deltas) in zip(prompts, got, strict=True):
                        ref = think_then_answer(
                            loaded.registry.get(think), loaded.registry.get(answer), loaded.tokens, [p], cap, 8,
                            sampling, think_limit=12,
                        )[0]  # fmt: skip
                        assert (res.reasoning_ids, res.answer_ids) == (ref.think_tokens, ref.answer_tokens)
                        ans = ref.answer_tokens[:-1] if ref.answer_stop == "stop_id" else ref.answer_tokens
                        assert (res.reasoning, res.content) == (engine.text(ref.think_tokens), engine.text(ans))
                        assert (res.think_stop, res.answer_start) == (ref.think_stop, ref.answer_start)
                        assert res.reasoning_tokens == ref.think_generated
                        assert "".join(d for k, d in deltas if k == "reasoning") == res.reasoning
                        assert "".join(d[0] for k, d in deltas if k == "content") == res.content
        stats = engine.snapshot_stats()
        assert stats["max_batch_size"] >= 3  # prompts of two lengths decoded in one batch
        assert stats["merged_groups"] >= 1
    finally:
        engine.stop()


@pytest.mark.parametrize("merge", [True, False])
def test_requests_join_a_batch_that_is_already_decoding(tiny_nested_checkpoint, merge):
    """A request arriving while another decodes joins its batch at the next step (a shorter KV history,
    left-padded) and still gets exactly what it gets alone; with merging off it decodes in its own batch."""
    from components.serving.config import ServingConfig
    from components.serving.engine import Engine
    from components.serving.job import Job
    from components.serving.loading import LoadedModel
    from model.generate import SamplingParams
    from model.phases import think_then_answer

    cfg = ServingConfig(api_key_env=None, think_limit=48, merge_running_batches=merge)
    loaded = LoadedModel.load(tiny_nested_checkpoint, cfg)
    engine = Engine(loaded, cfg).start()
    tok = loaded.tokenizer
    first = tok.encode("<bos>Q:1+2*3-4*5+6\n<think>")
    later = [tok.encode(p) for p in ("<bos>Q:4-2\n<think>", "<bos>Q:7*7+1\n<think>")]

    async def serve() -> list:
        loop = asyncio.get_running_loop()
        jobs = [Job(first, "medium", "medium", None, 96, SamplingParams(), (), True, loop)]
        engine.submit(jobs[0])
        event = await jobs[0].events.get()  # the first request is decoding: it has streamed its thinking
        assert event[1] == "reasoning", event
        for p in later:
            jobs.append(Job(p, "medium", "medium", None, 24, SamplingParams(), (), False, loop))
            engine.submit(jobs[-1])
        out = []
        for job in jobs:
            while (event := await job.events.get())[1] not in ("done", "error"):
                pass
            assert event[1] == "done", event
            out.append(event[2])
        return out

    try:
        got = asyncio.run(serve())
        model = loaded.registry.get("medium")
        for p, limit, res in zip([first, *later], [96, 24, 24], got, strict=True):
            ref = think_then_answer(model, model, loaded.tokens, [p], None, limit, SamplingParams(), think_limit=48)[0]
            assert (res.reasoning_ids, res.answer_ids) == (ref.think_tokens, ref.answer_tokens)
        stats = engine.snapshot_stats()
        if merge:  # the later requests joined the first one's batch while it was decoding
            assert stats["joined_running_batches"] >= 1 and stats["max_batch_size"] == 3
        else:
            assert stats.get("merged_groups", 0) == 0 and stats["max_batch_size"] == 1
    finally:
        engine.stop()


# ---------------------------------------------------------------------- checkpoint sources and formats (no Ray)
def _ask_every_budget(state) -> dict[str, dict]:
    """Serve ``state`` through the HTTP API in-process and ask every budget once (elastic for the largest)."""
    from components.serving.api import ServingApp

    api = ServingApp(state)

    async def run() -> dict[str, dict]:
        transport = httpx.ASGITransport(app=api.fastapi)
        out = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://app", headers=AUTH) as client:
            models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            for model in models:
                extra = {"think_model": models[-1]} if model == models[0] else {}
                r = await client.post("/v1/chat/completions", json=chat_body(model, **extra))
                assert r.status_code == 200, r.text
                out[model] = r.json()
        return out

    try:
        return asyncio.run(run())
    finally:
        api.close()


def test_fp8_checkpoint_serves_every_budget_from_one_quantized_copy(tiny_nested_checkpoint, tmp_path):
    from components.serving.config import ServingConfig
    from components.serving.state import ServingState
    from model.quant import quantize_checkpoint

    fp8 = quantize_checkpoint(tiny_nested_checkpoint, tmp_path / "fp8", "fp8")
    cfg = ServingConfig(api_key=KEY, format="fp8", think_limit=8, quantized_budgets="masked")
    state = ServingState(str(fp8), cfg)
    assert state.loaded.format == "fp8"
    assert all(n == 0 for n in state.loaded.registry.copied_bytes().values())  # masked budgets: nothing copied
    answers = _ask_every_budget(state)
    assert list(answers) == BUDGETS and answers["full"]["budget_control"]["think_model"] == "small"


def test_fp8_checkpoint_serves_smaller_budgets_at_their_own_size(tiny_nested_checkpoint, tmp_path):
    from components.serving.config import ServingConfig
    from components.serving.state import ServingState
    from model.quant import quantize_checkpoint

    fp8 = quantize_checkpoint(tiny_nested_checkpoint, tmp_path / "fp8", "fp8")
    bound = 0.02  # MiB for dense copies of quantized weights, all budgets together: some, not all
    cfg = ServingConfig(api_key=KEY, format="fp8", think_limit=8, dequant_cache_mib=bound)  # the default: sliced
    state = ServingState(str(fp8), cfg)
    registry = state.loaded.registry
    modes = {n: registry.get(n).mode for n in registry.names}
    assert modes[registry.names[0]] == "masked" and all(modes[n] == "sliced" for n in registry.names[1:])
    parent = sum(t.numel() * t.element_size() for t in registry.full.state_dict().values())
    assert all(0 < registry.copied_bytes()[n] < parent for n in registry.names[1:])  # each its own slice
    answers = _ask_every_budget(state)
    assert list(answers) == BUDGETS and answers["full"]["budget_control"]["think_model"] == "small"
    quantized = [m for n in registry.names for m in registry.get(n).modules() if hasattr(m, "_dequant_cache")]
    assert any(m.cache_dequantized for m in quantized) and not all(m.cache_dequantized for m in quantized)
    assert 0 < state.memory()["dequant_cache_bytes"] <= bound * 2**20
    with pytest.raises(ValueError, match="holds dense weights"):
        ServingState(str(tiny_nested_checkpoint), ServingConfig(format="nvfp4"))


def test_loads_from_s3(s3_server, tiny_nested_checkpoint, tmp_path):
    from components.serving.config import ServingConfig
    from components.serving.state import ServingState
    from components.storage import publish

    uri = publish(tiny_nested_checkpoint, "s3://test-bucket/serving/nested")
    state = ServingState(uri, ServingConfig(api_key=KEY, cache_dir=str(tmp_path / "cache"), think_limit=8))
    assert state.loaded.folder.is_relative_to(tmp_path / "cache")
    assert list(_ask_every_budget(state)) == BUDGETS


def test_loads_from_the_registry_champion(mlflow_server, tiny_nested_checkpoint, tmp_path):
    from components.register import RegisterConfig, run_register
    from components.serving.config import ServingConfig
    from components.serving.state import ServingState
    from components.tracking import MlflowTracker

    tracker = MlflowTracker(mlflow_server, "serving-test", run_name="register")
    out = run_register(RegisterConfig(model_name="serving-test", checkpoint_uri=str(tiny_nested_checkpoint)), tracker)
    tracker.finish()
    assert out["promoted"]
    cfg = ServingConfig(api_key=KEY, tracking_uri=mlflow_server, cache_dir=str(tmp_path / "cache"), think_limit=8)
    state = ServingState("models:/serving-test@champion", cfg)
    assert list(_ask_every_budget(state)) == BUDGETS


# ---------------------------------------------------------------------- the CLI entry point
@pytest.mark.slow
def test_serve_foreground_stops_cleanly_on_sigterm(tiny_nested_checkpoint, tmp_path):
    """``serve_foreground`` in its own process (its own local Ray): serves, then SIGTERM -> exit 0."""
    import subprocess
    import sys

    from tests.conftest import free_port

    port = free_port()
    code = (
        "from components.serving.app import serve_foreground\n"
        f"serve_foreground({str(tiny_nested_checkpoint)!r}, {port}, "
        "{'api_key_env': None, 'num_cpus_per_replica': 0.5})\n"
    )
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
        try:
            _serve_then_sigterm(proc, port, tmp_path / "serve.log")
        finally:
            if proc.poll() is None:
                proc.kill()


def _serve_then_sigterm(proc, port: int, log) -> None:
    import signal

    deadline = time.time() + 150
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "serve_foreground never became ready"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body("small"), timeout=60)
    assert r.status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0, log.read_text()[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
