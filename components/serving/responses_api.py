"""The Responses API request (``POST /v1/responses``), as vLLM serves it: stateless, turned into a chat request.

``input`` is a string (one user message) or items: messages (``role`` with text or ``input_text`` /
``output_text`` parts), ``function_call`` and ``function_call_output`` items and ``reasoning`` items,
so a client can send a previous response's ``output`` back with its tool results (an answer's text and
the calls after it are one assistant turn; a reasoning item goes with the turn after it). ``instructions`` is
a system message before them. The request becomes a :class:`~components.serving.protocol.ChatCompletionRequest`
(:meth:`ResponsesRequest.to_chat`), so the chat template, budget control, structured outputs
(``text.format``) and tools behave exactly as on chat completions; errors from that path are renamed to
the Responses API's fields (:meth:`ResponsesRequest.rename`).

Stateless: nothing is stored (``store`` is accepted and answered ``false``), so ``previous_response_id`` and
``conversation`` are refused with a 400 saying to send the earlier items in ``input``.

Design notes: docs/serving.md ("The Responses API").
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from components.serving import protocol as P
from components.serving.constraints import FUNCTION_NAME, choice_kind
from components.serving.request_models import ChatCompletionRequest, ReasoningEffort, json_object_text

__all__ = ["ResponsesRequest"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


# ---------------------------------------------------------------------- input items
class TextPart(_Strict):
    """A text part; the output fields (annotations, logprobs) are accepted so a previous output can be sent back."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str
    id: str | None = None
    status: str | None = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        return json_object_text(v)


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningPart(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content if self.content else self.summary))


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return f"union[{kind}]"  # a union member's tag: left out of the error path (protocol._loc)


InputItem = Annotated[
    Annotated[MessageItem, Tag("union[message]")]
    | Annotated[FunctionCallItem, Tag("union[function_call]")]
    | Annotated[FunctionCallOutputItem, Tag("union[function_call_output]")]
    | Annotated[ReasoningItem, Tag("union[reasoning]")],
    Discriminator(_item_type),
]


# ---------------------------------------------------------------------- request options
class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None


_STATELESS = "this server is stateless (nothing is stored); send the earlier items in input instead"


class ResponsesRequest(_Strict):
    """A ``/v1/responses`` request: the Responses API's fields plus this server's budget-control extensions."""

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, description="Most ANSWER tokens (the thinking is bounded apart).")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: (
        Annotated[
            Annotated[Literal["none", "auto", "required"], Tag("union[mode]")]
            | Annotated[NamedFunction, Tag("union[named]")],
            Discriminator(choice_kind),
        ]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = Field(None, description="Accepted; nothing is stored (answered false).")
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    include: list[str] | None = Field(None, description="Accepted; the output always holds the reasoning items.")
    seed: int | None = None
    # extensions (as on chat completions)
    reasoning_budget: int | None = None
    thinking_token_budget: int | None = None
    think_model: str | None = Field(None, min_length=1)
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # refused unless neutral (check_supported)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    _checks: ClassVar[list[tuple[str, Any, str]]] = [
        ("previous_response_id", None, _STATELESS),
        ("conversation", None, _STATELESS),
        ("prompt", None, "stored prompts are not supported; send input and instructions"),
        ("background", (None, False), "background responses are not supported (send false)"),
        ("truncation", (None, "disabled"), "only 'disabled' is supported (a prompt too long is a 400)"),
        ("max_tool_calls", None, "not supported; use parallel_tool_calls: false for at most one call"),
        ("top_logprobs", (None, 0), "not supported on /v1/responses; use chat completions for logprobs"),
        ("service_tier", (None, "auto", "default"), "only 'auto' or 'default' is supported"),
    ]

    def check_supported(self) -> None:
        for name, neutral, why in self._checks:
            value = getattr(self, name)
            if value not in (neutral if isinstance(neutral, tuple) else (neutral,)):
                raise P.unsupported(name, why)

    # ------------------------------------------------------------------ to a chat request
    def messages(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Chat messages of ``instructions`` and ``input``, and the request field each came from."""
        messages: list[dict[str, Any]] = []
        origin: list[str] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
            origin.append("instructions")
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}], [*origin, "input"]
        reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, MessageItem):
                msg: dict[str, Any] = {"role": item.role, "content": item.text()}
                if item.role == "assistant" and reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
                origin.append(where)
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)  # the answer's text and its calls: one turn
                    continue
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
                origin.append(where)
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
                origin.append(where)
        return messages, origin

    def to_chat(self) -> tuple[ChatCompletionRequest, list[str]]:
        """The equivalent chat request, and the origin of each of its messages (for :meth:`rename`)."""
        messages, origin = self.messages()
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "seed": self.seed,
            "reasoning_budget": self.reasoning_budget, "thinking_token_budget": self.thinking_token_budget,
            "think_model": self.think_model, "include_reasoning": self.include_reasoning,
            "chat_template_kwargs": self.chat_template_kwargs, "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        }  # fmt: skip
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise P.OpenAIError(
                    400, "text.format.schema: required with type 'json_schema'", param="text.format.schema"
                )
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {k: v for k, v in schema.items() if v is not None},
            }
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}), origin
        except ValidationError as err:  # what only the chat rules check (e.g. no user message)
            raise self.rename(P.validation_error(err), origin) from None

    @staticmethod
    def rename(err: P.OpenAIError, origin: list[str]) -> P.OpenAIError:
        """``err`` (from the chat path) with the chat field names replaced by this request's."""
        param = err.param
        if param is None:
            return err
        parts = param.split(".")
        if parts[0] == "messages" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) < len(origin):
            new = ".".join([origin[int(parts[1])], *parts[2:]])
        else:
            renames = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                       "reasoning_effort": "reasoning.effort"}  # fmt: skip
            head = renames.get(parts[0], parts[0])
            rest = [p for p in parts[1:] if p != "function"] if parts[0] in ("tools", "tool_choice") else parts[1:]
            rest = rest[1:] if parts[0] == "response_format" and rest[:1] == ["json_schema"] else rest
            new = ".".join([head, *rest])
        message = err.message.replace(f"{param}:", f"{new}:", 1)
        return P.OpenAIError(err.status, message, err.type, new, err.code, err.headers)


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body; a 400 naming the field otherwise."""
    try:
        req = ResponsesRequest.model_validate_json(body)
    except ValidationError as err:
        raise P.validation_error(err, deepest=True) from None
    req.check_supported()
    return req


def dump_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's tools as the response echoes them."""
    return [json.loads(t.model_dump_json(exclude_none=True)) for t in req.tools or []]
