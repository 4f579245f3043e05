"""A request's plan: which budget thinks and which answers, its token limits, and every choice's seeds.

The three paths that serve a request plan it here -- the HTTP server (``components.serving.state``), the
MLflow model (``components.mlflow_model``) and evaluation (:func:`model.phases.budget_control`) -- so one
request means the same thing on each: the same checks, the same phases and the same sampled tokens.

Design choices:

* Checks, each a :class:`PlanError` naming the caller's field: both budgets are known; the thinking
  budget is not larger (by active parameters) than the answering one unless allowed (elastic budget
  control saves by thinking on a smaller budget); ``max_tokens`` is in ``[1, max_tokens_limit]``, the
  think cap is None or in ``[0, max_tokens_limit]``; ``n >= 1``; a prompt that does not think refuses the
  thinking fields its client set. The paths name the fields differently (the server's ``model`` is the
  MLflow model's ``budget`` and evaluation's ``answer_budget``), so each passes its own :class:`Fields`.
* Phases: a prompt that thinks is a thinking phase on ``think_model`` (default: the answering budget)
  then an answer phase on ``answer_model``; a prompt that does not think is one plain phase.
* The seeding rule. Choice ``k`` of a request seeded ``s`` samples its phases with::

      c(s, k) = s if k == 0 else row_seed(s, k)      the choice's seed
      thinking  row_seed(c(s, k), 0)
      answer    row_seed(c(s, k), 1)
      plain     row_seed(c(s, k), 0)                 (a plain prompt has no thinking: stream 0 is free)

  Seeds are a function of ``(seed, choice, phase)`` only, never of the row's position in a batch, of
  the rows beside it or of the path that serves it. Choice 0 keeps the request's seed, so ``n = 1`` and
  choice 0 of ``n > 1`` sample alike; a cap of 0 (nothing thought) still answers with the answer seed.
  ``row_seed`` is :func:`model.generate.row_seed`. An unseeded request (``seed`` None) draws fresh
  randomness on every path.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from model.generate import row_seed

Phase = Literal["think", "answer", "plain"]
_STREAM: dict[str, int] = {"think": 0, "plain": 0, "answer": 1}
"""Each phase's stream of a choice's seed (thinking and plain never share a choice)."""


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request seeded ``seed`` (choice 0: ``seed`` itself)."""
    return seed if choice == 0 else row_seed(seed, choice)


def phase_seed(seed: int | None, choice: int, phase: Phase) -> int | None:
    """The sampling seed of ``phase`` of choice ``choice`` (module docstring); None for an unseeded request."""
    return None if seed is None else row_seed(choice_seed(seed, choice), _STREAM[phase])


@dataclass(frozen=True)
class ChoiceSeeds:
    """The sampling seeds of one choice's phases (None: unseeded). ``plain`` is the thinking stream."""

    think: int | None
    answer: int | None

    @classmethod
    def of(cls, seed: int | None, choice: int = 0) -> ChoiceSeeds:
        return cls(phase_seed(seed, choice, "think"), phase_seed(seed, choice, "answer"))

    @property
    def plain(self) -> int | None:
        return self.think


def decode_seeds(seeds: Sequence[ChoiceSeeds], phase: Phase) -> list[int] | None:
    """One phase's seed per row, as ``model.generate.decode_rows`` takes them.

    None when no row is seeded (``decode_rows`` then draws fresh ones itself, and only when it samples);
    an unseeded row among seeded ones draws a fresh seed here.
    """
    chosen = [s.answer if phase == "answer" else s.think for s in seeds]
    if all(seed is None for seed in chosen):
        return None
    return [random.getrandbits(62) if seed is None else seed for seed in chosen]


class PlanError(ValueError):
    """A request the plan refuses. ``param``: the caller's field; ``unknown_budget``: it names no budget."""

    def __init__(self, message: str, param: str, unknown_budget: bool = False) -> None:
        super().__init__(message)
        self.message, self.param, self.unknown_budget = message, param, unknown_budget


@dataclass(frozen=True)
class Fields:
    """The caller's names of the request's fields, used in errors (defaults: evaluation's names)."""

    answer: str = "answer_budget"
    think: str = "think_budget"
    cap: str = "think_cap"
    max_tokens: str = "max_tokens"
    n: str = "n"


