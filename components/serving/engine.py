"""The serving engine: one weight copy, every budget a model, a batched two-phase decode loop.

Design choices:

* The engine decodes on a :class:`~components.serving.loading.LoadedModel`: one weight copy, every
  budget a view of it (:mod:`components.serving.loading`).
* One decode thread owns the models and every cache. Requests arrive from the event loop through a
  thread-safe inbox and leave as events posted back to the loop, so the loop (health checks,
  streaming) never waits on a matmul, and two decode steps never compete for the same cores.
* Batching is at the step level (continuous batching). A *row* is one request in one phase
  (thinking or answering); rows that start from the same cached length and feed the same number of
  tokens to the same budget are prefilled together as a *group* (the rule of :mod:`model.generate`:
  no padding ever enters a Mamba state). Once prefilled, groups of one budget merge into one
  decoding batch (up to ``batch_max_size`` rows): Mamba states are per row, and shorter KV histories
  are left-padded and masked (:func:`model.cache.concat_caches`), so requests that arrive while
  others are decoding join them at their next step (``merge_running_batches``). The thread steps
  every active group once per iteration; when rows finish, the padding every remaining row shares
  is trimmed. An idle engine waits up to ``batch_wait_timeout_s`` for concurrent requests before it
  starts a batch, but only while traffic
  is concurrent (two or more requests in flight within the last second): a lone client never pays
  the wait. ``batch_max_size`` bounds a group. Sampling, stops and limits are per row, so requests
  with different parameters still share a batch.
* The two phases follow :func:`model.phases.think_then_answer` exactly, using its helpers for the
  cap cut and the resume state: thinking stops at ``</think>`` (or ``<eos>``) or at the cap, where
  it is cut after its last line break; standard budget control (think budget = answer budget)
  continues from the cache (a Mamba snapshot at the last line break when the cut needs one); elastic
  budget control re-prefills ``prompt + thinking + </think>`` on the answering budget. Seeds are
  ``row_seed(seed, 0)`` for thinking and ``row_seed(seed, 1)`` for answering, which is what
  ``think_then_answer`` gives a one-prompt call, so a seeded request is reproducible whatever it
  is batched with (up to float rounding of batched matmuls). That function itself is not called
  because it decodes a whole phase per call; streaming needs each token as it is sampled.
* Streaming: thinking is sent line by line (text after the last line break may still be cut by the
  cap, so it is held back); the answer is sent as it grows, minus a tail as long as the longest stop
  string (a stop string is never sent, as in the OpenAI API).
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from components.serving.config import ServingConfig
from components.serving.loading import LoadedModel
from model import generate as gen  # the primitives of model.generate's batched loop
from model.cache import concat_caches
from model.phases import _kept as kept_thinking  # the cut rule of think_then_answer, shared on purpose
from model.phases import _resume_state as resume_state  # ... and its resume rule


# ---------------------------------------------------------------------- requests and rows
@dataclass
class JobResult:
    """A finished request: texts, token counts, how each phase ended, and timings (seconds)."""

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


@dataclass(eq=False)
class Job:
    """One request. ``think_budget`` None: no thinking phase (a plain completion)."""

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

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the request's loop is gone: nobody is listening any more
            self.cancelled = True


@dataclass(eq=False)
class Row:
    """One request in one phase: what to feed, where to stop, and what it has generated so far."""

    job: Job
    phase: Literal["think", "answer"]
    budget: str
    start: gen.RowStart
    max_new: int
    stop_ids: frozenset[int]
    stop: tuple[str, ...]
    seed: int | None
    keep_state: bool = False
    tokens: list[int] = field(default_factory=list)
    reason: str = "length"
    state: gen.RowState | None = None
    snapshot: gen.RowState | None = None

    def __post_init__(self) -> None:
        p = self.job.sampling
        self.greedy = p.temperature == 0
        self.params = gen.SamplingParams(temperature=p.temperature, top_p=p.top_p)
        self.gen: torch.Generator | None = None  # made on the model's device when the row joins a group

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.gen is None and not self.greedy:
            seed = self.seed if self.seed is not None else random.getrandbits(62)
            self.gen = torch.Generator(device=device).manual_seed(seed)
        return self.gen

    @property
    def key(self) -> tuple[str, int, int]:
        """Rows with the same key can share a batch."""
        return self.budget, self.start.state.length if self.start.state else 0, len(self.start.tokens)


class Group:
    """Rows decoded together on one budget model (the batched loop of :mod:`model.generate`)."""

    def __init__(
        self, model: torch.nn.Module, rows: list[Row], snapshot_ids: frozenset[int], decode: Callable[..., str]
    ) -> None:
        self.model, self.rows, self.snapshot_ids, self.decode = model, rows, snapshot_ids, decode
        self.device = next(model.parameters()).device
        for r in rows:
            r.generator(self.device)
        ids = torch.tensor([r.start.tokens for r in rows], dtype=torch.long, device=self.device)
        states = [r.start.state for r in rows]
        cache = gen.stack_rows(states) if states[0] is not None else None
        self.length = (states[0].length if states[0] is not None else 0) + ids.shape[1]
        self.pads = [0] * len(rows)  # per row: KV slots before its history (self.length - tokens it consumed)
        self.steps = 0  # decode steps taken
        res = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        self.cache, self.logits = res.cache, res.logits[:, -1]

    def row_length(self, j: int) -> int:
        """Tokens row ``j`` has consumed."""
        return self.length - self.pads[j]

    def absorb(self, other: Group) -> None:
        """Take ``other``'s rows (same model; both about to sample): one batch, shorter histories left-padded."""
        length = max(self.length, other.length)
        self.cache = concat_caches([self.cache, other.cache])
        self.pads = [p + length - self.length for p in self.pads] + [p + length - other.length for p in other.pads]
        self.rows = self.rows + other.rows
        self.logits = torch.cat([self.logits, other.logits])
        self.length = length
        other.rows = []

    def step(self) -> tuple[list[Row], list[Row]]:
        """Sample one token for every row; returns (rows that got a token, rows that finished)."""
        rows, logits = self.rows, self.logits
        greedy = logits.argmax(-1).tolist() if any(r.greedy for r in rows) else None
        stepped, finished, keep = list(rows), [], []
        for j, row in enumerate(rows):
            tok = greedy[j] if row.greedy else int(gen.sample_next(logits[j : j + 1], row.params, row.gen))
            row.tokens.append(tok)
            if row.job.cancelled:
                row.reason = "cancelled"
            elif tok in row.stop_ids:
                row.reason = "stop_id"
            elif row.stop and gen._hit_stop_string(row.tokens, row.stop, self.decode):
                row.reason = "stop_string"
            elif len(row.tokens) < row.max_new:
                keep.append(j)
                continue
            if row.keep_state:  # the last token is not fed: the state holds everything before it
                row.state = gen.take_row(self.cache, j, self.row_length(j))
            finished.append(row)
        if len(keep) < len(rows):
            self.rows = [rows[j] for j in keep]
            if keep:
                pads = [self.pads[j] for j in keep]
                trim = min(pads)  # padding every remaining row has: drop it
                self.cache = self.cache.select(torch.tensor(keep, device=self.device), trim=trim)
                self.pads = [p - trim for p in pads]
                self.length -= trim
        if self.rows:
            nxt = [r.tokens[-1] for r in self.rows]
            res = self.model(torch.tensor(nxt, dtype=torch.long, device=self.device)[:, None], cache=self.cache)
            self.cache, self.logits = res.cache, res.logits[:, -1]
            self.length += 1
            self.steps += 1
            for j, (row, tok) in enumerate(zip(self.rows, nxt, strict=True)):
                if row.keep_state and tok in self.snapshot_ids:
                    row.snapshot = gen.take_row(self.cache, j, self.row_length(j), kv=False)
        return stepped, finished


