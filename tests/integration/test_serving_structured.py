"""Structured outputs, tool calls and the Responses API against a real server: Ray Serve on a local Ray, HTTP on
loopback, the official ``openai`` client and LangChain (``langchain-openai``).

The checkpoint is the tiny random nested one with the demo tokenizer (one token per character): its free-form
answers are never valid JSON, so every parsed object and every tool call that validates below is the grammar's
doing. Schemas bound their strings and numbers, because a random model left free inside a string never closes it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.integration.serving_app import running_app

pytestmark = pytest.mark.integration

APP = "structured-test"
KEY = "sk-structured"
BUDGETS = ["full", "medium", "small"]
CONFIG = {
    "api_key": KEY,
    "max_tokens_limit": 256,
    "default_max_tokens": 160,
    "think_limit": 16,
    "max_prompt_tokens": 600,
    "batch_wait_timeout_s": 0.05,
    "num_cpus_per_replica": 1,
    "autoscaling": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 4},
}
MESSAGES = [{"role": "user", "content": "Q:7+5*3-2\n"}]
THINK = {"reasoning_budget": 6}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    mood: Literal["calm", "busy"]


@pytest.fixture(scope="module")
def base_url(serve_http, tiny_nested_checkpoint):
    with running_app(APP, tiny_nested_checkpoint, CONFIG, serve_http) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(oai, model="small", **kw):
    """A greedy chat; it thinks ``THINK`` unless the request bounds its thinking itself."""
    extra = kw.pop("extra_body", {})
    if not {"reasoning_budget", "thinking_token_budget"} & set(extra) and "reasoning_effort" not in kw:
        extra = {**THINK, **extra}
    return oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0, extra_body=extra, **kw)


def _is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except json.JSONDecodeError:
        return False
    return True


# ---------------------------------------------------------------------- structured outputs
@pytest.mark.parametrize("model", BUDGETS)
def test_parse_returns_an_object_on_every_budget(oai, model):
    free = _chat(oai, model, max_tokens=40)
    assert not _is_json(free.choices[0].message.content)  # the model itself does not write JSON
    out = oai.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Person, temperature=0, max_tokens=160, extra_body=THINK
    )
    choice = out.choices[0]
    assert isinstance(choice.message.parsed, Person) and choice.finish_reason == "stop"
    # the grammar constrains the answer only: the thinking is what the free request thought
    assert choice.message.reasoning_content == free.choices[0].message.reasoning_content
    assert out.model_extra["budget_control"]["answer_start"] == "continued"


def test_parse_under_elastic_budget_control(oai):
    """``think_model``: the small budget thinks freely, the constraint starts on the answering budget."""
    extra = {**THINK, "think_model": "small"}
    free = _chat(oai, "full", max_tokens=40, extra_body=extra)
    out = oai.chat.completions.parse(
        model="full", messages=MESSAGES, response_format=Person, temperature=0, max_tokens=160, extra_body=extra
    )
    assert isinstance(out.choices[0].message.parsed, Person)
    assert out.choices[0].message.reasoning_content == free.choices[0].message.reasoning_content
    control = out.model_extra["budget_control"]
    assert (control["think_model"], control["answer_model"], control["answer_start"]) == ("small", "full", "re_prefill")


def test_json_mode_regex_choice_and_streaming(oai, http):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    whole = _chat(oai, max_tokens=160, response_format=schema)
    chunks = list(_chat(oai, max_tokens=160, response_format=schema, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and Person.model_validate_json(streamed)
    mode = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {"model": "medium", "prompt": "Q:1", "max_tokens": 30, "temperature": 0}
    choice = http.post("/v1/completions", json={**body, "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert choice["choices"][0]["text"] in ("yes", "no")
    regex = http.post("/v1/completions", json={**body, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}).json()
    assert regex["choices"][0]["text"][:3].isdigit() and regex["choices"][0]["text"][3] == "-"
    as_json = http.post("/v1/completions", json={**body, "structured_outputs": {"json": mode}}).json()
    assert json.loads(as_json["choices"][0]["text"])["ok"] in (True, False)


def test_a_constrained_request_batched_with_free_ones_gets_what_it_gets_alone(base_url):
    """Concurrent requests (two constrained, two free, different budgets of thinking) share decode batches."""
    import openai

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    kinds = [{"response_format": fmt}, {}, {"response_format": fmt, "seed": 3, "temperature": 0.8}, {"seed": 4}]

    async def ask(client, kw):
        kw = {"temperature": 0, **kw}
        out = await client.chat.completions.create(
            model="small", messages=MESSAGES, max_tokens=120, extra_body=THINK, **kw
        )
        return out.choices[0].message.content

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0) as client:
            together = await asyncio.gather(*(ask(client, kw) for kw in kinds))
            alone = [await ask(client, kw) for kw in kinds]
            return together, alone

    together, alone = asyncio.run(run())
    assert together == alone
    assert Person.model_validate_json(together[0]) and Person.model_validate_json(together[2])


# ---------------------------------------------------------------------- tool calls
def test_required_tool_call_validates_against_its_schema(oai):
    out = _chat(oai, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = _chat(oai, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=250)
    assert named.choices[0].finish_reason in ("stop", "length")  # a named choice ends as the OpenAI API ends it
    calls = named.choices[0].message.tool_calls  # parallel calls allowed: the random model may write several
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.function.name == "add" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), ADD)
    one = _chat(oai, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                parallel_tool_calls=False)  # fmt: skip
    assert one.choices[0].finish_reason == "stop" and len(one.choices[0].message.tool_calls) == 1
    stream = list(_chat(oai, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [t for c in stream if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, call.function.name, call.function.arguments)
    ]
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "tool_calls"
    auto = _chat(oai, max_tokens=40, tools=TOOLS)  # auto: the answer is free, and holds no call here
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason in ("stop", "length")


def test_two_turn_tool_exchange(oai, tiny_nested_checkpoint):
    from components.data.tokenizer import TextTokenizer
    from components.serving.prompts import PromptRules
    from components.serving.tools import tool_format

    first = _chat(oai, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21C"},
    ]
    second = oai.chat.completions.create(
        model="small", messages=messages, tools=TOOLS, temperature=0, max_tokens=8, extra_body=THINK
    )
    assert isinstance(second.choices[0].message.content, str)
    # the call and its result went through the chat template (the demo's ignores tool_calls: folded in)
    rules = PromptRules(TextTokenizer.load(tiny_nested_checkpoint), tool_format("hermes"))
    rendered = [{**m, "content": m["content"] or ""} for m in messages]
    rendered[1]["tool_calls"] = [{**call.model_dump(), "function": {"name": "get_weather",
                                  "arguments": json.loads(call.function.arguments)}}]  # fmt: skip
    ids, _ = rules.chat(rendered, TOOLS)
    assert second.usage.prompt_tokens == len(ids)
    assert "21C" in rules.tokenizer.decode(ids) and '"name": "get_weather"' in rules.tokenizer.decode(ids)


# ---------------------------------------------------------------------- the Responses API
def test_responses_create_with_and_without_streaming(oai):
    kw = {"model": "medium", "input": "Q:7+5*3-2\n", "instructions": "Be brief.\n", "max_output_tokens": 12}
    extra = {**THINK}
    resp = oai.responses.create(temperature=0, extra_body=extra, **kw)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    chat = oai.chat.completions.create(
        model="medium", messages=[{"role": "system", "content": "Be brief.\n"}, *MESSAGES], max_tokens=12,
        temperature=0, extra_body=extra,
    )  # fmt: skip
    assert resp.output_text == chat.choices[0].message.content  # the same request as a chat completion
    assert resp.output[0].content[0].text == chat.choices[0].message.reasoning_content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(oai.responses.create(temperature=0, stream=True, extra_body=extra, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.output_text == resp.output_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == final.output[0].content[0].text == resp.output[0].content[0].text


def test_responses_structured_output_and_tools(oai):
    parsed = oai.responses.parse(
        model="small", input="Q:1\n", text_format=Person, temperature=0, max_output_tokens=160, extra_body=THINK
    )
    assert isinstance(parsed.output_parsed, Person)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = oai.responses.create(
        model="small", input="Q:1\n", tools=tools, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=160, extra_body=THINK,
    )  # fmt: skip
    (call,) = [o for o in resp.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    follow = oai.responses.create(
        model="small", temperature=0, max_output_tokens=6, extra_body=THINK, tools=tools,
        input=[{"role": "user", "content": "Q:1\n"}, *[o.model_dump(exclude_none=True) for o in resp.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "21C"}],
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete") and isinstance(follow.output_text, str)
    streamed = list(oai.responses.create(
        model="small", input="Q:1\n", tools=tools, tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_output_tokens=160, extra_body=THINK, stream=True,
    ))  # fmt: skip
    done = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(i.name, i.arguments) for i in done] == [(call.name, call.arguments)]


# ---------------------------------------------------------------------- names users send, metrics, errors
def test_vllm_names(oai, http):
    alias = _chat(oai, max_tokens=6, extra_body={"thinking_token_budget": 3})
    same = _chat(oai, max_tokens=6, extra_body={"reasoning_budget": 3})
    assert alias.choices[0].message.reasoning_content == same.choices[0].message.reasoning_content
    assert alias.usage.completion_tokens_details.reasoning_tokens <= 3
    hidden = _chat(oai, max_tokens=6, extra_body={"include_reasoning": False})
    assert (
        hidden.choices[0].message.reasoning_content is None and hidden.usage.completion_tokens_details.reasoning_tokens
    )
    none = _chat(oai, max_tokens=6, reasoning_effort="none")
    assert none.usage.completion_tokens_details.reasoning_tokens == 0  # mapped to think cap 0
    low = _chat(oai, max_tokens=6, reasoning_effort="minimal")
    assert 0 < low.usage.completion_tokens_details.reasoning_tokens <= 16
    kwargs = _chat(oai, max_tokens=6, extra_body={"chat_template_kwargs": {"unused_by_the_template": 1}})
    plain = _chat(oai, max_tokens=6)
    assert kwargs.choices[0].message.content == plain.choices[0].message.content


def test_grammars_compile_once_and_are_counted(http):
    before = http.get("/stats").json()["grammar"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    body = {
        "model": "small",
        "prompt": "Q:1",
        "max_tokens": 20,
        "temperature": 0,
        "structured_outputs": {"json": schema},
    }
    for _ in range(3):
        assert http.post("/v1/completions", json=body).status_code == 200
    after = http.get("/stats").json()["grammar"]
    assert after["compiles"] == before["compiles"] + 1 and after["cache_hits"] == before["cache_hits"] + 2
    assert after["compile_s_total"] > before["compile_s_total"] and after["masked_tokens"] > before["masked_tokens"]
    metrics = http.get("/metrics").text
    for series in ("compiles_total", "compile_seconds_total", "cache_hits_total", "masked_tokens_total"):
        assert f"star_elastic_grammar_{series} " in metrics


def _bad(http, path, body):
    r = http.post(path, json=body)
    assert r.headers["content-type"] == "application/json", r.text
    return r.status_code, r.json()["error"]


@pytest.mark.parametrize(
    ("path", "extra", "param", "fragment"),
    [
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
         "tool_choice.function.name", "not one of the tools"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools.0.function.name", "pattern"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}],
                                  "tool_choice": "required"}, "tools.0.function.parameters", "cannot be enforced"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
         "schema": {"type": "object", "if": {}}}}}, "response_format.json_schema.schema", "Unimplemented"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "regex"),
        ("/v1/chat/completions", {"reasoning_effort": "huge"}, "reasoning_effort", "Input should be"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs.add_generation_prompt", "set by the server"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "description": "<eos>"}}]},
         "tools.0.function.description", "special tokens"),
        ("/v1/responses", {"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ("/v1/responses", {"max_output_tokens": 10_000}, "max_output_tokens", "between 1 and 256"),
        ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
         "input.0.arguments", "JSON object"),
        ("/v1/responses", {"input": [{"role": "user", "content": "x<think>"}]}, "input.0.content", "special tokens"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"if": {}}}}},
         "text.format.schema", "Unimplemented"),
        ("/v1/responses", {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
         "name": "g"}}, "tool_choice.name", "not one of the tools"),
    ],
)  # fmt: skip
def test_bad_input_is_an_openai_400_naming_the_field(http, path, extra, param, fragment):
    base = (
        {"model": "small", "messages": MESSAGES} if path.endswith("completions") else {"model": "small", "input": "x"}
    )
    status, err = _bad(http, path, {**base, **extra})
    assert status == 400 and set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and fragment in err["message"], err


# ---------------------------------------------------------------------- LangChain
@pytest.fixture(scope="module")
def llm(base_url):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="small", base_url=f"{base_url}/v1", api_key=KEY, temperature=0, max_tokens=160, max_retries=0,
        extra_body=THINK,
    )  # fmt: skip


def test_langchain_structured_output_and_batch(llm):
    structured = llm.with_structured_output(Person)
    one = structured.invoke("Q:7+5*3-2\n")
    assert isinstance(one, Person)
    many = structured.batch(["Q:1\n", "Q:2+2\n", "Q:9\n"])
    assert len(many) == 3 and all(isinstance(p, Person) for p in many)


def test_langchain_bind_tools_and_streaming(llm):
    from langchain_core.tools import tool

    class AddArgs(BaseModel):
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=9)

    @tool(args_schema=AddArgs)
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    bound = llm.bind_tools([add], tool_choice="add")
    msg = bound.invoke("Q:3+4\n")
    (call,) = msg.tool_calls
    assert call["name"] == "add" and 0 <= call["args"]["a"] <= 99 and 0 <= call["args"]["b"] <= 9
    assert add.invoke(call["args"]) == call["args"]["a"] + call["args"]["b"]
    chunks = list(bound.stream("Q:3+4\n"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    text = "".join(c.content for c in llm.stream("Q:3+4\n", max_tokens=10))
    assert text == llm.invoke("Q:3+4\n", max_tokens=10).content
