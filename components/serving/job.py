"""One sequence of a request as the serving engine runs it (:class:`Job`), and what it returns (:class:`JobResult`).

A request with ``n`` choices is ``n`` jobs. The engine (:mod:`components.serving.engine`) takes jobs from any
thread and posts their events back to the job's event loop; the batching rows
(:mod:`components.serving.batch`) read a job's sampling and grammar; the HTTP and MLflow front ends build
jobs and read results.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from components.serving.logprobs import LogprobEntry
from model import generate as gen  # the primitives of model.generate's batched loop
from model.request_plan import ChoiceSeeds

__all__ = ["Job", "JobResult"]


@dataclass
class JobResult:
    """A finished request: texts, token counts, how each phase ended, and timings (seconds).

    ``logprobs``: one entry per answer token (stop token included) when the job asked for them;
    ``prompt_logprobs``: one per prompt token with ``echo``.
    """

    reasoning: str | None
    content: str
    finish_reason: str
    prompt_tokens: int
    reasoning_tokens: int
    answer_tokens: int
    think_stop: str
    answer_start: str
    answer_fed: int
    first_token_s: float
    total_s: float
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry] | None = None
    reasoning_ids: list[int] = field(default_factory=list)  # the kept thinking (markers excluded)
    answer_ids: list[int] = field(default_factory=list)  # every sampled answer token, a stop token included


@dataclass(eq=False)
class Job:
    """One sequence of a request. ``think_budget`` None: no thinking phase (a plain completion).

    ``index``: the choice index its events carry; ``logprobs``: alternatives per answer token (None:
    no log-probabilities); ``echo``: also score the prompt (plain completions only); ``grammar``: this
    sequence's own grammar matcher (``components.serving.grammar``), applied to its answer phase only;
    ``seeds``: its phases' seeds, from :func:`model.request_plan.plan` (default: choice 0 of a request
    seeded ``sampling.seed``).
    """

    prompt: list[int]
    answer_budget: str
    think_budget: str | None
    think_cap: int | None
    max_tokens: int
    sampling: gen.SamplingParams
    stop: tuple[str, ...]
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0
    logprobs: int | None = None
    echo: bool = False
    grammar: Any = None
    constraint: Any = None  # the request's constraints.Constraint: how the answer is read back (tool calls)
    seeds: ChoiceSeeds | None = None
    cancelled: bool = False
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    think: gen.RowOutput | None = None
    think_kept: list[int] = field(default_factory=list)
    think_stop: str = "none"
    answer_start: str = "prefill"
    answer_fed: int = 0
    sent_think: int = 0  # thinking tokens already streamed
    sent_chars: int = 0  # answer characters already streamed
    sent_logprobs: int = 0  # answer logprob entries already streamed
    prompt_lp: list[LogprobEntry] | None = None

    @property
    def phase_seeds(self) -> ChoiceSeeds:
        """``seeds``, or those of choice 0 of a request seeded ``sampling.seed`` when none were given."""
        return self.seeds if self.seeds is not None else ChoiceSeeds.of(self.sampling.seed)

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, payload))
        except RuntimeError:  # the request's loop is gone: nobody is listening any more
            self.cancelled = True
