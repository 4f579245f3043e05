"""Reading a model's answer from generated text, and checking it against a reference; never raises.

How to read an answer is configurable (:class:`AnswerFormat`: ``prefix``, ``boxed``, ``hash``,
``regex``, ``last_number``), because every evaluation set writes its final answer its own way. Only
the text after the first close marker is read, cut at the first stop token; answers are compared as
exact fractions when both sides parse as numbers (:func:`is_correct`).

The kinds and rules 1-4 in full: docs/data.md ("Reading answers").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from components.data.reasoning import BOS, EOS, PAD, THINK_CLOSE, THINK_OPEN, UNK

__all__ = [
    "AnswerFormat",
    "AnswerReader",
    "extract_answer",
    "is_correct",
    "normalize_answer",
    "parse_number",
]

AnswerKind = Literal["prefix", "boxed", "hash", "regex", "last_number"]

# A sign counts only when it is not a binary operator ("6-2" holds the numbers 6 and 2, not -2).
_NUMBER_RE = re.compile(r"(?:(?<![\w)])[+-])?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_DECIMAL_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_FRACTION_RE = re.compile(r"[+-]?\d+/\d+")
_LATEX_FRAC_RE = re.compile(r"([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{(\d+)\}")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPERS_RE = re.compile(r"^\\(?:text|textbf|mathrm|mathbf|boxed)\{(.*)\}$", re.DOTALL)


class AnswerFormat(BaseModel):
    """How to read the model's final answer from its output (kinds: docs/data.md, "Reading answers")."""

    model_config = ConfigDict(extra="forbid")

    kind: AnswerKind = Field("prefix", description="prefix | boxed | hash | regex | last_number.")
    prefix: str = Field("A:", min_length=1, description="kind prefix: the text that introduces the answer.")
    pattern: str | None = Field(
        None, description="kind regex: a Python regular expression with exactly one capturing group."
    )
    fallback_last_number: bool = Field(
        True, description="When the kind finds no answer, take the last number of the output instead."
    )

    @model_validator(mode="after")
    def _check(self) -> AnswerFormat:
        if self.kind == "regex":
            if not self.pattern:
                raise ValueError("answer_format.pattern: kind 'regex' needs a pattern with one capturing group")
            try:
                groups = re.compile(self.pattern).groups
            except re.error as err:
                raise ValueError(f"answer_format.pattern: not a valid regular expression ({err})") from None
            if groups != 1:
                raise ValueError(
                    f"answer_format.pattern: needs exactly one capturing group, {self.pattern!r} has {groups}"
                )
        elif self.pattern is not None:
            raise ValueError(f"answer_format.pattern: only used by kind 'regex', not {self.kind!r}; remove it")
        return self


def _prefix_re(prefix: str) -> re.Pattern[str]:
    """``A:`` -> ``(?<![A-Za-z])A[ \\t]*:``: not glued to a preceding letter, spaces before the colon."""
    glue = r"(?<![A-Za-z])" if prefix[0].isalpha() else ""
    if prefix.endswith(":") and len(prefix) > 1:
        return re.compile(glue + re.escape(prefix[:-1].rstrip()) + r"[ \t]*:")
    return re.compile(glue + re.escape(prefix))


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces (None if there is none or it is unclosed)."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


