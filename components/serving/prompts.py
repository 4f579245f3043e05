"""How request text becomes prompt ids: the rules the HTTP server and the registry's pyfunc share.

Chat messages go through the checkpoint's chat template, and control text in them (a special token
or a reasoning marker) is refused, not escaped; completion prompts are raw text on purpose. A chat
always thinks unless the template closed the thinking; a completion thinks when it ends with the
open marker. Errors are :class:`PromptError` (a ``ValueError`` naming the request field).

Design notes: docs/serving.md ("Prompt rules").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from components.data.tokenizer import TextTokenizer
    from components.serving.tools import ToolFormat

__all__ = ["CHECKED_FIELDS", "PromptError", "PromptRules", "check_length", "check_messages", "check_strings"]

CHECKED_FIELDS = ("content", "reasoning_content", "name", "tool_call_id", "tool_calls")
"""Message fields the chat template renders as text, so the ones checked for control text."""
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize", "chat_template"}
)
"""Template variables the server sets itself: ``chat_template_kwargs`` may not override them."""


class PromptError(ValueError):
    """A prompt the rules refuse; ``param`` names the request field at fault, ``code`` the kind of fault."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def check_messages(messages: Sequence[Mapping[str, Any]], forbidden: Callable[[str], list[str]]) -> None:
    """Refuse a chat with no user message, or with control text in a rendered field of any message.

    ``forbidden(text)`` lists the special tokens and reasoning markers found in ``text``.

    Raises:
        PromptError: ``param`` ``"messages"`` or ``"messages.<i>.<field>"``.
    """
    if not any(m.get("role") == "user" for m in messages):
        raise PromptError("messages: at least one message with role 'user' is required", "messages")
    for i, m in enumerate(messages):
        for key in CHECKED_FIELDS:
            if m.get(key) is not None:
                check_strings(m[key], f"messages.{i}.{key}", forbidden)


def check_strings(value: Any, param: str, forbidden: Callable[[str], list[str]]) -> None:
    """Refuse control text in ``value`` or in any string nested in it (a template renders them all).

    Raises:
        PromptError: ``param`` extended by the path to the string (``tools.0.function.description``).
    """
    if isinstance(value, str):
        bad = forbidden(value)
        if bad:
            raise PromptError(
                f"{param}: must not contain the special tokens or reasoning markers {bad} (they would act "
                "as control tokens); remove them from the text",
                param,
                "special_token",
            )
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_strings(k, param, forbidden)
            check_strings(v, f"{param}.{k}", forbidden)
    elif isinstance(value, (list, tuple)):
        for k, v in enumerate(value):
            check_strings(v, f"{param}.{k}", forbidden)


def check_length(ids: Sequence[int], limit: int, param: str) -> None:
    """Refuse an empty prompt or one longer than ``limit`` tokens.

    Raises:
        PromptError: naming ``param``.
    """
    if not ids:
        raise PromptError(f"{param}: empty prompt", param)
    if len(ids) > limit:
        raise PromptError(f"{param}: {len(ids)} tokens, more than the limit of {limit} (max_prompt_tokens)", param)


class PromptRules:
    """The prompt rules over one tokenizer (module docstring): chat and completion ids, visible text."""

    def __init__(self, tokenizer: TextTokenizer, tool_format: ToolFormat | None = None) -> None:
        self.tokenizer, self.tool_format = tokenizer, tool_format
        markers = tokenizer.markers
        self.markers = tuple(m for m in (markers.think_open, markers.think_close) if m)
        # tokens decoded from a prompt's end to find a marker (whitespace after it included)
        self._tail = len(tokenizer.think_open_ids) + len(tokenizer.think_close_ids) + 8

    def forbidden(self, text: str) -> list[str]:
        """Special tokens and reasoning markers found in ``text``."""
        found = list(self.tokenizer.contains_special(text))
        return found + [m for m in self.markers if m in text and m not in found]

    def thinking(self, ids: Sequence[int]) -> Literal["open", "closed"] | None:
        """``"open"`` / ``"closed"`` when ``ids`` end with that marker (trailing whitespace aside), else None."""
        tok = self.tokenizer
        tail = tok.decode(list(ids[-self._tail :])).rstrip()
        if tail.endswith(tok.markers.think_open):
            return "open"
        return "closed" if tail.endswith(tok.markers.think_close) else None

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], bool]:
        """``(prompt ids, whether it thinks)`` of chat ``messages`` (dicts as the chat template takes them),
        with ``tools`` (OpenAI function tools) and ``template_kwargs`` passed to the template.

        An assistant turn's ``tool_calls`` reach a template that renders them; for one that does not, they
        are folded into the turn's content in the tool format's own text (as reasoning is folded).

        Raises:
            PromptError: from :func:`check_messages` / :func:`check_strings`, or a reserved template kwarg.
        """
        check_messages(messages, self.forbidden)
        check_strings(list(tools or []), "tools", self.forbidden)
        check_strings(dict(template_kwargs or {}), "chat_template_kwargs", self.forbidden)
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
        reserved += sorted(set(self.tokenizer.hf.special_tokens_map).intersection(template_kwargs or {}))
        if reserved:
            param = f"chat_template_kwargs.{reserved[0]}"
            raise PromptError(f"{param}: set by the server; it cannot be overridden", param)
        msgs = [self._fold_calls(dict(m)) for m in messages]
        ids = list(self.tokenizer.prompt_ids(msgs, list(tools) if tools else None, dict(template_kwargs or {})))
        state = self.thinking(ids)
        if state is None:  # the template does not open the thinking: open it, so budget control applies
            ids += list(self.tokenizer.think_open_ids)
        return ids, state != "closed"

    def _fold_calls(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        if not calls or self.tool_format is None or self.tokenizer.template_mentions("tool_calls"):
            return message
        text = self.tool_format.render([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        content = message.get("content") or ""
        return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": content + text}

    def completion(self, prompt: str | Sequence[int], param: str = "prompt") -> tuple[list[int], bool]:
        """``(prompt ids, whether it thinks)`` of a raw-text or token-id completion prompt.

        Raises:
            PromptError: a token id outside the vocabulary (``param`` names the prompt).
        """
        tok = self.tokenizer
        if isinstance(prompt, str):
            ids = list(tok.encode(prompt))
        else:
            bad = [i for i in prompt if not 0 <= i < tok.vocab_size]
            if bad:
                raise PromptError(f"{param}: token ids {bad[:5]} outside [0, {tok.vocab_size})", param)
            ids = list(prompt)
        return ids, bool(ids) and self.thinking(ids) == "open"

    def visible_text(self, ids: Sequence[int]) -> str:
        """What a client is shown of ``ids``: no special tokens, no reasoning marker strings."""
        text = self.tokenizer.decode(ids, skip_special=True)
        for marker in self.markers:
            text = text.replace(marker, "")
        return text
