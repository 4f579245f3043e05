"""The OpenAI-compatible wire format: errors, response models, SSE (the request models: :mod:`.request_models`).

Every error is an :class:`OpenAIError` that renders as OpenAI's JSON error body with its status; a request
that fails validation is a 400 naming the field (:func:`validation_error`). Responses carry the thinking
as ``reasoning_content`` and the budgets used (:class:`BudgetControl`).

Design notes (defaults, ``n`` and prompt lists, logprobs, echo, errors): docs/serving.md ("The wire format").
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, model_serializer

PROMPT_FORMS = "prompt: must be a string, a list of strings, a list of token ids (integers) or a list of token-id lists"


# ---------------------------------------------------------------------- errors
class OpenAIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unavailable(message: str, retry_after_s: float, code: str = "overloaded") -> OpenAIError:
    """A 503 with ``Retry-After`` (whole seconds, at least 1)."""
    seconds = max(1, int(-(-retry_after_s // 1)))
    return OpenAIError(503, message, type="server_error", code=code, headers={"Retry-After": str(seconds)})


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _loc(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p.startswith(("function-", "union[")))]
    parts = [p for p in parts if p not in _UNION_TAGS and not p.startswith(("list[", "dict[", "literal["))]  # members
    return ".".join(parts) or None


def validation_error(err: ValidationError, deepest: bool = False) -> OpenAIError:
    """The first problem of a pydantic error as a 400 naming the parameter (``deepest``: the problem with the
    longest path instead, e.g. inside a list of items rather than "not a string" for ``str | list[...]``)."""
    first = max(err.errors(), key=lambda e: len(e["loc"])) if deepest else err.errors()[0]
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    param = _loc(first["loc"])
    if param is not None and param.split(".")[0] == "prompt" and first["type"] != "missing":
        return OpenAIError(400, PROMPT_FORMS, param="prompt", code="invalid_value")
    more = f" (and {len(err.errors()) - 1} more problems)" if len(err.errors()) > 1 else ""
    msg = first["msg"].removeprefix("Value error, ")
    where = f"{param}: " if param else ""
    code = "unknown_parameter" if first["type"] == "extra_forbidden" else "invalid_value"
    if first["type"] == "missing":
        code = "missing_parameter"
    return OpenAIError(400, f"{where}{msg}{more}", param=param, code=code)


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code="unsupported_value")


# ---------------------------------------------------------------------- responses
class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails


class BudgetControl(BaseModel):
    """How the request was generated (an extension field): which budgets, and how thinking ended."""

    think_model: str | None
    answer_model: str
    think_stop: str
    answer_start: str
    answer_fed_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Chat log-probabilities: one entry per answer token."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions log-probabilities (parallel lists; prompt tokens first with ``echo``)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    """A streamed tool call: sent whole, once its block is complete (``index`` counts the choice's calls)."""

    index: int


class AssistantMessage(BaseModel):
    """``tool_calls`` is left out when the answer holds none (as vLLM leaves it out)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    budget_control: BudgetControl | None = None


class ChatDelta(BaseModel):
    """A stream delta; fields that are None are left out (a delta carries only what changed)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    reasoning_content: str | None = None
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A ``text_completion`` response or stream chunk (same shape, as in the OpenAI API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    budget_control: BudgetControl | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "star-elastic"
    total_params: int
    active_params: int
    active_fraction: float
    architecture: dict[str, Any]
    format: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------- helpers
def usage(prompt_tokens: int, reasoning_tokens: int, answer_tokens: int) -> Usage:
    completion = reasoning_tokens + answer_tokens
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def sse(payload: BaseModel | dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (``[DONE]`` passes through as is)."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    elif isinstance(payload, dict):
        text = json.dumps(payload)
    else:
        text = payload
    return f"data: {text}\n\n".encode()
