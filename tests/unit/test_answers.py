"""Answer reading (every answer_format kind), normalisation and numeric comparison, hand-written cases."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from components.data.answers import AnswerFormat, AnswerReader, is_correct, normalize_answer, parse_number

PREFIX = AnswerReader(AnswerFormat())
BOXED = AnswerReader(AnswerFormat(kind="boxed"))
HASH = AnswerReader(AnswerFormat(kind="hash"))
LAST = AnswerReader(AnswerFormat(kind="last_number"))
REGEX = AnswerReader(AnswerFormat(kind="regex", pattern=r"answer is\s*\(?([A-E])\)?"))


@pytest.mark.parametrize(
    ("reader", "text", "expected"),
    [
        (PREFIX, "A:4<eos>", "4"),
        (PREFIX, " A : 12\nmore", "12"),
        (PREFIX, "QA: 3 then A:5", "5"),  # 'QA:' is not 'A:'
        (PREFIX, "A:<eos>", None),
        (PREFIX, "nothing 6-2", "2"),  # fallback: last number, '-' between digits is an operator
        (BOXED, "so \\boxed{3} or rather \\boxed{\\frac{1}{2}}.<eos>", "\\frac{1}{2}"),
        (BOXED, "\\boxed{x^{2}+1}", "x^{2}+1"),
        (BOXED, "\\fbox{7}", "7"),
        (BOXED, "\\boxed{12", "12"),  # unclosed: fallback to the last number
        (HASH, "Step 1: 3+4=7\n#### 7\n", "7"),
        (HASH, "#### 1 #### 1,234 dollars", "1,234 dollars"),
        (LAST, "I got 3.5, then -2 and finally 1,250.<eos> 99", "1,250"),
        (LAST, "no digits", None),
        (REGEX, "The answer is (C). Also the answer is D", "C"),
        (REGEX, "the answer is B", "B"),
    ],
)
def test_read(reader: AnswerReader, text: str, expected: str | None) -> None:
    assert reader.read(text) == expected


def test_fallback_can_be_switched_off():
    strict = AnswerReader(AnswerFormat(kind="boxed", fallback_last_number=False))
    assert strict.read("the result is 42") is None
    assert strict.read("\\boxed{42}") == "42"


def test_extract_looks_after_the_close_marker_and_cuts_at_stop_tokens():
    text = "<think>\\boxed{1}\n</think>The result: \\boxed{2}<eos>\\boxed{3}"
    assert BOXED.extract(text) == "2"
    assert BOXED.extract("\\boxed{5} no marker") == "5"
    # custom markers and stop tokens, as a tokenizer gives them
    reader = AnswerReader(AnswerFormat(), "[/THINK]", ("<|im_end|>",), ("[THINK]", "[/THINK]", "<unk>"))
    assert reader.extract("A:1\n[/THINK]A:8[THINK]x<|im_end|>A:9") == "8"
    assert reader.read("A:3<|im_end|>A:4") == "3"


def test_for_tokenizer_takes_special_tokens_but_markers_and_unk():
    markers = SimpleNamespace(think_open="<think>", think_close="</think>")
    tok = SimpleNamespace(
        markers=markers,
        hf=SimpleNamespace(unk_token="<unk>"),
        special_tokens=("<|endoftext|>", "<|im_end|>", "<think>", "</think>", "<unk>"),
    )
    reader = AnswerReader.for_tokenizer(AnswerFormat(kind="hash"), tok)
    assert reader.stop_tokens == ("<|endoftext|>", "<|im_end|>")
    assert reader.span_end == ("<think>", "</think>", "<unk>")
    assert reader.read("#### 5<unk>7<|im_end|>#### 6") == "5"


def test_reader_never_raises():
    for reader in (PREFIX, BOXED, HASH, LAST, REGEX):
        for junk in ["", "\\boxed{", "####", "}}}{{{", "\x00\n", None, 3, "A:"]:
            reader.read(junk)  # type: ignore[arg-type]
            reader.extract(junk)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4", Fraction(4)),
        ("+04", Fraction(4)),
        ("-3.50", Fraction(-7, 2)),
        ("1,234", Fraction(1234)),
        ("$1,234.5", Fraction(2469, 2)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{2}", Fraction(-1, 2)),
        ("$\\frac{2}{4}$", Fraction(1, 2)),
        ("1e3", Fraction(1000)),
        ("12.", Fraction(12)),
        ("1/0", None),
        ("1,23", None),
        ("4 apples", None),
        ("x", None),
    ],
)
def test_parse_number(text: str, expected: Fraction | None) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("pred", "answer", "ok"),
    [
        ("4.0", "4", True),
        ("8/2", 4, True),
        ("\\frac{1}{2}", "0.5", True),
        ("1,000", "1000", True),
        ("0.333", "1/3", False),  # exact comparison, no tolerance
        ("\\text{yes}", "yes", True),
        ("$x+1$.", "x+1", True),
        ("Yes", "yes", False),
        ("x  +  1", "x + 1", True),
        ("", "", False),
        (None, "4", False),
    ],
)
def test_is_correct(pred: str | None, answer: str | int, ok: bool) -> None:
    assert is_correct(pred, answer) is ok


def test_normalize_answer():
    assert normalize_answer("  $\\text{ blue  car }$. ") == "blue car"
    assert normalize_answer("\\boxed{7}") == "7"


def test_format_validation_names_the_field():
    with pytest.raises(ValidationError, match="answer_format.pattern: kind 'regex' needs a pattern"):
        AnswerFormat(kind="regex")
    with pytest.raises(ValidationError, match="exactly one capturing group"):
        AnswerFormat(kind="regex", pattern=r"(a)(b)")
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        AnswerFormat(kind="regex", pattern=r"(a")
    with pytest.raises(ValidationError, match="only used by kind 'regex'"):
        AnswerFormat(kind="boxed", pattern=r"(a)")
    with pytest.raises(ValidationError, match="extra"):
        AnswerFormat(kind="boxed", group=1)
