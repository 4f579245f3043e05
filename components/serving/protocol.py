"""The OpenAI-compatible wire format: request and response models, errors, the chat template, SSE.

Design choices:

* Requests are validated strictly (``strict=True``, ``extra="forbid"``) from the raw JSON body, so
  a string where a number belongs, an unknown field or bad JSON is a 400 whose ``param`` names the
  field, never a silent coercion or a server error. OpenAI parameters this server does not
  implement are accepted only at their neutral value (``n=1``, penalties 0, no logprobs), and
  rejected with a message saying so otherwise.
* Two extensions, accepted by the official client through ``extra_body``: ``reasoning_budget``
  (most thinking tokens: standard budget control) and ``think_model`` (the budget that thinks
  before ``model`` answers: elastic budget control). ``max_tokens`` bounds the ANSWER only; the
  thinking phase is bounded by ``reasoning_budget``.
* The thinking is returned apart from the answer, as ``reasoning_content`` in the message (and in
  stream deltas), the field name common OpenAI-compatible reasoning servers use; the official
  client exposes it as an attribute of the message. ``usage.completion_tokens`` counts every
  generated token, thinking included, and ``completion_tokens_details.reasoning_tokens`` the
  thinking ones (tokens cut at a cap included: they were computed).
* Defaults are the OpenAI API's (``temperature`` 1, ``top_p`` 1); ``temperature`` 0 is greedy.
  ``stop`` strings end the ANSWER (thinking ends at ``</think>`` or the budget) and are not returned.
* ``/v1/completions`` takes the prompt as raw text (special-token strings such as ``<bos>`` become
  their tokens) or token ids, and continues it. A prompt ending with ``<think>`` runs the thinking
  phase (so ``reasoning_budget`` / ``think_model`` apply and the thinking comes back as the choice's
  ``reasoning_content``); any other prompt is one plain phase, and those two fields are rejected.
* Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``.

Chat template (the demo model is a single-turn reasoning model): the content of the LAST user
message is the problem text; system messages and earlier turns are ignored. The prompt is::

    <bos>Q:{problem}\\n<think>

(``components.data.format_prompt``; a leading ``Q:`` in the message is not doubled, surrounding
whitespace is stripped). The model then writes its thinking, ``</think>``, and the answer
(``A:`` and the value for the demo task), which is returned as ``content``. A message may not
contain special-token strings such as ``<think>``: they would become control tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from components.data import PROMPT_PREFIX, Problem, format_prompt
from components.data.tokenizer import SPECIAL_TOKENS

MAX_STOP_STRINGS = 4


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


def _loc(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p.startswith(("function-", "union[")))]
    return ".".join(parts) or None


def validation_error(err: ValidationError) -> OpenAIError:
    """The first problem of a pydantic error as a 400 naming the parameter."""
    first = err.errors()[0]
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    param = _loc(first["loc"])
    more = f" (and {len(err.errors()) - 1} more problems)" if len(err.errors()) > 1 else ""
    msg = first["msg"].removeprefix("Value error, ")
    where = f"{param}: " if param else ""
    code = "unknown_parameter" if first["type"] == "extra_forbidden" else "invalid_value"
    if first["type"] == "missing":
        code = "missing_parameter"
    return OpenAIError(400, f"{where}{msg}{more}", param=param, code=code)


# ---------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


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
    think_model: str | None = Field(None, min_length=1, description="Budget that thinks before `model` answers.")
    # accepted at their neutral values only
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | None = None
    user: str | None = None

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
    def _unsupported(self) -> _GenerationRequest:
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        if self.presence_penalty != 0 or self.frequency_penalty != 0:
            raise ValueError("presence_penalty / frequency_penalty: penalties are not supported (use 0)")
        if self.logprobs:
            raise ValueError("logprobs: not supported")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="Alias of max_tokens.")

    @model_validator(mode="after")
    def _alias(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; give one")
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] = Field(description="Raw text (special-token strings allowed) or token ids.")
    echo: bool = False

    @model_validator(mode="after")
    def _no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported")
        return self


def parse_request(cls: type[_GenerationRequest], body: bytes) -> Any:
    """Validate a JSON body into ``cls``; :class:`OpenAIError` 400 naming the parameter otherwise."""
    try:
        return cls.model_validate_json(body)
    except ValidationError as err:
        raise validation_error(err) from None


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The demo prompt of a conversation (see the module docstring for the template)."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise OpenAIError(400, "messages: at least one message with role 'user' is required", param="messages")
    i = users[-1]
    text = messages[i].text().strip()
    if not text:
        raise OpenAIError(400, f"messages.{i}.content: the last user message is empty", param=f"messages.{i}.content")
    bad = [t for t in SPECIAL_TOKENS if t in text]
    if bad:
        raise OpenAIError(
            400, f"messages.{i}.content: must not contain special tokens {bad}", param=f"messages.{i}.content"
        )
    text = text.removeprefix(PROMPT_PREFIX).strip()
    return format_prompt(Problem(prompt=f"{PROMPT_PREFIX}{text}\n", reasoning="", answer=""))


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None


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

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None


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
    logprobs: None = None


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
