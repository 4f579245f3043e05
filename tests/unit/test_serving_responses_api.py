"""The Responses API request as a chat request, without a model: items to messages, fields to chat fields, errors
renamed to the Responses API's fields, what a stateless server refuses."""

from __future__ import annotations

import json

import pytest

from components.serving import protocol as P
from components.serving.responses_api import ResponsesRequest, parse_responses_request


def parse(**kw) -> ResponsesRequest:
    return parse_responses_request(json.dumps({"model": "small", "input": "hi", **kw}).encode())


def test_items_become_chat_messages_with_their_origin():
    req = parse(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Q:1"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "1=1"}]},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "calling", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}", "status": "completed"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "0"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "and?"}]},
        ],
    )  # fmt: skip
    messages, origin = req.messages()
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q:1"},
        {"role": "assistant", "content": "calling", "reasoning_content": "1=1", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "0"},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    assert origin == ["instructions", "input.0", "input.2", "input.5", "input.6", "input.7"]
    chat, _ = req.to_chat()
    assert chat.messages[2].tool_calls[1].function.name == "add"


def test_fields_map_to_the_chat_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse(
        max_output_tokens=9, temperature=0.5, top_p=0.9, seed=3, stream=True, reasoning={"effort": "low"},
        text={"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}},
        tools=[{"type": "function", "name": "add", "parameters": schema}],
        tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False, reasoning_budget=4,
        think_model="small", include_reasoning=False,
        chat_template_kwargs={"enable_thinking": True}, store=True, metadata={"k": "v"},
    )  # fmt: skip
    chat, _ = req.to_chat()
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed, chat.stream) == (9, 0.5, 0.9, 3, True)
    assert (chat.reasoning_effort, chat.reasoning_budget, chat.think_model) == ("low", 4, "small")
    assert chat.include_reasoning is False and chat.chat_template_kwargs == {"enable_thinking": True}
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert chat.tools[0].function.name == "add" and chat.tools[0].function.parameters == schema
    assert chat.tool_choice.function.name == "add" and chat.parallel_tool_calls is False
    assert parse(text={"format": {"type": "json_object"}}).to_chat()[0].response_format.type == "json_object"


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"background": True}, "background", "not supported"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]}, "input.0.arguments",
         "JSON object"),
        ({"input": [{"type": "telepathy"}]}, "input.0", "does not match any of the expected tags"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role", "Input should be"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name", "Field required"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "Input should be"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "Input should be"),
    ],
)  # fmt: skip
def test_refused_requests_name_the_field(body, param, fragment):
    with pytest.raises(P.OpenAIError) as info:
        parse(**body).to_chat()
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message


def test_chat_errors_are_renamed_to_this_api():
    req = parse(instructions="x", input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    _, origin = req.to_chat()
    cases = {
        "messages.2.content": "input.1.content",
        "messages.0.content": "instructions.content",
        "max_tokens": "max_output_tokens",
        "response_format.json_schema.schema": "text.format.schema",
        "tools.1.function.parameters": "tools.1.parameters",
        "tool_choice.function.name": "tool_choice.name",
        "reasoning_effort": "reasoning.effort",
        "reasoning_budget": "reasoning_budget",
    }
    for chat_param, own in cases.items():
        err = ResponsesRequest.rename(P.OpenAIError(400, f"{chat_param}: bad", param=chat_param), origin)
        assert (err.param, err.message) == (own, f"{own}: bad")
