"""Answer extraction from generated text and answer checking; never raises on odd model output.

Rules of :func:`extract_answer`:

1. Look only after the first ``</think>`` if there is one (the trace may contain numbers and even
   ``A:``-like text), otherwise at the whole text.
2. Cut that tail at the first ``<eos>`` / ``<pad>`` / ``<bos>`` so junk generated after the end of
   the answer is ignored.
3. The answer is what follows the first ``A:`` (spaces around the colon tolerated: ``A : 4``,
   ``A:  4``) up to the end of its line or the next special token, stripped.
4. With no usable ``A:``, fall back to the last integer in the tail; ``None`` if there is none.
"""

from __future__ import annotations

import re

from components.data.reasoning import BOS, EOS, PAD, THINK_CLOSE, THINK_OPEN, UNK

__all__ = ["extract_answer", "is_correct", "normalize_answer"]

# "A" not glued to a preceding letter (so "QA:" or "DATA:" do not count), optional spaces, colon.
_ANSWER_RE = re.compile(r"(?<![A-Za-z])A[ \t]*:")
# A sign counts only when it is not a binary operator ("6-2" holds the integers 6 and 2, not -2).
_INT_RE = re.compile(r"(?:(?<![\w)])[+-])?\d+")
_INT_FULL_RE = re.compile(r"[+-]?\d+")
_STOP_TOKENS = (EOS, PAD, BOS)
# Anything that ends the answer span on its line.
_SPAN_END_RE = re.compile("|".join(re.escape(t) for t in (THINK_OPEN, THINK_CLOSE, UNK, "\n", "\r")))


def extract_answer(text: str) -> str | None:
    """The predicted answer in generated ``text``, or ``None`` if there is none (see module rules)."""
    if not isinstance(text, str):
        return None
    _, close, after = text.partition(THINK_CLOSE)
    tail = after if close else text
    for stop in _STOP_TOKENS:
        tail = tail.split(stop, 1)[0]
    match = _ANSWER_RE.search(tail)
    if match:
        span = tail[match.end() :]
        end = _SPAN_END_RE.search(span)
        answer = (span[: end.start()] if end else span).strip()
        if answer:
            return answer
    numbers = _INT_RE.findall(tail)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Strip and collapse internal whitespace runs to one space."""
    return " ".join(answer.split())


def _as_int(text: str) -> int | None:
    return int(text) if _INT_FULL_RE.fullmatch(text) else None


def is_correct(pred: str | None, answer: str) -> bool:
    """Whether ``pred`` matches ``answer``: whitespace-normalised text, or equal integers when both
    parse as integers (so ``"04"`` / ``"+4"`` match ``"4"``)."""
    if pred is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(str(answer))
    ia, ib = _as_int(a), _as_int(b)
    if ia is not None and ib is not None:
        return ia == ib
    return a == b
