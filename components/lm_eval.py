"""Task accuracy of a causal LM on reasoning problems: think fully, or answer directly.

This is the small shared evaluator used by training stages to report how well a model (or one
budget of it, through a mask) solves held-out problems: built-in :class:`~components.data.Problem`
objects or items of a JSONL evaluation set (:class:`~components.eval_sets.EvalItem`). Questions are
rendered with the tokenizer's chat template (:func:`~components.eval_sets.thinking_prompt`), one
greedy decode per problem reads thinking and answer, and the answer is read after the close marker
with the item's ``answer_format`` (the demo's ``A:`` prefix for built-in problems).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from components.data.answers import AnswerFormat, AnswerReader
from components.data.reasoning import Problem
from components.data.tokenizer import TextTokenizer
from components.eval_sets import EvalItem, thinking_prompt
from model.generate import SamplingParams, generate
from model.masks import ModelMask


@dataclass
class TaskScore:
    """Accuracy over ``n`` problems and mean generated tokens per problem."""

    correct: int
    n: int
    mean_tokens: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0


def _chat(problem: Problem | EvalItem) -> tuple[dict[str, Any], ...]:
    if isinstance(problem, EvalItem):
        return problem.messages
    return ({"role": "user", "content": problem.prompt},)


def task_accuracy(
    model,
    tokenizer: TextTokenizer,
    problems: Sequence[Problem | EvalItem],
    think: bool = True,
    max_new_tokens: int = 96,
    mask: ModelMask | None = None,
    answer_format: AnswerFormat | None = None,
) -> TaskScore:
    """Greedy-decode every problem; ``think=False`` closes the thinking at once (answer directly).

    ``max_new_tokens`` bounds thinking and answer together. ``answer_format`` reads built-in
    problems (default: the ``A:`` prefix); an :class:`EvalItem` brings its own.
    """
    close_ids = [] if think else list(tokenizer.think_close_ids)
    prompts = [thinking_prompt(tokenizer, _chat(p)) + close_ids for p in problems]
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_ids=tokenizer.stop_ids)
    tokens, _ = generate(model, prompts, params, mask=mask)
    base = AnswerReader.for_tokenizer(answer_format or AnswerFormat(), tokenizer)
    prefix = "" if think else tokenizer.markers.think_close
    correct = 0
    for p, toks in zip(problems, tokens, strict=True):
        reader = base.with_format(p.answer_format if isinstance(p, EvalItem) else None)
        correct += reader.is_correct_generation(prefix + tokenizer.decode(toks), p.answer)
    mean_tokens = sum(len(t) for t in tokens) / max(len(tokens), 1)
    return TaskScore(correct, len(problems), mean_tokens)
