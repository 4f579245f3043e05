"""The HTTP API over one :class:`~components.serving.state.ServingState`, with or without Ray.

``ServingApp(state)``: one method per route, ``.fastapi`` the ASGI app (under uvicorn, an in-process
transport in a test or benchmark, or a model replica of :mod:`components.serving.deployments`), ``.close()``
stops the decode thread. The app is built after the model is loaded, so the same app serves with and
without Ray; every request error is an OpenAI-style JSON error, never an exception out of a handler.

Routes, examples and design notes: docs/serving.md ("The application").
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from components.serving import protocol as P
from components.serving.job import Job, JobResult
from components.serving.request_models import ChatCompletionRequest, CompletionRequest, parse_request
from components.serving.responses import Finish, Renderer, collect
from components.serving.responses_api import ResponsesRequest, parse_responses_request
from components.serving.responses_render import ResponsesRenderer
from components.serving.state import Prompt, ServingState

__all__ = ["ServingApp"]

log = logging.getLogger("star_elastic.serving")
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def error_response(err: P.OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# ---------------------------------------------------------------------- the HTTP API
class ServingApp:
    """The HTTP API over one :class:`ServingState`: one method per route, ``fastapi`` the ASGI app.

    ``close()`` stops the decode thread. The app's lifespan calls it when the ASGI server shuts down
    (uvicorn, or Ray Serve stopping the replica); a caller that drives the app without a lifespan
    (an in-process transport) calls it itself.
    """

    def __init__(self, state: ServingState) -> None:
        self.state = state
        self.fastapi = FastAPI(
            title="star-elastic", description="Every budget of a nested elastic checkpoint.", lifespan=self._lifespan
        )
        self.fastapi.add_exception_handler(StarletteHTTPException, self.http_error)
        routes = [
            ("GET", "/health", self.health),
            ("GET", "/ready", self.ready),
            ("GET", "/v1/models", self.list_models),
            ("GET", "/v1/models/{model_id}", self.get_model),
            ("POST", "/v1/chat/completions", self.chat_completions),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/responses", self.responses),
            ("GET", "/stats", self.stats),
            ("GET", "/metrics", self.metrics),
        ]
        for method, path, endpoint in routes:
            self.fastapi.add_api_route(path, endpoint, methods=[method])

    def close(self) -> None:
        """Stop the decode thread (idempotent); requests after it are answered 503."""
        self.state.close()

    @asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            self.close()

    # ------------------------------------------------------------------ routes
    async def health(self) -> JSONResponse:
        """Liveness: 200 while the decode thread runs, else 503 with its error."""
        state, ok = self.state, self.state.engine.alive
        body = {"status": "ok" if ok else "unhealthy", "pid": state.pid, "started_at": state.started_at}
        if not ok:
            body["error"] = state.engine.error or "the decode thread is not running"
        return JSONResponse(body, status_code=200 if ok else 503)

    async def ready(self) -> JSONResponse:
        ok = self.state.engine.alive
        return JSONResponse({"ready": ok, "models": list(self.state.cards)}, status_code=200 if ok else 503)

    async def list_models(self, request: Request) -> Response:
        try:
            self.state.authorize(request)
        except P.OpenAIError as err:
            return error_response(err)
        return _json(P.ModelList(data=self._cards()))

    async def get_model(self, model_id: str, request: Request) -> Response:
        try:
            self.state.authorize(request)
            self.state.check_budget(model_id, "model")
        except P.OpenAIError as err:
            return error_response(err)
        return _json(next(c for c in self._cards() if c.id == model_id))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat", ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", CompletionRequest)

    async def responses(self, request: Request) -> Response:
        """The Responses API, stateless (``components.serving.responses_api``)."""
        return await self._generate(request, "responses", ResponsesRequest)

    async def stats(self, request: Request) -> Response:
        """Per-budget metrics, engine counters, admission and memory of this replica, as JSON."""
        state = self.state
        try:
            state.authorize(request)
        except P.OpenAIError as err:
            return error_response(err)
        admission = state.admission
        body = {
            "pid": state.pid,
            "started_at": state.started_at,
            "format": state.loaded.format,
            "models": list(state.cards),
            "engine": state.engine.snapshot_stats(),
            "metrics": state.metrics.snapshot(),
            "admission": {"running": admission.running, "waiting": admission.waiting, "rejected": admission.rejected},
            "metrics_exported_to_ray": state.metrics.exported,
            "grammar": state.grammar_stats(),
            **state.memory(),
        }
        return JSONResponse(body)

    async def metrics(self) -> Response:
        return Response(self.state.metrics.prometheus(self.state.gauges()), media_type=PROMETHEUS_TEXT)

    async def http_error(self, _: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (unknown path, wrong method) in the OpenAI shape."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(P.OpenAIError(exc.status_code, str(exc.detail), code=code))

    # ------------------------------------------------------------------ generation
    def _prepare(self, cls: type, body: bytes) -> tuple[Any, list[Job], list[Prompt], Any]:
        """``(request, jobs, prompts, renderer)`` of a request body; a Responses request runs as the
        equivalent chat request, its errors renamed to its own fields."""
        state = self.state
        if cls is ResponsesRequest:
            req = parse_responses_request(body)
            state.check_budget(req.model, "model")
            chat, origin = req.to_chat()
            try:
                jobs, prompts = state.make_jobs(chat)
            except P.OpenAIError as err:
                raise ResponsesRequest.rename(err, origin) from None
            return req, jobs, prompts, ResponsesRenderer(req, jobs, prompts, state.tool_format)
        req = parse_request(cls, body)
        jobs, prompts = state.make_jobs(req)
        return req, jobs, prompts, Renderer(req, jobs, prompts, self._token_text, state.tool_format)

    async def _generate(self, request: Request, route: str, cls: type) -> Response:
        """Parse, admit, submit, then answer at once or stream; every failure is an OpenAI-shaped error."""
        state, budget = self.state, "none"
        try:
            state.authorize(request)
            body = await state.read_body(request)
            model = _model_of(body)
            budget = model if model in state.cards else ("unknown" if model else "none")
            req, jobs, prompts, render = self._prepare(cls, body)
            await state.admission.acquire()
        except Exception as err:
            return self._failed(route, budget, err)
        finish = partial(self._record, route, budget, prompt=sum(len(p.ids) for p in prompts))
        release = True  # the request holds its admission slot until its last token is sent
        try:
            state.submit(jobs)
            if req.stream:
                release = False  # the stream releases the slot after its last event
                return StreamingResponse(self._events(render, finish), media_type="text/event-stream")
            results = await collect(jobs)
            answer = render.body(results)
            body = answer.model_dump_json() if isinstance(answer, BaseModel) else json.dumps(answer)
        except Exception as err:
            return self._failed(route, budget, err)
        finally:
            if release:
                state.admission.release()
        finish(200, results)
        return Response(body, media_type="application/json")

    async def _events(self, render: Renderer, finish: Finish) -> AsyncIterator[bytes]:
        try:
            async for event in render.stream(finish):
                yield event
        finally:
            self.state.admission.release()

    def _failed(self, route: str, budget: str, err: Exception) -> JSONResponse:
        """The error answer for ``err``: the client's mistakes as they are, anything else a 500."""
        if not isinstance(err, P.OpenAIError):  # a bug, not the client's fault: answer 500 and keep serving
            log.error("request failed", exc_info=err)
            err = P.OpenAIError(500, f"internal error: {type(err).__name__}", type="server_error")
        self._record(route, budget, err.status)
        return error_response(err)

    def _record(
        self, route: str, budget: str, status: int, results: list[JobResult] | None = None, prompt: int = 0
    ) -> None:
        """Metrics of one finished request (latency, time to first token and tokens only when it produced any)."""
        latency = ttft = tokens = None
        if results:
            latency = max(r.total_s for r in results)
            ttft = min(r.first_token_s for r in results)
            reasoning = sum(r.reasoning_tokens for r in results)
            completion = sum(r.reasoning_tokens + r.answer_tokens for r in results)
            tokens = {"prompt": prompt, "reasoning": reasoning, "completion": completion}
        self.state.metrics.record(budget, route, status, latency, ttft, tokens)

    def _token_text(self, token_id: int) -> str:
        """A token as log-probability fields show it."""
        return self.state.loaded.tokenizer.decode([token_id])

    def _cards(self) -> list[P.ModelCard]:
        created, fmt = int(self.state.started_at), self.state.loaded.format
        return [
            P.ModelCard(
                id=c.name,
                created=created,
                total_params=c.total_params,
                active_params=c.active_params,
                active_fraction=c.active_fraction,
                architecture=c.architecture,
                format=fmt,
            )
            for c in self.state.cards.values()
        ]


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _model_of(body: bytes) -> str | None:
    """The ``model`` field of a JSON body, for the metrics' budget label (None when there is none)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None
