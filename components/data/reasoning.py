"""Built-in verifiable reasoning task: chained modular arithmetic with reasoning traces.

A problem applies a chain of ``op operand`` steps strictly left to right, modulo ``modulus`` after
every step (prompt ``Q:7+5*3-2``, one trace line per step, answer ``4``), so every trace line and
every answer is checkable (:func:`evaluate_chain`, :func:`check_trace`). Held-out sets
(:func:`generate_eval_sets`) come from seed streams apart from the training stream; pass their
prompts as ``exclude=`` to make training and evaluation strictly disjoint.

Design notes (trace format, chat layout): docs/data.md ("The built-in reasoning task").
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Special tokens of the demo tokenizer (components.data.tokenizer.build_demo_tokenizer).
BOS = "<bos>"
EOS = "<eos>"
PAD = "<pad>"
UNK = "<unk>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
PROMPT_PREFIX = "Q:"
ANSWER_PREFIX = "A:"

#: Offset added to the seed of every held-out (evaluation) stream; a prime so that training seeds
#: ``s`` and ``s + k`` for small ``k`` never land on an evaluation stream by accident.
EVAL_SEED_OFFSET = 1_000_003

SOURCE_NAME = "modarith"

Operator = Literal["+", "-", "*"]

# Rejection sampling under ``exclude`` gives up after this many consecutive rejections: by then the
# exclusion set covers (nearly) all of the reachable problem space and looping would never end.
_MAX_CONSECUTIVE_REJECTIONS = 10_000


@dataclass(frozen=True)
class Problem:
    """One reasoning example.

    Attributes:
        prompt: question text, e.g. ``"Q:7+5*3-2\\n"``.
        reasoning: trace inside the think tags; lines separated by ``"\\n"`` and ending with
            ``"\\n"``; empty for a direct-answer example.
        answer: the final answer text, e.g. ``"4"``.
        steps: number of reasoning steps (0 if unknown, e.g. loaded from JSONL).
        source: where the example comes from (``"modarith"``, ``"jsonl:<file>"``, ...).
    """

    prompt: str
    reasoning: str
    answer: str
    steps: int = 0
    source: str = SOURCE_NAME


class ProblemConfig(BaseModel):
    """Knobs of the chained modular arithmetic generator."""

    model_config = ConfigDict(extra="forbid")

    min_steps: int = Field(1, ge=1, description="Fewest operations in a chain (inclusive).")
    max_steps: int = Field(6, ge=1, description="Most operations in a chain (inclusive).")
    modulus: int = Field(
        10,
        description="Values live in 0..modulus-1; at most 10 so every operand and result is one character.",
    )
    operators: list[Operator] = Field(
        default_factory=lambda: ["+", "-", "*"],
        min_length=1,
        description="Operators drawn uniformly for each step.",
    )
    fold_prob: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="Probability that a trace line folds 2 (sometimes 3) consecutive steps into one line.",
    )
    direct_prob: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Probability that an example has an empty reasoning trace (answer directly).",
    )

    @model_validator(mode="after")
    def _check(self) -> ProblemConfig:
        if not 2 <= self.modulus <= 10:
            raise ValueError(f"modulus must be between 2 and 10 so operands are single characters, got {self.modulus}")
        if self.min_steps > self.max_steps:
            raise ValueError(
                f"min_steps ({self.min_steps}) must be <= max_steps ({self.max_steps})",
            )
        return self


def derive_seed(*parts: object) -> int:
    """A 63-bit seed derived from ``parts``; stable across processes (unlike ``hash()``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def apply_op(value: int, op: str, operand: int, modulus: int) -> int:
    """One step: ``(value op operand) mod modulus`` (Python ``%`` keeps it non-negative)."""
    if op == "+":
        return (value + operand) % modulus
    if op == "-":
        return (value - operand) % modulus
    if op == "*":
        return (value * operand) % modulus
    raise ValueError(f"unknown operator {op!r}")


def evaluate_chain(expr: str, modulus: int = 10) -> int:
    """Evaluate ``"7+5*3"`` left to right modulo ``modulus``; characters alternate digit/operator."""
    if len(expr) % 2 == 0 or not expr[0].isdigit():
        raise ValueError(f"malformed chain {expr!r}")
    value = int(expr[0]) % modulus
    for i in range(1, len(expr), 2):
        op, operand = expr[i], expr[i + 1]
        if not operand.isdigit():
            raise ValueError(f"malformed chain {expr!r}")
        value = apply_op(value, op, int(operand), modulus)
    return value


def _trace(start: int, ops: list[tuple[str, int]], modulus: int, fold_prob: float, rng: random.Random) -> str:
    """Trace lines covering ``ops``; each line may fold 2-3 steps when ``fold_prob`` fires."""
    lines: list[str] = []
    value = start
    i = 0
    while i < len(ops):
        width = 1
        remaining = len(ops) - i
        # Mixed coarseness: the model sees both single steps and short chains resolved at once.
        if remaining >= 2 and fold_prob > 0 and rng.random() < fold_prob:
            width = 3 if remaining >= 3 and rng.random() < 1 / 3 else 2
        expr = str(value)
        for op, operand in ops[i : i + width]:
            expr += f"{op}{operand}"
            value = apply_op(value, op, operand, modulus)
        lines.append(f"{expr}={value}\n")
        i += width
    return "".join(lines)


def _draw(config: ProblemConfig, rng: random.Random, steps: int | None = None) -> Problem:
    """Draw one problem from ``rng`` (the only source of randomness)."""
    m = config.modulus
    n_steps = rng.randint(config.min_steps, config.max_steps) if steps is None else steps
    start = rng.randrange(m)
    ops = [(rng.choice(config.operators), rng.randrange(m)) for _ in range(n_steps)]
    prompt = PROMPT_PREFIX + str(start) + "".join(f"{op}{x}" for op, x in ops) + "\n"
    # The trace is drawn even for a direct example so each problem consumes the rng the same way.
    direct = config.direct_prob > 0 and rng.random() < config.direct_prob
    reasoning = _trace(start, ops, m, config.fold_prob, rng)
    value = start
    for op, x in ops:
        value = apply_op(value, op, x, m)
    return Problem(
        prompt=prompt,
        reasoning="" if direct else reasoning,
        answer=str(value),
        steps=n_steps,
        source=SOURCE_NAME,
    )


def iter_problems(
    config: ProblemConfig,
    seed: int,
    *,
    exclude: Iterable[str] | None = None,
    held_out: bool = False,
    steps: int | None = None,
) -> Iterator[Problem]:
    """Infinite deterministic stream of problems.

    Args:
        config: generator knobs.
        seed: stream seed; the same seed gives the same problems.
        exclude: prompts that must never be produced (e.g. the evaluation prompts); rejected draws
            are redrawn, which slightly under-samples step counts whose space is mostly excluded.
        held_out: draw from the held-out stream (``seed + EVAL_SEED_OFFSET``) used for evaluation.
        steps: force this many steps (ignores ``min_steps``/``max_steps``; used for eval levels).

    Raises:
        ValueError: if ``exclude`` leaves (almost) nothing to draw.
    """
    rng = random.Random(seed + EVAL_SEED_OFFSET if held_out else seed)
    banned = frozenset(exclude) if exclude else frozenset()
    rejections = 0
    while True:
        problem = _draw(config, rng, steps)
        if problem.prompt in banned:
            rejections += 1
            if rejections > _MAX_CONSECUTIVE_REJECTIONS:
                raise ValueError(f"exclude ({len(banned)} prompts) covers almost the whole problem space of {config!r}")
            continue
        rejections = 0
        yield problem


def generate_problems(
    n: int,
    config: ProblemConfig,
    seed: int,
    *,
    exclude: Iterable[str] | None = None,
    held_out: bool = False,
) -> list[Problem]:
    """``n`` problems, deterministic by ``seed``; steps uniform in ``[min_steps, max_steps]``.

    ``exclude`` and ``held_out`` are as in :func:`iter_problems`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(islice(iter_problems(config, seed, exclude=exclude, held_out=held_out), n))


def generate_eval_sets(
    levels: list[int],
    n_per_level: int,
    seed: int,
    config: ProblemConfig | None = None,
) -> dict[int, list[Problem]]:
    """Held-out evaluation problems per difficulty level (number of steps).

    Each level draws from its own held-out stream (derived from ``seed + EVAL_SEED_OFFSET`` and the
    level) so adding a level does not change the others. Folding and direct answers are disabled:
    the ``reasoning`` field holds the canonical one-step-per-line trace. Levels may exceed
    ``config.max_steps`` (length generalisation). Prompts may repeat within a tiny level.
    """
    base = config or ProblemConfig()
    canonical = base.model_copy(update={"fold_prob": 0.0, "direct_prob": 0.0})
    sets: dict[int, list[Problem]] = {}
    for level in levels:
        if level < 1:
            raise ValueError(f"eval levels must be >= 1 step, got {level}")
        stream = iter_problems(canonical, derive_seed("eval", seed, level), held_out=True, steps=level)
        sets[level] = list(islice(stream, n_per_level))
    return sets


def eval_prompts(eval_sets: dict[int, list[Problem]]) -> set[str]:
    """All prompts of ``eval_sets``: pass as ``exclude=`` so training never sees them."""
    return {p.prompt for problems in eval_sets.values() for p in problems}


def held_out_prompts(
    levels: list[int], n_per_level: int, seed: int, config: ProblemConfig | None = None
) -> set[str] | None:
    """Prompts of :func:`generate_eval_sets` ``(levels, n_per_level, seed)`` for ``exclude=``; None when empty."""
    if not n_per_level or not levels:
        return None
    return eval_prompts(generate_eval_sets(levels, n_per_level, seed, config))


def parse_prompt(prompt: str) -> tuple[int, list[tuple[str, int]]]:
    """Inverse of the prompt layout: ``"Q:7+5*3\\n"`` -> ``(7, [("+", 5), ("*", 3)])``."""
    body = prompt.strip()
    if not body.startswith(PROMPT_PREFIX):
        raise ValueError(f"prompt does not start with {PROMPT_PREFIX!r}: {prompt!r}")
    chain = body[len(PROMPT_PREFIX) :]
    evaluate_chain(chain)  # validates the layout
    return int(chain[0]), [(chain[i], int(chain[i + 1])) for i in range(1, len(chain), 2)]


def check_trace(problem: Problem, modulus: int = 10) -> bool:
    """True if every trace line is arithmetically right, the lines chain through all prompt steps
    in order, and the answer is the chain's value. An empty trace only checks the answer."""
    start, ops = parse_prompt(problem.prompt)
    expected = start
    for op, x in ops:
        expected = apply_op(expected, op, x, modulus)
    if problem.answer != str(expected):
        return False
    if problem.reasoning == "":
        return True
    if not problem.reasoning.endswith("\n"):
        return False
    value, pos = start, 0  # pos: index into ops of the next step to cover
    for line in problem.reasoning[:-1].split("\n"):
        lhs, sep, rhs = line.partition("=")
        if not sep or not lhs or lhs[0] != str(value):
            return False
        try:
            if evaluate_chain(lhs, modulus) != int(rhs):
                return False
        except ValueError:
            return False
        line_ops = [(lhs[i], int(lhs[i + 1])) for i in range(1, len(lhs), 2)]
        if not line_ops or ops[pos : pos + len(line_ops)] != line_ops:
            return False
        pos += len(line_ops)
        value = int(rhs)
    return pos == len(ops) and value == expected