# ---------------------------------------------------------------------- the engine
class EngineStopped(RuntimeError):
    """The decode thread is not running (stopped or crashed)."""


class Engine:
    """Owns the loaded model and the decode thread. ``submit`` a :class:`Job`, read its ``events``.

    Events: ``("reasoning", text)`` and ``("content", text)`` deltas (streaming jobs only), then
    ``("done", JobResult)`` or ``("error", message)``.
    """

    def __init__(self, loaded: LoadedModel, config: ServingConfig) -> None:
        self.loaded, self.config = loaded, config
        self.tokenizer, self.tokens = loaded.tokenizer, loaded.tokens
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self._inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: list[Row] = []
        self._groups: list[Group] = []
        self._inflight = 0  # jobs admitted and not finished
        self._concurrent_until = 0.0  # traffic counts as concurrent until then (perf_counter)
        self.error: str | None = None
        self.stats: dict[str, Any] = defaultdict(int)
        self._thread = threading.Thread(target=self._run, name="star-elastic-decode", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise EngineStopped(self.error or "the decode thread is not running")
        self._inbox.put(job)
        self._wake.set()

    def snapshot_stats(self) -> dict[str, Any]:
        return {**self.stats, "active_groups": len(self._groups), "pending_rows": len(self._pending)}

    # ------------------------------------------------------------------ decode thread
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._iterate()
        except BaseException as err:  # a bug here must surface in /ready and Serve's health check
            self.error = f"decode thread crashed: {type(err).__name__}: {err}"
            for job in {r.job for g in self._groups for r in g.rows} | {r.job for r in self._pending}:
                job.emit("error", self.error)
            raise

    def _drain(self) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            job.started = time.perf_counter()
            self._inflight += 1
            if self._inflight > 1:
                self._concurrent_until = job.started + 1.0
            self._pending.append(self._first_row(job))

    def _wait(self, seconds: float) -> None:
        self._wake.wait(max(seconds, 0.0))
        self._wake.clear()
        self._drain()

    def _iterate(self) -> None:
        self._drain()
        if not self._groups and not self._pending:
            self._wait(0.5)
            return
        if not self._groups and time.perf_counter() < self._concurrent_until:
            # idle under concurrent traffic: give the other requests a moment to join the first batch
            deadline = min(r.job.created for r in self._pending) + self.config.batch_wait_timeout_s
            while len(self._pending) < self.config.batch_max_size and time.perf_counter() < deadline:
                self._wait(deadline - time.perf_counter())
        self._form_groups()
        if self.config.merge_running_batches:
            self._merge_groups()
        for group in self._groups:
            self._step(group)
        self._groups = [g for g in self._groups if g.rows]

    def _merge_groups(self) -> None:
        """Merge groups of one budget into as few batches of at most ``batch_max_size`` rows as fit.

        Every group is about to sample here (prefilled, or stepped last iteration). Largest first, each
        group joins the first batch with room for it.
        """
        size = self.config.batch_max_size
        merged: list[Group] = []
        for group in sorted(self._groups, key=lambda g: -len(g.rows)):
            target = next((t for t in merged if t.model is group.model and len(t.rows) + len(group.rows) <= size), None)
            if target is None:
                merged.append(group)
                continue
            try:
                target.absorb(group)
            except Exception as err:  # a failed merge fails the joining requests, not the batch
                self._fail(group.rows, err)
                group.rows = []
                continue
            self.stats["merged_groups"] += 1
            if target.steps:  # joined a batch that was already decoding
                self.stats["joined_running_batches"] += 1
            self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(target.rows))
        self._groups = merged

    def _form_groups(self) -> None:
        by_key: dict[tuple[str, int, int], list[Row]] = defaultdict(list)
        for row in self._pending:
            if row.job.cancelled:
                self._finished("cancelled_rows")
            else:
                by_key[row.key].append(row)
        self._pending = []
        size = self.config.batch_max_size
        for key, rows in by_key.items():
            model = self.loaded.registry.get(key[0])
            for i in range(0, len(rows), size):
                chunk = rows[i : i + size]
                try:
                    group = Group(model, chunk, self.tokens.line_breaks, self.tokenizer.decode)
                except Exception as err:  # a failed prefill fails its requests, not the replica
                    self._fail(chunk, err)
                    continue
                self._groups.append(group)
                self.stats["batches"] += 1
                self.stats["batched_rows"] += len(chunk)
                self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(chunk))

    def _step(self, group: Group) -> None:
        try:
            stepped, finished = group.step()
        except Exception as err:
            self._fail(group.rows, err)
            group.rows = []
            return
        self.stats["decode_steps"] += 1
        self.stats["generated_tokens"] += len(stepped)
        now = time.perf_counter()
        for row in stepped:
            if row.job.first_token is None:
                row.job.first_token = now
            if row.job.stream and row.reason != "cancelled":
                self._stream(row, done=row in finished)
        for row in finished:
            if row.reason == "cancelled":
                self._finished("cancelled_rows")
                continue
            try:
                self._think_done(row) if row.phase == "think" else self._answer_done(row)
            except Exception as err:
                self._fail([row], err)

    def _finished(self, counter: str) -> None:
        self._inflight -= 1
        self.stats[counter] += 1

    def _fail(self, rows: Sequence[Row], err: Exception) -> None:
        for row in rows:  # a job has one live row at a time: one row per job
            self._finished("failed_rows")
            row.job.emit("error", f"generation failed: {type(err).__name__}: {err}")

    # ------------------------------------------------------------------ phases
    def _first_row(self, job: Job) -> Row:
        t, seed = self.tokens, job.sampling.seed
        first_seed = gen.row_seed(seed, 0) if seed is not None else None
        if job.think_budget is None:  # plain completion: one phase on the prompt
            return self._answer_row(job, gen.RowStart(list(job.prompt)), first_seed)
        cap = self.config.think_limit if job.think_cap is None else job.think_cap
        if cap == 0:  # answer directly: close the (empty) thinking and prefill
            return self._answer_row(job, gen.RowStart([*job.prompt, t.think_close]), self._answer_seed(job))
        stops = frozenset((t.think_close, *t.think_stop_ids))
        same = job.think_budget == job.answer_budget  # standard control keeps states to continue from
        start = gen.RowStart(list(job.prompt))
        return Row(job, "think", job.think_budget, start, cap, stops, (), first_seed, keep_state=same)

    def _answer_seed(self, job: Job) -> int | None:
        return gen.row_seed(job.sampling.seed, 1) if job.sampling.seed is not None else None

    def _answer_row(self, job: Job, start: gen.RowStart, seed: int | None) -> Row:
        job.answer_fed = len(start.tokens)
        stop_ids = frozenset(self.tokens.answer_stop_ids)
        return Row(job, "answer", job.answer_budget, start, job.max_tokens, stop_ids, job.stop, seed)

    def _think_done(self, row: Row) -> None:
        job = row.job
        out = gen.RowOutput(row.tokens, row.reason, row.state, row.snapshot)  # type: ignore[arg-type]
        job.think_kept, job.think_stop = kept_thinking(out, row.max_new, self.tokens, job.think_cap is not None)
        job.think = out
        if job.stream and job.sent_think < len(job.think_kept):
            job.emit("reasoning", self.tokenizer.decode(job.think_kept[job.sent_think :]))
            job.sent_think = len(job.think_kept)
        seq = [*job.prompt, *job.think_kept, self.tokens.think_close]
        state = resume_state(out, len(job.prompt) + len(job.think_kept)) if row.keep_state else None
        if state is not None:
            job.answer_start = "continued"
            start = gen.RowStart(seq[state.length :], state)
        else:
            job.answer_start = "re_prefill"
            start = gen.RowStart(seq)
        self._pending.append(self._answer_row(job, start, self._answer_seed(job)))

    def _answer_text(self, row: Row) -> str:
        ids = row.tokens[:-1] if row.reason == "stop_id" else row.tokens
        text = self.tokenizer.decode(ids)
        return gen.truncate_at_stop(text, row.stop) if row.reason == "stop_string" else text

    def _stream(self, row: Row, done: bool) -> None:
        job = row.job
        if row.phase == "think":  # send complete lines only: a cap cuts after the last line break
            if not done and row.tokens[-1] in self.tokens.line_breaks:
                job.emit("reasoning", self.tokenizer.decode(row.tokens[job.sent_think :]))
                job.sent_think = len(row.tokens)
            return
        text = self._answer_text(row) if done else self.tokenizer.decode(row.tokens)
        safe = len(text) if done else len(text) - (max(map(len, row.stop)) - 1 if row.stop else 0)
        if not done and text.endswith("\ufffd"):  # an incomplete multi-byte character
            safe = min(safe, len(text) - 1)
        if safe > job.sent_chars:
            job.emit("content", text[job.sent_chars : safe])
            job.sent_chars = safe

    def _answer_done(self, row: Row) -> None:
        job = row.job
        now = time.perf_counter()
        think_generated = len(job.think.tokens) if job.think is not None else 0
        result = JobResult(
            reasoning=self.tokenizer.decode(job.think_kept) if job.think_budget is not None else None,
            content=self._answer_text(row),
            finish_reason="length" if row.reason == "length" else "stop",
            prompt_tokens=len(job.prompt),
            reasoning_tokens=think_generated,
            answer_tokens=len(row.tokens),
            think_stop=job.think_stop,
            answer_start=job.answer_start,
            answer_fed=job.answer_fed,
            first_token_s=(job.first_token or now) - job.created,
            total_s=now - job.created,
        )
        self._finished("completed")
        job.emit("done", result)
