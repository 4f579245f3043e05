"""The OpenAI-compatible wire format's requests: chat and completion requests, their messages, strict parsing.

Requests are validated strictly (``strict=True``, ``extra="forbid"``) from the raw JSON body, so a
wrong type, an unknown field or bad JSON is a 400 naming the field (:func:`parse_request`). Unimplemented
OpenAI parameters are accepted only at their neutral value. Extensions: ``reasoning_budget`` (standard
budget control, vLLM's ``thinking_token_budget`` is the same) and ``think_model`` (elastic budget control).
Structured outputs and tools: :mod:`components.serving.constraints`; errors and responses:
:mod:`components.serving.protocol`.

Design notes (defaults, ``n`` and prompt lists, logprobs, echo, errors): docs/serving.md ("The wire format").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from components.serving.constraints import FUNCTION_NAME, ResponseFormat, StructuredOutputs, Tool, ToolChoice
from components.serving.protocol import OpenAIError, unsupported, validation_error

MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5
"""Largest ``logprobs`` on ``/v1/completions`` (the OpenAI API's limit)."""
MAX_TOP_LOGPROBS = 20
"""Largest ``top_logprobs`` on ``/v1/chat/completions`` (the OpenAI API's limit)."""


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
