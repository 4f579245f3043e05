"""The serving engine: one weight copy, every budget a model, a batched two-phase decode loop.

One decode thread owns the models and every cache; requests arrive through a thread-safe inbox and
leave as ``(index, kind, payload)`` events posted back to the event loop, so the loop never waits on
a matmul. Batching is continuous (:mod:`components.serving.batch`). The two phases follow
:func:`model.phases.think_then_answer` (same cap cut and resume state), token by token so that they
can stream; every phase samples with its job's seeds (:mod:`model.request_plan`'s rule).

Design notes (batching wait, streaming, texts, log-probabilities): docs/serving.md ("The engine").
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from components.serving.batch import Group, Row
from components.serving.config import ServingConfig
from components.serving.job import Job, JobResult
from components.serving.loading import LoadedModel
from components.serving.prompts import PromptRules
from model import generate as gen  # the primitives of model.generate's batched loop
from model.phases import kept_thinking, resume_state, resume_target  # think_then_answer's rules, shared on purpose


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
        self.text = PromptRules(loaded.tokenizer).visible_text  # what a client is shown of generated ids
        self.threads = loaded.threads  # the count its decode plans were compiled with (LoadedModel.threads)
        self._inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: list[Row] = []
        self._groups: list[Group] = []
        self._inflight = 0  # jobs admitted and not finished
        self._concurrent_until = 0.0  # traffic counts as concurrent until then (perf_counter)
        self.error: str | None = None
        self.stats: dict[str, Any] = defaultdict(int)
        self._beat = time.monotonic()  # when the decode loop last began an iteration (idle: every 0.5 s)
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

    def health_error(self, stall_timeout_s: float) -> str | None:
        """Why this engine cannot serve (None: it can): the decode thread is gone, or it has not begun a loop
        iteration for ``stall_timeout_s`` seconds (wedged inside a step), which no request can get out of."""
        if not self.alive:
            return self.error or "the decode thread is not running"
        stalled = time.monotonic() - self._beat
        if stalled > stall_timeout_s:
            return f"the decode thread has made no progress for {stalled:.0f} s (stall_timeout_s {stall_timeout_s:g})"
        return None

    def snapshot_stats(self) -> dict[str, Any]:
        return {**self.stats, "active_groups": len(self._groups), "pending_rows": len(self._pending)}

    # ------------------------------------------------------------------ decode thread
    def _run(self) -> None:
        # A new thread does not always start with the count set in another; a compiled step called with another
        # count than its plan's compiles again.
        torch.set_num_threads(self.threads)
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
        self._beat = time.monotonic()
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

        Every group is about to sample here (prefilled, or stepped last iteration). Groups whose buffers hold
        free rows first (a running batch: rows join it by slot, its own rows are not copied), then the largest,
        each group joins the first batch with room for it; a batch made anew gets buffers of ``batch_max_size``
        rows.
        """
        size = self.config.batch_max_size
        merged: list[Group] = []
        for group in sorted(self._groups, key=lambda g: (-g.capacity(), -len(g.rows))):
            target = next((t for t in merged if t.model is group.model and len(t.rows) + len(group.rows) <= size), None)
            if target is None:
                merged.append(group)
                continue
            try:
                target.absorb(group, rows=size)
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
                    group = Group(model, chunk, self.tokens.line_breaks, self.text, self.stats)
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
            if row.reason == "grammar_error":
                self._fail([row], RuntimeError(f"the grammar allows no token: {row.matcher.get_error() or 'stopped'}"))
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
        t, seeds = self.tokens, job.phase_seeds
        if job.think_budget is None:  # plain completion: one phase on the prompt
            return self._answer_row(job, gen.RowStart(list(job.prompt)), seeds.plain)
        cap = self.config.think_limit if job.think_cap is None else job.think_cap
        if cap == 0:  # answer directly: close the (empty) thinking and prefill
            return self._answer_row(job, gen.RowStart([*job.prompt, *t.think_close]), seeds.answer)
        stops = frozenset(t.think_stop_ids)
        same = job.think_budget == job.answer_budget  # standard control keeps states to continue from
        start = gen.RowStart(list(job.prompt))
        max_new = cap + len(t.think_close) - 1  # as think_then_answer: the marker's first L-1 ids do not count
        return Row(job, "think", job.think_budget, start, max_new, stops, (), seeds.think, keep_state=same,
                   stop_seqs=(t.think_close,))  # fmt: skip

    def _answer_row(self, job: Job, start: gen.RowStart, seed: int | None) -> Row:
        job.answer_fed = len(start.tokens)
        stop_ids = frozenset(self.tokens.answer_stop_ids)
        return Row(job, "answer", job.answer_budget, start, job.max_tokens, stop_ids, job.stop, seed)

    def _think_done(self, row: Row) -> None:
        job = row.job
        out = gen.RowOutput(row.tokens, row.reason, row.state, row.snapshot)  # type: ignore[arg-type]
        cap = row.max_new - len(self.tokens.think_close) + 1
        job.think_kept, job.think_stop = kept_thinking(out, cap, self.tokens, job.think_cap is not None)
        job.think = out
        if job.stream and job.sent_think < len(job.think_kept):
            job.emit("reasoning", self.text(job.think_kept[job.sent_think :]))
            job.sent_think = len(job.think_kept)
        seq = [*job.prompt, *job.think_kept, *self.tokens.think_close]
        target = resume_target(len(job.prompt), out.tokens, seq[len(job.prompt) :])
        state = resume_state(out, target) if row.keep_state else None
        if state is not None:
            job.answer_start = "continued"
            start = gen.RowStart(seq[state.length :], state)
        else:
            job.answer_start = "re_prefill"
            start = gen.RowStart(seq)
        self._pending.append(self._answer_row(job, start, job.phase_seeds.answer))

    def _answer_text(self, row: Row) -> str:
        ids = row.tokens[:-1] if row.reason == "stop_id" else row.tokens
        text = self.text(ids)
        return gen.truncate_at_stop(text, row.stop) if row.reason == "stop_string" else text

    def _stream(self, row: Row, done: bool) -> None:
        job = row.job
        if row.phase == "think":  # send complete lines only: a cap cuts after the last line break
            if not done and row.tokens[-1] in self.tokens.line_breaks:
                job.emit("reasoning", self.text(row.tokens[job.sent_think :]))
                job.sent_think = len(row.tokens)
            return
        text = self._answer_text(row) if done else self.text(row.tokens)
        safe = len(text) if done else len(text) - (max(map(len, row.stop)) - 1 if row.stop else 0)
        if not done and text.endswith("\ufffd"):  # an incomplete multi-byte character
            safe = min(safe, len(text) - 1)
        entries = None
        if row.want_lp is not None:  # the entries of the tokens whose text is all sent (every one at the end)
            n = len(row.lp) if done else job.sent_logprobs
            while not done and n < len(row.lp) and len(self.text(row.tokens[: n + 1])) <= max(safe, job.sent_chars):
                n += 1
            entries = row.lp[job.sent_logprobs : n]
            job.sent_logprobs = n
        if safe > job.sent_chars or entries:
            job.emit("content", (text[job.sent_chars : max(safe, job.sent_chars)], entries))
            job.sent_chars = max(safe, job.sent_chars)

    def _answer_done(self, row: Row) -> None:
        job = row.job
        now = time.perf_counter()
        think_generated = len(job.think.tokens) if job.think is not None else 0
        result = JobResult(
            reasoning=self.text(job.think_kept) if job.think_budget is not None else None,
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
            logprobs=row.lp if row.want_lp is not None else None,
            prompt_logprobs=job.prompt_lp,
            reasoning_ids=list(job.think_kept),
            answer_ids=list(row.tokens),
        )
        self._finished("completed")
        job.emit("done", result)
