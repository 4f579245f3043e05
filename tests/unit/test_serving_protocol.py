"""The serving wire format, log-probabilities, metrics text, admission and configuration, without a model or Ray."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from components.serving import protocol as P
from components.serving.config import DEPLOYMENT_NAME, ServingConfig, load_config
from components.serving.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs, token_logprobs
from components.serving.metrics import ServingMetrics
from components.serving.prompts import PromptError, check_length, check_messages
from components.serving.request_models import ChatCompletionRequest, ChatMessage, CompletionRequest, parse_request
from components.serving.state import Admission


def chat(**kw) -> bytes:
    body = {"model": "full", "messages": [{"role": "user", "content": "1+2"}], **kw}
    return json.dumps(body).encode()


def completion(**kw) -> bytes:
    return json.dumps({"model": "full", "prompt": "1+2", **kw}).encode()


# ---------------------------------------------------------------------- requests
def test_valid_chat_request_and_defaults():
    req = parse_request(ChatCompletionRequest, chat(max_completion_tokens=7, stop="x", seed=-3))
    assert (req.max_tokens, req.stops, req.seed, req.temperature, req.top_p) == (7, ("x",), -3, 1.0, 1.0)
    assert req.think_model is None and req.reasoning_budget is None and not req.stream and not req.include_usage
    assert req.n == 1 and req.logprobs_k is None
    req = parse_request(ChatCompletionRequest, chat(stream=True, stream_options={"include_usage": True}))
    assert req.stream and req.include_usage


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[]", None, "object"),
        (chat(max_tokens="5"), "max_tokens", "integer"),
        (chat(max_tokens=2.5), "max_tokens", "integer"),
        (chat(temperature="hot"), "temperature", "number"),
        (chat(temperature=2.5), "temperature", "less than or equal to 2"),
        (chat(top_p=0), "top_p", "greater than 0"),
        (chat(stream="yes"), "stream", "boolean"),
        (chat(stop=[""]), "stop", "non-empty"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(presence_penalty=0.5), "presence_penalty", "penalties are not supported"),
        (chat(frequency_penalty=-1.0), "frequency_penalty", "penalties are not supported"),
        (chat(logit_bias={"5": 10.0}), "logit_bias", "not supported"),
        (chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools.0.function.name", "pattern"),
        (chat(tools=[{"type": "function"}]), "tools.0.function", "Field required"),
        (chat(tool_choice="sometimes"), "tool_choice", "Input should be"),
        (chat(tool_choice={"type": "function", "function": {}}), "tool_choice.function.name", "Field required"),
        (chat(response_format={"type": "json_schema"}), "response_format", "json_schema is required"),
        (chat(response_format={"type": "yaml"}), "response_format.type", "Input should be"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
        (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
        (chat(reasoning_effort="extreme"), "reasoning_effort", "Input should be"),
        (chat(reasoning_budget=3, thinking_token_budget=4), None, "disagree"),
        (chat(functions=[{"name": "f"}]), "functions", "send tools and tool_choice"),
        (
            chat(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            ),
            "messages.0.tool_calls.0.function.arguments",
            "must be a JSON object",
        ),  # fmt: skip
        (chat(store=True), "store", "not supported"),
        (chat(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
        (chat(logprobs=1), "logprobs", "boolean"),
        (
            chat(stream_options={"continuous_usage_stats": True}),
            "stream_options.continuous_usage_stats",
            "include_usage",
        ),
        (chat(frobnicate=1), "frobnicate", "Extra inputs"),
        (chat(max_tokens=3, max_completion_tokens=4), None, "disagree"),
        (chat(messages=[]), "messages", "at least 1"),
        (chat(messages=[{"role": "user"}, {"role": "wizard", "content": "x"}]), "messages.1.role", "Input should"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]), "messages.0.content", ""),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model", "Field required"),
    ],
)
def test_malformed_chat_requests_name_the_problem(body, param, fragment):
    with pytest.raises(P.OpenAIError) as info:
        parse_request(ChatCompletionRequest, body)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param or (param is None and err.param is None) or (param and err.param.startswith(param))
    assert fragment in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 3},
        {"logprobs": True},
        {"logprobs": True, "top_logprobs": 0},
        {"logprobs": True, "top_logprobs": 20},
        {"logprobs": False},
        {"parallel_tool_calls": False},
        {"parallel_tool_calls": True},
        {"tools": []},
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"functions": []},
        {"function_call": "none"},
        {"presence_penalty": 0, "frequency_penalty": 0.0},
        {"logit_bias": {}},
        {"response_format": {"type": "text"}},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True}}},
        {"structured_outputs": {"choice": ["a", "b"]}},
        {"reasoning_effort": "high", "include_reasoning": False, "chat_template_kwargs": {"enable_thinking": True}},
        {"thinking_token_budget": 5, "reasoning_budget": 5},
        {"service_tier": "auto"},
        {"store": False},
        {"metadata": {"team": "a"}},
        {"modalities": ["text"]},
        {"user": "u-1", "prompt_cache_key": "k", "safety_identifier": "s"},
        {"top_k": -1, "min_p": 0, "repetition_penalty": 1},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": False}},
    ],
)
def test_neutral_values_of_unsupported_fields_are_accepted(extra):
    req = parse_request(ChatCompletionRequest, chat(**extra))
    assert req.model == "full"


def test_chat_logprobs_fields():
    assert parse_request(ChatCompletionRequest, chat(logprobs=True)).logprobs_k == 0
    assert parse_request(ChatCompletionRequest, chat(logprobs=True, top_logprobs=4)).logprobs_k == 4
    assert parse_request(ChatCompletionRequest, chat(logprobs=False)).logprobs_k is None


def test_completion_request_prompt_forms_and_logprobs():
    parse = lambda **kw: parse_request(CompletionRequest, completion(**kw))
    assert parse(prompt="abc").prompts == ["abc"]
    assert parse(prompt=["a", "bc"]).prompts == ["a", "bc"]
    assert parse(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert parse(prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    with pytest.raises(P.OpenAIError, match="prompt: empty list"):
        parse(prompt=[]).prompts  # noqa: B018
    for value in (0, 1, 5):
        assert parse(logprobs=value, echo=True).logprobs_k == value
    assert parse(best_of=1).best_of == 1 and parse(n=2, best_of=2).n == 2
    assert parse(suffix=None, logit_bias={}, presence_penalty=0).suffix is None


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"prompt": {"a": 1}}, "prompt", "a list of token-id lists"),
        ({"prompt": [1, "a"]}, "prompt", "a list of token ids"),
        ({"prompt": [[1], [2, "x"]]}, "prompt", "a string, a list of strings"),
        ({"logprobs": True}, "logprobs", "integer"),
        ({"logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"best_of": 2}, "best_of", "only best_of equal to n (1)"),
        ({"suffix": "tail"}, "suffix", "not supported"),
        ({"echo": "yes"}, "echo", "boolean"),
    ],
)
def test_malformed_completion_requests_name_the_problem(extra, param, fragment):
    with pytest.raises(P.OpenAIError) as info:
        parse_request(CompletionRequest, completion(**extra))
    assert (info.value.status, info.value.param) == (400, param)
    assert fragment in info.value.message


# ---------------------------------------------------------------------- chat messages
def _messages(*pairs: tuple[str, object], **fields) -> list[ChatMessage]:
    return [ChatMessage.model_validate({"role": r, "content": c, **fields}) for r, c in pairs]


def _forbidden(text: str) -> list[str]:  # stands in for PromptRules.forbidden: two control strings
    return [t for t in ("<eos>", "<think>") if t in text]


def test_chat_messages_keep_every_turn():
    msgs = _messages(("system", "be brief"), ("user", "1+1"), ("assistant", "A:2"), ("user", "7+5*3-2"))
    msgs[2].reasoning_content = "1+1=2\n"
    parts = [{"type": "text", "text": "4-"}, {"type": "text", "text": "1"}]
    out = [m.for_template() for m in [*msgs, *_messages(("user", parts))]]
    check_messages(out, _forbidden)
    assert out == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "A:2", "reasoning_content": "1+1=2\n"},
        {"role": "user", "content": "7+5*3-2"},
        {"role": "user", "content": "4-1"},
    ]


@pytest.mark.parametrize(
    ("msgs", "param", "fragment"),
    [
        ([("system", "x")], "messages", "role 'user'"),
        ([("user", "1+2<think>A:3")], "messages.0.content", "['<think>']"),
        (
            [("system", "ok"), ("user", "fine"), ("assistant", "<eos><think>")],
            "messages.2.content",
            "'<eos>', '<think>'",
        ),
    ],
)
def test_chat_messages_refuse_control_text(msgs, param, fragment):
    with pytest.raises(PromptError) as info:
        check_messages([m.for_template() for m in _messages(*msgs)], _forbidden)
    assert info.value.param == param
    assert fragment in str(info.value)


def test_chat_messages_refuse_control_text_in_reasoning_and_name():
    msgs = _messages(("user", "q"), ("assistant", "a"), ("user", "r"))
    msgs[1].reasoning_content = "x<eos>"
    with pytest.raises(PromptError) as info:
        check_messages([m.for_template() for m in msgs], _forbidden)
    assert (info.value.param, info.value.code) == ("messages.1.reasoning_content", "special_token")
    named = [{"role": "user", "content": "q", "name": "<think>"}]
    with pytest.raises(PromptError, match=r"messages\.0\.name: must not contain .*\['<think>'\]"):
        check_messages(named, _forbidden)
    # tool-call ids and calls reach templates that render them (tool exchanges): checked like text
    with pytest.raises(PromptError, match=r"messages\.0\.tool_call_id: must not contain"):
        check_messages([{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "<eos>"}][::-1], _forbidden)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"city": "a<think>"}}}
    with pytest.raises(PromptError) as info:
        check_messages([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}], _forbidden)
    assert info.value.param == "messages.1.tool_calls.0.function.arguments.city"


def test_prompt_length_limits():
    check_length([1, 2, 3], 3, "prompt")
    with pytest.raises(PromptError, match="prompt.1: empty prompt") as info:
        check_length([], 3, "prompt.1")
    assert info.value.param == "prompt.1"
    with pytest.raises(PromptError, match=r"messages: 4 tokens, more than the limit of 3 \(max_prompt_tokens\)"):
        check_length([1, 2, 3, 4], 3, "messages")


# ---------------------------------------------------------------------- log-probabilities
def _reference_logprob(row: list[float], i: int) -> float:
    """log softmax by hand: x_i - log(sum(exp(x)))."""
    return row[i] - math.log(sum(math.exp(x) for x in row))


def test_token_logprobs_values_and_top_k():
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, math.log(4.0)]])  # probabilities 1/9, 3/9, 1/9, 4/9
    [(tok, lp, top)] = token_logprobs(logits, [1], k=2)
    assert tok == 1 and lp == pytest.approx(math.log(3 / 9), abs=1e-6)
    assert [i for i, _ in top] == [3, 1]
    assert [v for _, v in top] == pytest.approx([math.log(4 / 9), math.log(3 / 9)], abs=1e-6)
    assert token_logprobs(logits, [0], k=0) == [(0, pytest.approx(math.log(1 / 9), abs=1e-6), [])]


def test_prompt_logprobs_match_a_loop_reference():
    torch.manual_seed(0)
    ids = [3, 1, 4, 1, 5]
    logits = torch.randn(len(ids), 7)
    got = prompt_logprobs(logits, ids, k=3)
    assert got[0] == (3, None, [])  # nothing precedes the first token
    for pos in range(1, len(ids)):
        row = logits[pos - 1].tolist()
        tok, lp, top = got[pos]
        assert tok == ids[pos] and lp == pytest.approx(_reference_logprob(row, ids[pos]), abs=1e-5)
        best = sorted(range(7), key=lambda j: -row[j])[:3]
        assert [j for j, _ in top] == best
        assert [v for _, v in top] == pytest.approx([_reference_logprob(row, j) for j in best], abs=1e-5)


def test_completion_logprobs_layout():
    text = {7: "A", 8: ":", 9: "42", 2: "<eos>"}.__getitem__
    entries = [(7, None, []), (8, -0.5, [(8, -0.5), (9, -1.5)]), (9, -2.0, [(8, -0.25)]), (2, float("-inf"), [])]
    out = completion_logprobs(entries, text)
    assert out.tokens == ["A", ":", "42", "<eos>"]
    assert out.text_offset == [0, 1, 2, 4]
    assert out.token_logprobs == [None, -0.5, -2.0, -9999.0]
    assert out.top_logprobs == [None, {":": -0.5, "42": -1.5}, {"42": -2.0, ":": -0.25}, {"<eos>": -9999.0}]
    assert completion_logprobs(entries[1:2], text, start_offset=10).text_offset == [10]


def test_chat_logprobs_layout():
    text = {5: "é", 6: "b"}.__getitem__
    out = chat_logprobs([(5, -0.1, [(5, -0.1), (6, -2.5)])], text).model_dump()
    assert out == {
        "content": [
            {
                "token": "é", "logprob": -0.1, "bytes": [195, 169],
                "top_logprobs": [{"token": "é", "logprob": -0.1, "bytes": [195, 169]},
                                 {"token": "b", "logprob": -2.5, "bytes": [98]}],
            }
        ],
        "refusal": None,
    }  # fmt: skip


# ---------------------------------------------------------------------- responses and errors
def test_stream_chunks_carry_only_what_changed():
    delta = P.ChatDelta(reasoning_content="7+5=2\n")
    chunk = P.ChatCompletionChunk(id="c", created=1, model="m", choices=[P.ChatChunkChoice(delta=delta)])
    event = P.sse(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    data = json.loads(event[len(b"data: ") :])
    assert data["choices"][0]["delta"] == {"reasoning_content": "7+5=2\n"}
    assert data["choices"][0]["finish_reason"] is None  # present, null: clients read it on every chunk
    assert P.sse("[DONE]") == b"data: [DONE]\n\n"


def test_usage_counts_thinking_inside_completion_tokens():
    u = P.usage(prompt_tokens=12, reasoning_tokens=5, answer_tokens=3)
    assert (u.completion_tokens, u.total_tokens, u.completion_tokens_details.reasoning_tokens) == (8, 20, 5)


def test_unavailable_is_an_openai_503_with_retry_after():
    err = P.unavailable("busy", 2.2)
    assert (err.status, err.headers, err.type, err.code) == (503, {"Retry-After": "3"}, "server_error", "overloaded")
    assert P.unavailable("busy", 0.1).headers == {"Retry-After": "1"}
    assert err.body() == {"error": {"message": "busy", "type": "server_error", "param": None, "code": "overloaded"}}


# ---------------------------------------------------------------------- admission
def test_admission_runs_queues_then_refuses_and_hands_slots_over():
    async def scenario() -> list[str]:
        adm = Admission(ongoing=1, queued=1, retry_after_s=1.5)
        order: list[str] = []
        await adm.acquire()  # running: 1
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        assert (adm.running, adm.waiting) == (1, 1)
        with pytest.raises(P.OpenAIError) as info:
            await adm.acquire()
        assert info.value.status == 503 and info.value.headers == {"Retry-After": "2"}
        assert "1 requests running and 1 waiting" in info.value.message and adm.rejected == 1
        adm.release()  # the slot goes to the waiter, not back to the pool
        await waiter
        order.append(f"{adm.running}/{adm.waiting}")
        adm.release()
        order.append(f"{adm.running}/{adm.waiting}")
        return order

    assert asyncio.run(scenario()) == ["1/0", "0/0"]


def test_admission_waiter_that_leaves_frees_its_place():
    async def scenario() -> tuple[int, int]:
        adm = Admission(ongoing=1, queued=1, retry_after_s=1.0)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        adm.release()
        return adm.running, adm.waiting

    assert asyncio.run(scenario()) == (0, 0)


# ---------------------------------------------------------------------- metrics
def test_prometheus_text_parses_with_the_recorded_values():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServingMetrics()
    m.record("full", "chat", 200, 0.3, 0.02, {"prompt": 10, "reasoning": 4, "completion": 9})
    m.record("full", "chat", 200, 3.0, 0.2, {"prompt": 5, "reasoning": 0, "completion": 2})
    m.record("unknown", "completions", 400)
    text = m.prometheus({"star_elastic_requests_running": ("Requests running.", 2)})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    get = lambda name, **labels: samples[(name, tuple(sorted(labels.items())))]
    assert get("star_elastic_requests_total", budget="full", route="chat", status="200") == 2
    assert get("star_elastic_requests_total", budget="unknown", route="completions", status="400") == 1
    assert get("star_elastic_tokens_total", budget="full", kind="completion") == 11
    lat = {"budget": "full", "route": "chat"}
    assert get("star_elastic_request_latency_s_count", **lat) == 2
    assert get("star_elastic_request_latency_s_sum", **lat) == pytest.approx(3.3)
    assert get("star_elastic_request_latency_s_bucket", **lat, le="0.5") == 1
    assert get("star_elastic_request_latency_s_bucket", **lat, le="5") == 2
    assert get("star_elastic_request_latency_s_bucket", **lat, le="+Inf") == 2
    assert get("star_elastic_time_to_first_token_s_bucket", **lat, le="0.025") == 1
    assert get("star_elastic_requests_running") == 2
    assert fams["star_elastic_request_latency_s"].type == "histogram"


def test_prometheus_label_values_are_escaped():
    m = ServingMetrics()
    m.record('we"ird\\', "chat", 200)
    assert 'budget="we\\"ird\\\\"' in m.prometheus()


# ---------------------------------------------------------------------- configuration
def test_config_is_strict_and_consistent():
    with pytest.raises(ValueError, match="max_tokens_limt"):
        ServingConfig.model_validate({"max_tokens_limt": 5})
    with pytest.raises(ValueError, match="default_max_tokens"):
        ServingConfig(max_tokens_limit=16, default_max_tokens=32)
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        ServingConfig(max_ongoing_requests=2, autoscaling={"target_ongoing_requests": 4})
    with pytest.raises(ValueError, match="min_replicas"):
        ServingConfig(autoscaling={"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValueError, match="think_open and think_close must differ"):
        ServingConfig(markers={"think_open": "<r>", "think_close": "<r>"})


def test_deployment_options_send_overload_to_the_replica():
    cfg = ServingConfig(
        max_ongoing_requests=8, max_queued_requests=5, num_cpus_per_replica=2, num_gpus_per_replica=1,
        retry_after_s=3, proxy_max_queued_requests=100,
        autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4},
    )  # fmt: skip
    opts = cfg.deployment_options()
    assert opts["name"] == DEPLOYMENT_NAME == "StarElasticServer"  # the name a RayService's Serve config uses
    # Serve may send 8 running + 5 waiting + 8 more, which the replica answers with a JSON 503
    assert (opts["max_ongoing_requests"], opts["max_queued_requests"]) == (21, 100)
    assert opts["backpressure_config"] == {"status_code": 503, "retry_after_s": 3}
    assert (
        opts["autoscaling_config"]["max_replicas"] == 3 and opts["autoscaling_config"]["target_ongoing_requests"] == 4
    )
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    unbounded = ServingConfig(max_ongoing_requests=8, max_queued_requests=-1).deployment_options()
    assert (unbounded["max_ongoing_requests"], unbounded["max_queued_requests"]) == (16, -1)


def test_deployment_options_are_accepted_by_ray_serve():
    from ray import serve

    @serve.deployment
    class Probe:
        pass

    opts = ServingConfig().deployment_options()
    d = Probe.options(**opts)
    assert d.max_ongoing_requests == opts["max_ongoing_requests"]
    assert d.backpressure_config.retry_after_s == 1.0


def test_load_config_sources(tmp_path, monkeypatch):
    path = tmp_path / "pipeline.yaml"
    path.write_text("run_name: demo\nserve:\n  max_tokens_limit: 256\n  api_key_env: MY_KEY\n")
    cfg = load_config(path, default_max_tokens="64")  # serve run passes strings
    assert (cfg.max_tokens_limit, cfg.default_max_tokens) == (256, 64)
    monkeypatch.delenv("MY_KEY", raising=False)
    assert cfg.resolved_api_key() is None
    monkeypatch.setenv("MY_KEY", "s3cret")
    assert cfg.resolved_api_key() == "s3cret"
    assert ServingConfig(api_key="k", api_key_env="MY_KEY").resolved_api_key() == "k"
    (tmp_path / "c.json").write_text(json.dumps({"batch_max_size": 4}))
    assert load_config(str(tmp_path / "c.json")).batch_max_size == 4
    assert load_config(cfg).max_tokens_limit == 256 and load_config(None) == ServingConfig()
