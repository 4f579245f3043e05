"""Responses API answers: the ``response`` object and its streaming events, from one job's engine events.

The output holds, in order: a ``reasoning`` item with the thinking (``content`` of ``reasoning_text``, as
vLLM returns it; left out with ``include_reasoning: false`` or when nothing was thought), a ``message``
item with the answer text (left out when the answer is only tool calls), and one ``function_call`` item
per tool call read back from the answer. A cut answer makes the response ``incomplete`` with
``incomplete_details.reason = "max_output_tokens"``.

Streaming sends the events the official client reads (``event:`` line and JSON ``data``, each with its
``type`` and a ``sequence_number``): ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` / ``.done`` with its parts (``response.content_part.added`` / ``.done``),
``response.reasoning_text.delta`` / ``.done``, ``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, then ``response.completed`` (or
``response.incomplete``) carrying the same response object as the non-streaming answer.

Design notes: docs/serving.md ("The Responses API").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from components.serving import protocol as P
from components.serving.job import Job, JobResult
from components.serving.responses import Finish, budget_control, cancel
from components.serving.responses_api import ResponsesRequest, dump_tools
from components.serving.state import Prompt
from components.serving.tools import ParsedCall, ToolFormat, ToolStream


def new_id(prefix: str) -> str:
    """An id in the Responses API's style (``resp_...``, ``msg_...``, ``rs_...``)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event named by its ``type``."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: ParsedCall, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": arguments, "status": status}  # fmt: skip


