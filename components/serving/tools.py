"""Tool calls in the model's own text format: the grammar that forces one, the parser that reads them back.

A format (:class:`ToolFormat`) is named in the serving config (``tool_parser``) and says how a model
writes its calls between an open and a close tag: ``hermes`` (the default; Qwen, Hermes and many
templates) writes one JSON object ``{"name": ..., "arguments": {...}}`` per ``<tool_call>`` block,
``nemotron_v2`` one JSON list of them inside ``<TOOLCALL>...</TOOLCALL>``. Each format gives:

* :meth:`ToolFormat.grammar`: a Lark grammar (llguidance) of one or more calls of the given tools,
  each call's arguments constrained by the tool's JSON schema: what ``tool_choice`` ``required`` or a
  named function enforces, so even a model that never learned the format returns calls that parse;
* :meth:`ToolFormat.parse`: calls and the text before them, from a finished answer;
* :class:`ToolStream`: the same, incrementally, for streaming (content as it grows, each call once its
  block is complete);
* :meth:`ToolFormat.render`: calls as the model writes them, for chat templates that do not read an
  assistant turn's ``tool_calls`` (folded into its content, as reasoning is folded).

Blocks that are not valid JSON are dropped; when no block is valid the whole answer is content (as vLLM
answers). Design notes: docs/serving.md ("Structured outputs and tool calls").
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from components.serving.grammar import JsonStyle, closed_schema, json_options, lark_literal

__all__ = ["FORMATS", "ParsedCall", "ToolFormat", "ToolSpec", "ToolStream", "tool_format"]

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: its name and the JSON schema of its arguments."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call ``{"name": <this name>, "arguments": {...}}``, name first (the
        arguments' objects closed: :func:`~components.serving.grammar.closed_schema`)."""
        return {
            "type": "object",
            "properties": {"name": {"const": self.name}, "arguments": closed_schema(dict(self.parameters))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }


@dataclass(frozen=True)
class ParsedCall:
    """A tool call read from the model's text: ``arguments`` is JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _any_call(tools: Sequence[ToolSpec]) -> dict[str, Any]:
    schemas = [t.call_schema() for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _call(item: Any) -> ParsedCall | None:
    """A call from one decoded JSON item, or None when it is not ``{"name": str, "arguments": object}``."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(item["name"], json.dumps(args, ensure_ascii=False))


class ToolFormat(ABC):
    """How a model writes tool calls: blocks between ``open`` and ``close`` (subclasses say what is inside)."""

    name: ClassVar[str]
    open: ClassVar[str]
    close: ClassVar[str]

    @abstractmethod
    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, style: JsonStyle) -> str:
        """A Lark grammar of the answer: one call of ``tools`` (more than one when ``parallel``)."""
        raise NotImplementedError

    @abstractmethod
    def decode_block(self, body: str) -> list[ParsedCall] | None:
        """The calls of one block's inner text, or None when it does not parse."""
        raise NotImplementedError

    @abstractmethod
    def render(self, calls: Sequence[tuple[str, Any]]) -> str:
        """``(name, arguments object)`` calls as the model writes them."""
        raise NotImplementedError

    # ------------------------------------------------------------------ reading
    def blocks(self, text: str, final: bool) -> tuple[int, list[tuple[str, bool]]]:
        """Where the first block opens (``len(text)`` when none does) and every block's inner text with
        whether it is closed; an unclosed last block counts only when ``final``."""
        first = text.find(self.open)
        if first < 0:
            return len(text), []
        out, at = [], first
        while at >= 0:
            start = at + len(self.open)
            end = text.find(self.close, start)
            if end < 0:
                if final:
                    out.append((text[start:], False))
                break
            out.append((text[start:end], True))
            at = text.find(self.open, end + len(self.close))
        return first, out

    def parse(self, text: str, parallel: bool = True) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of a finished answer: the text before the first block (None when empty) and
        every valid block's calls (only the first call when not ``parallel``). No valid call: the whole
        text is content."""
        first, blocks = self.blocks(text, final=True)
        calls = [c for body, _ in blocks for c in (self.decode_block(body) or [])]
        if not calls:
            return text, []
        return text[:first] or None, calls if parallel else calls[:1]


class Hermes(ToolFormat):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call."""

    name, open, close = "hermes", "<tool_call>", "</tool_call>"

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, style: JsonStyle) -> str:
        schema = {**_any_call(tools), "x-guidance": json_options(style)}
        call = f"call: {lark_literal(self.open + chr(10))} body {lark_literal(chr(10) + self.close)}"
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f"{start}\n{call}\nbody: %json {json.dumps(schema, ensure_ascii=False)}\n"

    def decode_block(self, body: str) -> list[ParsedCall] | None:
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            return None
        return None if call is None else [call]

    def render(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{self.open}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{self.close}"
            for n, a in calls
        )


class NemotronV2(ToolFormat):
    """``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>``: one block holding a list of calls."""

    name, open, close = "nemotron_v2", "<TOOLCALL>", "</TOOLCALL>"

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, style: JsonStyle) -> str:
        schema: dict[str, Any] = {"type": "array", "items": _any_call(tools), "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        schema["x-guidance"] = json_options(style)
        return f"start: {lark_literal(self.open)} body {lark_literal(self.close)}\nbody: %json {json.dumps(schema)}\n"

    def decode_block(self, body: str) -> list[ParsedCall] | None:
        try:
            items = json.loads(body)
        except json.JSONDecodeError:
            return None
        calls = [_call(i) for i in items] if isinstance(items, list) else [None]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]

    def render(self, calls: Sequence[tuple[str, Any]]) -> str:
        items = [{"name": n, "arguments": a} for n, a in calls]
        return f"{self.open}{json.dumps(items, ensure_ascii=False)}{self.close}"


FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, NemotronV2)}
"""Tool-call formats by the name the serving config's ``tool_parser`` takes."""


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"tool_parser: unknown format {name!r}; known: {sorted(FORMATS)}")
    return FORMATS[name]()


class ToolStream:
    """Incremental :meth:`ToolFormat.parse` of one streamed answer: :meth:`feed` the text so far, get the
    content delta and the calls completed since the last feed; :meth:`finish` at the end.

    Content is sent up to the first block; text that may be the start of the open tag is held back.
    Whatever the stream sent, concatenated, equals :meth:`ToolFormat.parse` of the whole text.
    """

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
        self.fmt, self.parallel = fmt, parallel
        self.sent_chars = 0  # content characters sent
        self.sent_calls = 0  # calls sent

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that could begin the open tag."""
        tag = self.fmt.open
        return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)

    def _calls(self, blocks: list[tuple[str, bool]]) -> list[ParsedCall]:
        calls = [c for body, _ in blocks for c in (self.fmt.decode_block(body) or [])]
        return calls if self.parallel else calls[:1]

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """``(content delta, new calls)`` given the whole answer text so far."""
        first, blocks = self.fmt.blocks(text, final=False)
        end = first if first < len(text) else len(text) - self._held(text)
        content = text[self.sent_chars : end] if end > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, end)
        calls = self._calls(blocks)[self.sent_calls :]
        self.sent_calls += len(calls)
        return content, calls

    def finish(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The rest, given the whole answer: the last block's calls, or (no call at all) the held text."""
        first, blocks = self.fmt.blocks(text, final=True)
        calls = self._calls(blocks)[self.sent_calls :]
        self.sent_calls += len(calls)
        if self.sent_calls == 0:  # nothing parsed: the whole text is content
            rest, self.sent_chars = text[self.sent_chars :], len(text)
            return rest, []
        return "", calls
