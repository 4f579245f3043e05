"""The OpenAI-compatible wire format: request and response models, errors, chat messages, SSE.

Requests are validated strictly (``strict=True``, ``extra="forbid"``) from the raw JSON body, so a
wrong type, an unknown field or bad JSON is a 400 naming the field. Unimplemented OpenAI parameters
are accepted only at their neutral value. Extensions: ``reasoning_budget`` (standard budget control,
vLLM's ``thinking_token_budget`` is the same) and ``think_model`` (elastic budget control); the thinking
comes back as ``reasoning_content``. Structured outputs and tools: :mod:`components.serving.constraints`.

Design notes (defaults, ``n`` and prompt lists, logprobs, echo, errors): docs/serving.md ("The wire format").
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from components.serving.constraints import FUNCTION_NAME, ResponseFormat, StructuredOutputs, Tool, ToolChoice

MAX_STOP_STRINGS = 4
PROMPT_FORMS = "prompt: must be a string, a list of strings, a list of token ids (integers) or a list of token-id lists"
MAX_COMPLETION_LOGPROBS = 5
"""Largest ``logprobs`` on ``/v1/completions`` (the OpenAI API's limit)."""
MAX_TOP_LOGPROBS = 20
"""Largest ``top_logprobs`` on ``/v1/chat/completions`` (the OpenAI API's limit)."""


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


# ---------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


def json_object_text(v: str) -> str:
    """``v`` when it is the JSON text of an object (a tool call's arguments), else a ``ValueError``."""
    try:
        parsed = json.loads(v)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    if not isinstance(parsed, dict):
        raise ValueError("must be a JSON object")
    return v


class CalledFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="The arguments as JSON text (an object).")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        return json_object_text(v)


class ToolCallParam(_Strict):
    """A tool call of an earlier assistant turn."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template takes it: text content, optional fields only when given, tool
        calls with their arguments as objects (what chat templates render, as vLLM passes them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("reasoning_content", "name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        return out


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# (field, is the value neutral?, why a non-neutral value is refused); checked after validation
_Check = tuple[str, Callable[[Any], bool], str]
_COMMON_CHECKS: list[_Check] = [
    ("presence_penalty", lambda v: v in (None, 0), "penalties are not supported (send 0 or leave it out)"),
    ("frequency_penalty", lambda v: v in (None, 0), "penalties are not supported (send 0 or leave it out)"),
    ("repetition_penalty", lambda v: v in (None, 1), "penalties are not supported (send 1 or leave it out)"),
    ("logit_bias", lambda v: not v, "logit_bias is not supported (send {} or leave it out)"),
    ("top_k", lambda v: v in (None, 0, -1), "top_k sampling is not supported (send -1 or leave it out)"),
    ("min_p", lambda v: v in (None, 0), "min_p sampling is not supported (send 0 or leave it out)"),
]


class _GenerationRequest(_Strict):
    """Fields shared by both endpoints."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, description="Most ANSWER tokens (>= 1).")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    reasoning_budget: int | None = Field(None, description="Most thinking tokens (0: answer directly).")
    thinking_token_budget: int | None = Field(None, description="vLLM's name of reasoning_budget.")
    think_model: str | None = Field(None, min_length=1, description="Budget that thinks before `model` answers.")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's constraints (one of them).")
    n: int = Field(1, ge=1, description="Choices per prompt.")
    user: str | None = None
    # accepted at their neutral values only (see check_supported)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None

    _checks: ClassVar[list[_Check]] = _COMMON_CHECKS

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _budget_alias(self) -> _GenerationRequest:
        if self.thinking_token_budget is not None:
            if self.reasoning_budget is not None and self.reasoning_budget != self.thinking_token_budget:
                raise ValueError("reasoning_budget and thinking_token_budget disagree; give one")
            self.reasoning_budget = self.thinking_token_budget
        return self

    def check_supported(self) -> None:
        """Raise a 400 naming the first parameter set to a value this server does not implement."""
        for name, neutral, why in self._checks:
            if not neutral(getattr(self, name)):
                raise unsupported(name, why)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise unsupported("stream_options.continuous_usage_stats", "not supported; use include_usage (send false)")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token to return (None: no log-probabilities)."""
        raise NotImplementedError


_LEGACY_FUNCTIONS = "the legacy functions API is not supported; send tools and tool_choice"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""vLLM's ``reasoning_effort`` values; each maps to a think cap and optionally a thinking budget (config)."""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="Alias of max_tokens.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = Field(None, description="Mapped to think caps (serving config).")
    include_reasoning: bool = Field(True, description="False: the thinking still runs but is not returned.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    # accepted at their neutral values only
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    _checks: ClassVar[list[_Check]] = [
        *_COMMON_CHECKS,
        ("functions", lambda v: not v, _LEGACY_FUNCTIONS),
        ("function_call", lambda v: v in (None, "none", "auto"), _LEGACY_FUNCTIONS),
        ("service_tier", lambda v: v in (None, "auto", "default"), "only 'auto' or 'default' is supported"),
        ("store", lambda v: not v, "stored completions are not supported (send false)"),
        ("modalities", lambda v: v in (None, ["text"]), "only ['text'] is supported"),
        ("audio", lambda v: v is None, "audio output is not supported"),
        ("prediction", lambda v: v is None, "predicted outputs are not supported"),
        ("web_search_options", lambda v: v is None, "web search is not supported"),
    ]

    @model_validator(mode="after")
    def _alias(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; give one")
            self.max_tokens = self.max_completion_tokens
        return self

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Raw text (special-token strings allowed) or token ids, or a list of either."
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # accepted at their neutral values only
    best_of: int | None = None
    suffix: str | None = None

    _checks: ClassVar[list[_Check]] = [
        *_COMMON_CHECKS,
        ("suffix", lambda v: not v, "insertion (suffix) is not supported (send null or leave it out)"),
    ]

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n):
            raise unsupported("best_of", f"only best_of equal to n ({self.n}) is supported, got {self.best_of}")

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one or several, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt: empty list", param="prompt", code="invalid_value")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def parse_request(cls: type[_GenerationRequest], body: bytes) -> Any:
    """Validate a JSON body into ``cls``; :class:`OpenAIError` 400 naming the parameter otherwise."""
    try:
        req = cls.model_validate_json(body)
    except ValidationError as err:
        raise validation_error(err, deepest=True) from None
    req.check_supported()
    return req


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
