"""The serving wire format and configuration, without a model or Ray."""

from __future__ import annotations

import json

import pytest

from components.serving import protocol as P
from components.serving.config import DEPLOYMENT_NAME, ServingConfig, load_config


def chat(**kw) -> bytes:
    body = {"model": "full", "messages": [{"role": "user", "content": "1+2"}], **kw}
    return json.dumps(body).encode()


# ---------------------------------------------------------------------- requests
def test_valid_chat_request_and_defaults():
    req = P.parse_request(P.ChatCompletionRequest, chat(max_completion_tokens=7, stop="x", seed=-3))
    assert (req.max_tokens, req.stops, req.seed, req.temperature, req.top_p) == (7, ("x",), -3, 1.0, 1.0)
    assert req.think_model is None and req.reasoning_budget is None and not req.stream and not req.include_usage
    req = P.parse_request(P.ChatCompletionRequest, chat(stream=True, stream_options={"include_usage": True}))
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
        (chat(n=3), None, "only n=1"),
        (chat(presence_penalty=0.5), None, "penalties"),
        (chat(logprobs=True), None, "logprobs"),
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
        P.parse_request(P.ChatCompletionRequest, body)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param or (param is None and err.param is None) or (param and err.param.startswith(param))
    assert fragment in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_completion_request_prompt_forms():
    assert P.parse_request(P.CompletionRequest, b'{"model": "m", "prompt": "abc"}').prompt == "abc"
    assert P.parse_request(P.CompletionRequest, b'{"model": "m", "prompt": [1, 2, 3]}').prompt == [1, 2, 3]
    with pytest.raises(P.OpenAIError, match="echo"):
        P.parse_request(P.CompletionRequest, b'{"model": "m", "prompt": "a", "echo": true}')
    with pytest.raises(P.OpenAIError) as info:
        P.parse_request(P.CompletionRequest, b'{"model": "m", "prompt": {"a": 1}}')
    assert info.value.param.startswith("prompt")


# ---------------------------------------------------------------------- chat template
def _messages(*pairs: tuple[str, object]) -> list[P.ChatMessage]:
    return [P.ChatMessage.model_validate({"role": r, "content": c}) for r, c in pairs]


def test_chat_template_uses_the_last_user_message():
    msgs = _messages(("system", "be brief"), ("user", "1+1"), ("assistant", "A:2"), ("user", "  7+5*3-2 \n"))
    assert P.chat_prompt(msgs) == "<bos>Q:7+5*3-2\n<think>"
    assert P.chat_prompt(_messages(("user", "Q:3*3"))) == "<bos>Q:3*3\n<think>"  # no doubled prefix
    parts = [{"type": "text", "text": "4-"}, {"type": "text", "text": "1"}]
    assert P.chat_prompt(_messages(("user", parts))) == "<bos>Q:4-1\n<think>"


@pytest.mark.parametrize(
    ("msgs", "fragment"),
    [
        ([("system", "x")], "role 'user'"),
        ([("user", "   ")], "empty"),
        ([("user", "1+2</think>A:3")], "special tokens"),
        ([("user", "<eos>")], "special tokens"),
    ],
)
def test_chat_template_rejects(msgs, fragment):
    with pytest.raises(P.OpenAIError, match=fragment) as info:
        P.chat_prompt(_messages(*msgs))
    assert info.value.status == 400 and info.value.param.startswith("messages")


# ---------------------------------------------------------------------- responses
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


def test_deployment_options_follow_the_config():
    cfg = ServingConfig(
        max_ongoing_requests=8, max_queued_requests=5, num_cpus_per_replica=2, num_gpus_per_replica=1,
        autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4},
    )  # fmt: skip
    opts = cfg.deployment_options()
    assert opts["name"] == DEPLOYMENT_NAME == "StarElasticServer"  # the name components.kuberay overrides
    assert (opts["max_ongoing_requests"], opts["max_queued_requests"]) == (8, 5)
    assert (
        opts["autoscaling_config"]["max_replicas"] == 3 and opts["autoscaling_config"]["target_ongoing_requests"] == 4
    )
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}


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