class ResponsesRenderer:
    """The answer of one ``/v1/responses`` request (one job), whole or as a stream of events."""

    def __init__(self, req: ResponsesRequest, jobs: Sequence[Job], prompts: Sequence[Prompt], fmt: ToolFormat) -> None:
        self.req, self.jobs, self.prompts = req, jobs, prompts
        constraint = jobs[0].constraint
        self.fmt = fmt if constraint is not None and constraint.reads_tools else None
        self.parallel = constraint.parallel if constraint is not None else True
        self.id = new_id("resp")
        self.created = P.now()
        self.seq = 0

    # ------------------------------------------------------------------ the response object
    def response(self, status: str, output: list[dict[str, Any]], r: JobResult | None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
        choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                                                        "summary": None},
            "store": False, "temperature": req.temperature, "top_p": req.top_p, "text": {"format": text_format},
            "tool_choice": choice or ("auto" if req.tools else "none"), "tools": dump_tools(req),
            "truncation": "disabled", "user": req.user, "metadata": req.metadata or {}, "usage": None,
        }  # fmt: skip
        if r is not None:
            prompt = sum(len(p.ids) for p in self.prompts)
            output_tokens = r.reasoning_tokens + r.answer_tokens
            out["usage"] = {
                "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": r.reasoning_tokens},
                "total_tokens": prompt + output_tokens,
            }  # fmt: skip
            out["budget_control"] = budget_control(self.jobs[0], r).model_dump()
        return out

    def read(self, r: JobResult) -> tuple[str | None, list[ParsedCall]]:
        return self.fmt.parse(r.content, self.parallel) if self.fmt is not None else (r.content, [])

    def body(self, results: list[JobResult]) -> dict[str, Any]:
        (r,) = results
        status = "incomplete" if r.finish_reason == "length" else "completed"
        output: list[dict[str, Any]] = []
        if r.reasoning and self.req.include_reasoning:
            output.append(reasoning_item(new_id("rs"), r.reasoning))
        content, calls = self.read(r)
        if content is not None or not calls:
            output.append(message_item(new_id("msg"), content or "", status))
        output += [call_item(c, c.arguments, "completed") for c in calls]
        return self.response(status, output, r)

    # ------------------------------------------------------------------ streaming
    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event(payload)

    async def stream(self, finish: Finish) -> AsyncIterator[bytes]:
        job = self.jobs[0]
        output: list[dict[str, Any]] = []
        open_item: dict[str, Any] | None = None  # the reasoning or message item being streamed
        texts = {"reasoning": "", "answer": "", "message": ""}
        reader = ToolStream(self.fmt, self.parallel) if self.fmt is not None else None
        done = False
        try:
            yield self._event("response.created", response=self.response("in_progress", [], None))
            yield self._event("response.in_progress", response=self.response("in_progress", [], None))
            while True:
                _, kind, payload = await job.events.get()
                if kind == "error":
                    finish(500, [])
                    yield P.sse(P.OpenAIError(500, payload, type="server_error", code="generation_failed").body())
                    return
                if kind == "reasoning" and self.req.include_reasoning and payload:
                    if open_item is None:
                        open_item = reasoning_item(new_id("rs"), "")
                        for chunk in self._open(open_item, len(output), "reasoning_text"):
                            yield chunk
                    texts["reasoning"] += payload
                    yield self._event("response.reasoning_text.delta", item_id=open_item["id"],
                                      output_index=len(output), content_index=0, delta=payload)  # fmt: skip
                    continue
                if kind == "content":
                    texts["answer"] += payload[0]
                    content, calls = reader.feed(texts["answer"]) if reader else (payload[0], [])
                elif kind == "done":
                    content, calls = reader.finish(payload.content) if reader else ("", [])
                else:
                    continue
                if open_item is not None and (
                    open_item["type"] == "reasoning" and (content or calls or kind == "done")
                ):
                    for chunk in self._close(open_item, output, texts["reasoning"], "completed"):
                        yield chunk
                    open_item = None
                if content:
                    if open_item is None:
                        open_item = message_item(new_id("msg"), "", "in_progress")
                        for chunk in self._open(open_item, len(output), "output_text"):
                            yield chunk
                    texts["message"] += content
                    yield self._event("response.output_text.delta", item_id=open_item["id"], output_index=len(output),
                                      content_index=0, delta=content, logprobs=[])  # fmt: skip
                status = "incomplete" if kind == "done" and payload.finish_reason == "length" else "completed"
                if open_item is not None and (calls or kind == "done"):
                    for chunk in self._close(open_item, output, texts["message"], status):
                        yield chunk
                    open_item = None
                for call in calls:
                    for chunk in self._call(call, output):
                        yield chunk
                if kind == "done":
                    if not any(i["type"] in ("message", "function_call") for i in output):
                        empty = message_item(new_id("msg"), "", status)
                        for chunk in (
                            *self._open(empty, len(output), "output_text"),
                            *self._close(empty, output, "", status),
                        ):
                            yield chunk
                    done = True
                    finish(200, [payload])
                    final = "response.incomplete" if status == "incomplete" else "response.completed"
                    yield self._event(final, response=self.response(status, output, payload))
                    return
        finally:
            if not done:  # an error, or the client went away
                cancel(self.jobs)

    def _open(self, item: dict[str, Any], index: int, part: str) -> list[bytes]:
        empty = (
            {**item, "content": [], "status": "in_progress"} if item["type"] == "message" else {**item, "content": []}
        )
        part_body = {"type": part, "text": ""} | ({"annotations": [], "logprobs": []} if part == "output_text" else {})
        return [
            self._event("response.output_item.added", output_index=index, item=empty),
            self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part=part_body),
        ]  # fmt: skip

    def _close(self, item: dict[str, Any], output: list[dict[str, Any]], text: str, status: str) -> list[bytes]:
        index = len(output)
        if item["type"] == "reasoning":
            final = reasoning_item(item["id"], text)
            part, done_kind = final["content"][0], "response.reasoning_text.done"
        else:
            final = message_item(item["id"], text, status)
            part, done_kind = final["content"][0], "response.output_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        output.append(final)
        return [
            self._event(done_kind, item_id=item["id"], output_index=index, content_index=0, text=text, **extra),
            self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=index, item=final),
        ]  # fmt: skip

    def _call(self, call: ParsedCall, output: list[dict[str, Any]]) -> list[bytes]:
        index, item = len(output), call_item(call, call.arguments, "completed")
        output.append(item)
        return [
            self._event("response.output_item.added", output_index=index, item=call_item(call, "", "in_progress")),
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=call.arguments),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=call.arguments, name=call.name),
            self._event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip
