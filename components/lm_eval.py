"""Task accuracy of a causal LM on reasoning problems: think fully, think with a cap, or answer directly.

This is the small shared evaluator used by training stages to report how well a
model (or one budget of it, through a mask) solves held-out demo problems.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from components.data import THINK_CLOSE, Problem, extract_answer, format_prompt, is_correct
from components.data.tokenizer import CharTokenizer
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


def task_accuracy(
    model,
    tokenizer: CharTokenizer,
    problems: Sequence[Problem],
    think: bool = True,
    max_new_tokens: int = 96,
    mask: ModelMask | None = None,
) -> TaskScore:
    """Greedy-decode every problem; ``think=False`` closes the think tag at once (answer directly)."""
    prefix = "" if think else THINK_CLOSE
    prompts = [tokenizer.encode(format_prompt(p) + prefix) for p in problems]
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_ids=(tokenizer.eos_id,))
    tokens, _ = generate(model, prompts, params, mask=mask)
    correct = 0
    for p, toks in zip(problems, tokens, strict=True):
        text = prefix + tokenizer.decode(toks)
        correct += is_correct(extract_answer(text), p.answer)
    mean_tokens = sum(len(t) for t in tokens) / max(len(tokens), 1)
    return TaskScore(correct, len(problems), mean_tokens)
