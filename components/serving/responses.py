"""From the engine's events to OpenAI response bodies and server-sent events.

A request's jobs share one event queue of ``(choice index, kind, payload)`` events; the
non-streaming path waits for every ``done``, the streaming path turns each event into one chunk for
its choice. Whatever ends a request early cancels all of its jobs. A chat answer with tools is read
back into ``tool_calls`` by the tool format (:mod:`components.serving.tools`), streamed call by call.

Design notes (event kinds, usage, echo): docs/serving.md ("Responses and streaming").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from components.serving import protocol as P
from components.serving.job import Job, JobResult
from components.serving.logprobs import LogprobEntry, TokenText, chat_logprobs, completion_logprobs
from components.serving.request_models import ChatCompletionRequest
from components.serving.state import Prompt
from components.serving.tools import ParsedCall, ToolFormat, ToolStream

Finish = Callable[[int, list[JobResult]], None]
"""Called once per request with its HTTP status and finished results (for metrics)."""


def cancel(jobs: Sequence[Job]) -> None:
    for job in jobs:
        job.cancelled = True


async def collect(jobs: Sequence[Job]) -> list[JobResult]:
    """Every job's result, in choice order; a failed job is a 500 (and cancels the others)."""
    results: dict[int, JobResult] = {}
    try:
        while len(results) < len(jobs):
            index, kind, payload = await jobs[0].events.get()
            if kind == "done":
                results[index] = payload
            elif kind == "error":
                raise P.OpenAIError(500, payload, type="server_error", code="generation_failed")
    finally:
        if len(results) < len(jobs):  # an error, or the client went away: stop decoding for it
            cancel(jobs)
    return [results[i] for i in range(len(jobs))]


def usage(prompts: Sequence[Prompt], results: Sequence[JobResult]) -> P.Usage:
    return P.usage(
        sum(len(p.ids) for p in prompts),
        sum(r.reasoning_tokens for r in results),
        sum(r.answer_tokens for r in results),
    )


def budget_control(job: Job, r: JobResult) -> P.BudgetControl:
    return P.BudgetControl(
        think_model=job.think_budget, answer_model=job.answer_budget, think_stop=r.think_stop,
        answer_start=r.answer_start, answer_fed_tokens=r.answer_fed,
    )  # fmt: skip


