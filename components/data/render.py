"""Rows of every layout -> token ids and a per-token target flag, through the tokenizer's chat template.

Chat rows (and prompt/response rows, as a two-turn chat) are rendered by the chat template; the
targets are every assistant turn (reasoning, answer and the turn's closing tokens). Text rows are
``[bos] + encode(text) + [eos]`` with every token but the first a target. Assistant spans are found
by incremental prefix rendering, which needs a prefix-stable template (:class:`TemplateError` otherwise).

Design notes (reasoning fields, span finding): docs/data.md ("Rendering rows").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from components.data.tokenizer import ReasoningMarkers, TextTokenizer

__all__ = ["Example", "Row", "TemplateError", "assistant_spans", "normalize_messages", "render_rows"]


_REASONING_ALIASES = ("reasoning", "thinking")


class TemplateError(ValueError):
    """The chat template does not let assistant turns be located by prefix rendering."""


@dataclass(frozen=True)
class Row:
    """One training row before tokenization: either chat ``messages`` or plain ``text``.

    Attributes:
        origin: where it comes from, for error messages (``"data/train.jsonl row 17"``, ``"generator:42"``).
        messages: chat turns (``role``, ``content``, optional ``reasoning_content``), or None.
        text: pre-training style text, or None.
    """

    origin: str
    messages: list[dict[str, Any]] | None = None
    text: str | None = None

    def user_texts(self) -> list[str]:
        """Contents of the user turns (what ``exclude=`` prompt sets are matched against)."""
        return [m.get("content") or "" for m in self.messages or () if m.get("role") == "user"]


@dataclass
class Example:
    """A tokenized row.

    Attributes:
        ids: token ids, length ``n``.
        targets: ``n`` flags; ``targets[t]`` is True when token ``t`` is a target (a batch's loss mask is
            this shifted left by one: position ``t - 1`` predicts token ``t``).
        origin: the row's origin.
        source: name of the source it was drawn from (set by the mixture).
    """

    ids: list[int]
    targets: list[bool]
    origin: str = ""
    source: str = field(default="")

    def __len__(self) -> int:
        return len(self.ids)


def _split_reasoning(message: dict[str, Any], markers: ReasoningMarkers) -> dict[str, Any]:
    """An assistant message whose content starts with ``think_open`` and holds ``think_close``
    -> ``reasoning_content`` (the text between) and ``content`` (the text after the close)."""
    if message.get("reasoning_content") is not None:
        return message
    content = message.get("content") or ""
    body = content.lstrip()
    if not body.startswith(markers.think_open):
        return message
    end = body.find(markers.think_close, len(markers.think_open))
    if end < 0:
        return message
    out = dict(message)
    out["reasoning_content"] = body[len(markers.think_open) : end]
    out["content"] = body[end + len(markers.think_close) :]
    return out


def normalize_messages(
    messages: Any, markers: ReasoningMarkers, origin: str, empty_reasoning: bool = False
) -> list[dict[str, Any]]:
    """Validated copies of chat ``messages``: ``role`` and ``content`` strings (a None content is ""),
    fields that are None dropped (columnar files fill absent fields with None), reasoning split out
    of assistant contents; with ``empty_reasoning`` an assistant turn without reasoning gets ``""``.

    Raises:
        ValueError: naming ``origin`` and the message index for a malformed message.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{origin}: 'messages' must be a non-empty list of {{role, content}}, got {messages!r:.80}")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{origin}: messages[{k}] must be an object with 'role' and 'content'")
        m = {key: v for key, v in m.items() if v is not None}
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{origin}: messages[{k}] has no string field 'role'")
        content = m.get("content", "")
        if not isinstance(content, str):
            raise ValueError(
                f"{origin}: messages[{k}].content must be a string, got {type(content).__name__} "
                "(multi-part contents are not supported)"
            )
        m["content"] = content
        for alias in _REASONING_ALIASES:  # other names datasets use for the same field
            if alias in m and "reasoning_content" not in m:
                m["reasoning_content"] = m.pop(alias)
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{origin}: messages[{k}].reasoning_content must be a string")
        if m["role"] == "assistant":
            m = _split_reasoning(m, markers)
            if empty_reasoning and m.get("reasoning_content") is None:
                m["reasoning_content"] = ""
        out.append(m)
    return out


def assistant_spans(
    tok: TextTokenizer, messages: list[dict[str, Any]], origin: str
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering of ``messages`` and the character span of every assistant turn in it.

    Raises:
        TemplateError: when the template is not prefix-stable for this conversation (docs/data.md).
        ValueError: when the conversation has no assistant turn (nothing to train on).
    """

    def render(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return tok.render_chat(msgs, add_generation_prompt=add_generation_prompt)
        except Exception as err:  # jinja / template errors: say which row made the template fail
            raise ValueError(
                f"{origin}: the chat template failed on the first {len(msgs)} messages ({type(err).__name__}: {err})"
            ) from err

    full = render(messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(messages[:k], True)
        upto = full if k == len(messages) - 1 else render(messages[: k + 1], False)
        if not upto.startswith(prefix) or not full.startswith(upto):
            raise TemplateError(
                f"{origin}: the chat template is not prefix-stable at assistant turn {k}: rendering the first "
                f"{k} messages with the generation prompt ({prefix[-40:]!r}...) is not a prefix of the rendering "
                "through that turn, or that is not a prefix of the whole conversation (templates that rewrite "
                "earlier turns, e.g. drop their reasoning); split such rows into one conversation per "
                "assistant turn"
            )
        spans.append((len(prefix), len(upto)))
    if not spans:
        raise ValueError(f"{origin}: chat row has no assistant turn, so no token would be trained on")
    return full, spans


def _targets_in_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token: whether its start offset lies in one of ``spans`` (sorted, disjoint); one linear pass
    because token starts never decrease."""
    targets = [False] * len(offsets)
    j = 0
    for t, (start, _) in enumerate(offsets):
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        targets[t] = start >= spans[j][0]
    return targets


def render_rows(tok: TextTokenizer, rows: Sequence[Row]) -> list[Example]:
    """Tokenize ``rows`` (one batched encoder call for all of them) with their target flags."""
    chat_texts: list[str] = []
    chat_spans: list[list[tuple[int, int]]] = []
    chat_index: list[int] = []
    text_index: list[int] = []
    plain: list[str] = []
    for i, row in enumerate(rows):
        if row.messages is not None:
            messages = normalize_messages(row.messages, tok.markers, row.origin, tok.generation_opens_thinking)
            text, spans = assistant_spans(tok, messages, row.origin)
            chat_texts.append(text)
            chat_spans.append(spans)
            chat_index.append(i)
        elif row.text is not None:
            plain.append(row.text)
            text_index.append(i)
        else:
            raise ValueError(f"{row.origin}: row has neither messages nor text")
    out: list[Example | None] = [None] * len(rows)
    for i, spans, (ids, offsets) in zip(chat_index, chat_spans, tok.encode_with_offsets(chat_texts), strict=True):
        out[i] = Example(ids, _targets_in_spans(offsets, spans), rows[i].origin)
    head = [tok.bos_id] if tok.bos_id is not None else []
    for i, body in zip(text_index, tok.encode_batch(plain), strict=True):
        ids = head + body + [tok.eos_id]
        out[i] = Example(ids, [False] + [True] * (len(ids) - 1), rows[i].origin)
    return out  # type: ignore[return-value]