@dataclass(frozen=True)
class Limits:
    """What a path serves and allows.

    ``active_params``: every budget's active parameters by name; ``max_tokens_limit``: the most answer or
    thinking tokens a request may ask for (None: no limit); ``think_open``: the open marker, named in the
    error for a prompt that does not think.
    """

    active_params: Mapping[str, int]
    allow_think_larger: bool = False
    max_tokens_limit: int | None = None
    think_open: str = "<think>"


@dataclass(frozen=True)
class Request:
    """One prompt of a request, as the planner reads it.

    ``thinks``: the prompt opens a thinking phase; ``think_model`` None thinks on ``answer_model``;
    ``think_cap`` None thinks up to the path's think limit; ``thinking_fields``: the fields the client
    set that only a thinking prompt may have (refused when ``thinks`` is False).
    """

    prompt: Sequence[int]
    answer_model: str
    max_tokens: int
    thinks: bool = True
    think_model: str | None = None
    think_cap: int | None = None
    n: int = 1
    seed: int | None = None
    thinking_fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChoicePlan:
    """What one choice decodes: ``think_model`` None is a plain completion (one phase, no cap)."""

    prompt: list[int]
    answer_model: str
    think_model: str | None
    think_cap: int | None
    max_tokens: int
    choice: int
    seeds: ChoiceSeeds


def check_budget(name: str, field: str, limits: Limits) -> str:
    """``name`` if it is a budget, else a :class:`PlanError` naming ``field`` and the budgets."""
    if name not in limits.active_params:
        raise PlanError(f"{field}: unknown budget {name!r}; valid budgets {list(limits.active_params)}", field, True)
    return name


def check_budgets(think: str, answer: str, limits: Limits, fields: Fields = Fields()) -> None:
    """Both budgets known (the answering one first) and the thinking one not larger unless allowed."""
    check_budget(answer, fields.answer, limits)
    check_budget(think, fields.think, limits)
    size_t, size_a = limits.active_params[think], limits.active_params[answer]
    if size_t > size_a and not limits.allow_think_larger:
        raise PlanError(
            f"{fields.think}: {think!r} ({size_t:,} active parameters) is larger than {fields.answer} {answer!r} "
            f"({size_a:,}); elastic budget control thinks on a smaller budget (allow_think_larger allows it)",
            fields.think,
        )


def check_count(value: object, field: str, low: int, high: int | None = None) -> None:
    """``value`` is an integer in ``[low, high]`` (``high`` None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise PlanError(f"{field}: must be an integer {bound}, got {value!r}", field)


def check_tokens(max_tokens: int, think_cap: int | None, limits: Limits, fields: Fields = Fields()) -> None:
    """``max_tokens`` in ``[1, limit]`` and ``think_cap`` None or in ``[0, limit]``."""
    check_count(max_tokens, fields.max_tokens, 1, limits.max_tokens_limit)
    if think_cap is not None:
        check_count(think_cap, fields.cap, 0, limits.max_tokens_limit)


def plan(request: Request, limits: Limits, fields: Fields = Fields()) -> list[ChoicePlan]:
    """The request's choices, in order (choice ``k`` at index ``k``), checked and seeded (module docstring)."""
    check_count(request.n, fields.n, 1)
    check_tokens(request.max_tokens, request.think_cap, limits, fields)
    answer = check_budget(request.answer_model, fields.answer, limits)
    think, cap = None, None
    if request.thinks:
        think = request.think_model if request.think_model is not None else answer
        check_budgets(think, answer, limits, fields)
        cap = request.think_cap
    elif request.thinking_fields:
        names = " / ".join(request.thinking_fields)
        raise PlanError(
            f"{names}: this prompt has no thinking phase (a completion prompt must end with {limits.think_open!r} "
            "to think)",
            request.thinking_fields[0],
        )
    prompt = list(request.prompt)
    return [
        ChoicePlan(prompt, answer, think, cap, request.max_tokens, k, ChoiceSeeds.of(request.seed, k))
        for k in range(request.n)
    ]