def tool_calls(calls: Sequence[ParsedCall]) -> list[P.ToolCall]:
    return [P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


class Renderer:
    """Response bodies of one request: ``token_text`` shows a token id in logprobs fields; ``fmt`` reads tool
    calls back from a chat answer when the request has tools (and a tool choice other than ``none``)."""

    def __init__(
        self,
        req: Any,
        jobs: Sequence[Job],
        prompts: Sequence[Prompt],
        token_text: TokenText,
        fmt: ToolFormat | None = None,
    ) -> None:
        self.req, self.jobs, self.prompts, self.token_text = req, jobs, prompts, token_text
        self.chat = isinstance(req, ChatCompletionRequest)
        self.echo = bool(getattr(req, "echo", False))
        self.id = P.new_id("chatcmpl" if self.chat else "cmpl")
        self.created = P.now()
        self.constraint = jobs[0].constraint if jobs else None
        reads = self.chat and fmt is not None and self.constraint is not None and self.constraint.reads_tools
        self.fmt = fmt if reads else None
        self.show_reasoning = bool(getattr(req, "include_reasoning", True))

    def read_tools(self, r: JobResult) -> tuple[str | None, list[ParsedCall], str]:
        """``(content, tool calls, finish_reason)`` of one chat answer: tool calls end a choice with
        ``tool_calls``, except a named tool choice (``stop``, as the OpenAI API) or a cut answer (``length``)."""
        if self.fmt is None:
            return r.content, [], r.finish_reason
        content, calls = self.fmt.parse(r.content, self.constraint.parallel)
        return content, calls, self.finish(r, bool(calls))

    def finish(self, r: JobResult, called: bool) -> str:
        named = self.constraint is not None and self.constraint.choice == "named"
        return "tool_calls" if called and not named and r.finish_reason != "length" else r.finish_reason

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.req.n]

    def chat_lp(self, entries: list[LogprobEntry] | None) -> P.ChoiceLogprobs | None:
        return None if entries is None else chat_logprobs(entries, self.token_text)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ whole responses
    def body(self, results: list[JobResult]) -> P.ChatCompletion | P.Completion:
        control = budget_control(self.jobs[0], results[0])
        use = usage(self.prompts, results)
        if self.chat:
            choices = []
            for i, r in enumerate(results):
                content, calls, finish = self.read_tools(r)
                message = P.AssistantMessage(
                    content=content, reasoning_content=r.reasoning if self.show_reasoning else None,
                    tool_calls=tool_calls(calls) or None,
                )  # fmt: skip
                choices.append(
                    P.ChatChoice(index=i, message=message, finish_reason=finish, logprobs=self.chat_lp(r.logprobs))
                )
            return P.ChatCompletion(
                id=self.id, created=self.created, model=self.req.model, choices=choices, usage=use,
                budget_control=control,
            )  # fmt: skip
        out = []
        for i, r in enumerate(results):
            text, entries = r.content, r.logprobs
            if self.echo:
                text = self.prompt_of(i).echo_text + text
                if entries is not None:
                    entries = [*(r.prompt_logprobs or []), *entries]
            logprobs = None if entries is None else completion_logprobs(entries, self.token_text)
            out.append(
                P.CompletionChoice(
                    index=i, text=text, reasoning_content=r.reasoning, finish_reason=r.finish_reason, logprobs=logprobs
                )
            )
        return P.Completion(
            id=self.id, created=self.created, model=self.req.model, choices=out, usage=use, budget_control=control
        )

    # ------------------------------------------------------------------ streams
    def _chunk(
        self,
        index: int,
        reasoning: str | None = None,
        content: str | None = None,
        finish_reason: str | None = None,
        entries: list[LogprobEntry] | None = None,
        first: bool = False,
        calls: list[P.ToolCallDelta] | None = None,
    ) -> bytes:
        if self.chat:
            delta = P.ChatDelta(
                role="assistant" if first else None, content=content, reasoning_content=reasoning, tool_calls=calls
            )
            choice = P.ChatChunkChoice(
                index=index, delta=delta, finish_reason=finish_reason, logprobs=self.chat_lp(entries)
            )
            return P.sse(
                P.ChatCompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[choice])
            )
        logprobs = None
        if entries is not None:
            logprobs = completion_logprobs(entries, self.token_text, self._offsets[index])
            self._offsets[index] += sum(len(t) for t in logprobs.tokens)
        c = P.CompletionChoice(
            index=index, text=content or "", reasoning_content=reasoning, finish_reason=finish_reason, logprobs=logprobs
        )
        return P.sse(P.Completion(id=self.id, created=self.created, model=self.req.model, choices=[c]))

    def _tool_chunk(self, index: int, content: str, calls: list[ParsedCall], entries: Any = None) -> bytes | None:
        """One chunk of a choice whose answer is read for tool calls: the content delta and completed calls."""
        sent = self._calls_sent[index]
        self._calls_sent[index] += len(calls)
        deltas = [
            P.ToolCallDelta(index=sent + k, id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments))
            for k, c in enumerate(calls)
        ]
        if not content and not deltas and not entries:
            return None
        return self._chunk(index, content=content or None, entries=entries, calls=deltas or None)

    async def stream(self, finish: Finish) -> AsyncIterator[bytes]:
        """Server-sent events of every choice, then usage (if asked) and ``[DONE]``."""
        n = len(self.jobs)
        self._offsets = [0] * n
        self._calls_sent = [0] * n
        texts = [""] * n  # the answer so far, per choice (read for tool calls)
        readers = [ToolStream(self.fmt, self.constraint.parallel) for _ in range(n)] if self.fmt else []
        results: dict[int, JobResult] = {}
        wants_prompt_lp = self.echo and self.req.logprobs_k is not None
        try:
            for i in range(n):
                if self.chat:
                    yield self._chunk(i, content="", first=True)
                elif self.echo and not wants_prompt_lp:
                    yield self._chunk(i, content=self.prompt_of(i).echo_text)
            while len(results) < n:
                index, kind, payload = await self.jobs[0].events.get()
                if kind == "prompt":
                    yield self._chunk(index, content=self.prompt_of(index).echo_text, entries=payload)
                elif kind == "reasoning":
                    if self.show_reasoning:
                        yield self._chunk(index, reasoning=payload)
                elif kind == "content" and readers:
                    text, entries = payload
                    texts[index] += text
                    chunk = self._tool_chunk(index, *readers[index].feed(texts[index]), entries)
                    if chunk is not None:
                        yield chunk
                elif kind == "content":
                    text, entries = payload
                    yield self._chunk(index, content=text, entries=entries)
                elif kind == "error":
                    finish(500, list(results.values()))
                    yield P.sse(P.OpenAIError(500, payload, type="server_error", code="generation_failed").body())
                    return
                else:
                    results[index] = payload
                    reason = payload.finish_reason
                    if readers:
                        chunk = self._tool_chunk(index, *readers[index].finish(payload.content))
                        if chunk is not None:
                            yield chunk
                        reason = self.finish(payload, self._calls_sent[index] > 0)
                    yield self._chunk(index, finish_reason=reason)
            done = [results[i] for i in range(n)]
            finish(200, done)
            if self.req.include_usage:
                obj = "chat.completion.chunk" if self.chat else "text_completion"
                u = usage(self.prompts, done)
                yield P.sse(
                    {"id": self.id, "object": obj, "created": self.created, "model": self.req.model,
                     "choices": [], "usage": u.model_dump()}
                )  # fmt: skip
            yield P.sse("[DONE]")
        finally:
            if len(results) < n:  # an error, or the client disconnected mid-stream
                cancel(self.jobs)