@dataclass(frozen=True)
class AnswerReader:
    """An :class:`AnswerFormat` plus the texts that bound an answer (markers and stop tokens).

    ``stop_tokens`` cut the tail (rule 2); ``span_end`` ends a ``prefix`` / ``hash`` span (rule 3).
    The defaults are the demo's special tokens; :meth:`for_tokenizer` takes a tokenizer's.
    """

    fmt: AnswerFormat = field(default_factory=AnswerFormat)
    think_close: str = THINK_CLOSE
    stop_tokens: tuple[str, ...] = (EOS, PAD, BOS)
    span_end: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE, UNK)

    @classmethod
    def for_tokenizer(cls, fmt: AnswerFormat, tokenizer: Any) -> AnswerReader:
        """Stop tokens: every special token of ``tokenizer`` but the markers and ``<unk>``."""
        markers = tokenizer.markers
        unk = getattr(tokenizer.hf, "unk_token", None)
        keep = {markers.think_open, markers.think_close, unk}
        stops = tuple(s for s in tokenizer.special_tokens if s and s not in keep)
        ends = tuple(s for s in (markers.think_open, markers.think_close, unk) if s)
        return cls(fmt, markers.think_close, stops, ends)

    def _cut(self, tail: str) -> str:
        for stop in self.stop_tokens:
            tail = tail.split(stop, 1)[0]
        return tail

    def _span(self, span: str) -> str:
        """``span`` up to its first line end or span-end text, stripped."""
        ends = [i for i in (span.find(t) for t in (*self.span_end, "\n", "\r")) if i >= 0]
        return span[: min(ends, default=len(span))].strip()

    def read(self, answer_text: str) -> str | None:
        """The answer in the text generated after the close marker (an answer phase); None if none."""
        if not isinstance(answer_text, str):
            return None
        try:
            return self._read(self._cut(answer_text))
        except Exception:  # a reader must not stop an evaluation over one odd output
            return None

    def extract(self, text: str) -> str | None:
        """The answer in a whole generation (thinking included): rules 1-4 of docs/data.md ("Reading answers")."""
        if not isinstance(text, str):
            return None
        _, close, after = text.partition(self.think_close)
        return self.read(after if close else text)

    def _read(self, tail: str) -> str | None:
        fmt = self.fmt
        found: str | None = None
        if fmt.kind == "prefix":
            match = _prefix_re(fmt.prefix).search(tail)
            found = self._span(tail[match.end() :]) if match else None
        elif fmt.kind == "boxed":
            found = _boxed(tail)
        elif fmt.kind == "hash":
            _, sep, rest = tail.rpartition("####")
            found = self._span(rest) if sep else None
        elif fmt.kind == "regex":
            match = re.search(fmt.pattern or "", tail)
            found = match.group(1) if match and match.group(1) is not None else None
        found = found.strip() if found else None
        if found:
            return found
        if fmt.kind == "last_number" or fmt.fallback_last_number:
            numbers = _NUMBER_RE.findall(tail)
            return numbers[-1] if numbers else None
        return None

    def is_correct(self, answer_text: str, reference: str) -> bool:
        """Whether an answer phase's text holds ``reference`` (:meth:`read` + :func:`is_correct`)."""
        return is_correct(self.read(answer_text), reference)

    def is_correct_generation(self, text: str, reference: str) -> bool:
        """Whether a whole generation (thinking included) holds ``reference`` (:meth:`extract`)."""
        return is_correct(self.extract(text), reference)

    def with_format(self, fmt: AnswerFormat | None) -> AnswerReader:
        """This reader with another answer format (None: unchanged)."""
        return self if fmt is None or fmt == self.fmt else replace(self, fmt=fmt)


def extract_answer(text: str, fmt: AnswerFormat | None = None) -> str | None:
    """The predicted answer in a whole generated ``text`` with the demo's markers (module rules)."""
    return AnswerReader(fmt or AnswerFormat()).extract(text)


def normalize_answer(answer: str) -> str:
    """Strip; collapse whitespace runs to one space; drop one pair of surrounding ``$``, a trailing
    ``.`` and ``\\text{}`` / ``\\mathrm{}`` / ``\\boxed{}``-style wrappers."""
    text = " ".join(str(answer).split())
    for _ in range(3):  # a few layers: "$\\text{yes}$."
        before = text
        text = text.removesuffix(".").strip()
        if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
            text = text[1:-1].strip()
        wrapped = _WRAPPERS_RE.match(text)
        if wrapped:
            text = wrapped.group(1).strip()
        if text == before:
            break
    return text


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (integers, decimals, ``1,234``, ``3/4``, ``\\frac{3}{4}``,
    a leading ``$`` currency sign); None when it is not one number."""
    s = normalize_answer(text).replace(" ", "").removeprefix("$").removeprefix("\\$")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    latex = _LATEX_FRAC_RE.fullmatch(s)
    if latex:
        s = f"{latex.group(1)}{latex.group(2)}/{latex.group(3)}"
    if not (_DECIMAL_RE.fullmatch(s) or _FRACTION_RE.fullmatch(s)):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def is_correct(pred: str | None, answer: str | int | float) -> bool:
    """Whether ``pred`` matches ``answer``: equal numbers when both parse, else equal normalised texts."""
    if pred is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(str(answer))
    if not a:
        return False
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return na == nb
    return a == b
