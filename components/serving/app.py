"""The Ray Serve application: an OpenAI-compatible API over every budget of one nested checkpoint.

Entry points:

* ``build_app(args) -> Application`` for ``serve run components.serving.app:build_app model_uri=...``,
  ``serve deploy`` and a KubeRay RayService (``import_path: components.serving.app:build_app``,
  ``args: {model_uri: ...}``). ``args`` holds ``model_uri`` (a checkpoint folder, ``s3://...`` or
  ``models:/NAME@alias``), optionally ``config`` (a dict or a YAML/JSON path of
  :class:`~components.serving.config.ServingConfig`) and any config field as an override.
* ``serve_foreground(model_uri, port, config)``: what ``star-elastic serve CHECKPOINT_OR_MODEL_URI
  --port N`` runs. Starts a local Ray (unless one is running), serves on ``host:port`` until
  SIGTERM or Ctrl-C, then ``serve.shutdown()``.
* ``create_app(state)``: the FastAPI app alone (no Ray), e.g. under uvicorn or in a benchmark.

Examples::

    serve run components.serving.app:build_app model_uri=models:/star-elastic-demo@champion
    python -c "from components.serving import serve_foreground; serve_foreground('runs/demo/latest', 8000)"
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "full",
      "messages": [{"role": "user", "content": "7+5*3-2"}], "reasoning_budget": 64, "think_model": "small"}'

Routes: ``GET /health`` (liveness, with the replica's pid and start time), ``GET /ready``,
``GET /v1/models`` (every budget with total/active parameters), ``GET /v1/models/{id}``,
``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming or not), ``GET /stats``
(per-budget metrics, engine counters, resident memory). ``/v1/*`` and ``/stats`` need the bearer
key when one is configured; the probes never do.

Design choices:

* A plain deployment with a FastAPI ingress whose app is built on the replica after the model is
  loaded (``__serve_build_asgi_app__``), so the same app serves with and without Ray. No Serve
  model multiplexing: budgets are views of one weight set, so any replica serves any budget and
  there is nothing to load or evict per model id.
* Every request error is answered here as an OpenAI-style JSON error (4xx for the client's
  mistakes); nothing a request carries can raise out of a handler, so a malformed request never
  costs a replica. Backpressure beyond the replica's capacity is Serve's (see the config module).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from components.serving import protocol as P
from components.serving.config import APP_NAME, ServingConfig, load_config, resolve_checkpoint
from components.serving.engine import Engine, EngineStopped, Job, JobResult
from components.serving.loading import LoadedModel
from components.serving.metrics import ServingMetrics
from model.generate import SamplingParams

log = logging.getLogger("star_elastic.serving")


def error_response(err: P.OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# ---------------------------------------------------------------------- replica state
class ServingState:
    """What one replica holds: the engine over one weight copy, metrics, identity (pid, start time)."""

    def __init__(self, model_uri: str, config: ServingConfig) -> None:
        self.model_uri, self.config = model_uri, config
        self.api_key = config.resolved_api_key()
        self.loaded = LoadedModel.load(resolve_checkpoint(model_uri, config), config)
        self.engine = Engine(self.loaded, config).start()
        self.metrics = ServingMetrics()
        self.pid, self.started_at = os.getpid(), time.time()
        self.cards = self.loaded.cards

    def close(self) -> None:
        self.engine.stop()

    def memory(self) -> dict[str, Any]:
        import psutil

        registry = self.loaded.registry
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in registry.full.state_dict().values()
        }
        return {
            "rss_bytes": psutil.Process().memory_info().rss,
            "weight_bytes": sum(storages.values()),  # the one weight copy (each storage counted once)
            "copied_bytes": registry.copied_bytes(),  # per budget: what building its model allocated
        }

    # ------------------------------------------------------------------ request -> job
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.OpenAIError(
                401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_request_bytes
        too_big = P.OpenAIError(413, f"request body larger than {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():  # bounded even without (or with a lying) Content-Length
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _limit(self, value: int | None, default: int | None, name: str, minimum: int) -> int | None:
        if value is None:
            return default
        cap = self.config.max_tokens_limit
        if not minimum <= value <= cap:
            raise P.OpenAIError(
                400, f"{name}: must be between {minimum} and {cap}, got {value}", param=name, code="invalid_value"
            )
        return value

    def check_budget(self, name: str, param: str) -> str:
        if name not in self.cards:
            status = 404 if param == "model" else 400
            raise P.OpenAIError(
                status, f"{param}: unknown model {name!r}; served models are {list(self.cards)}",
                param=param, code="model_not_found",
            )  # fmt: skip
        return name

    def make_job(self, req: P.ChatCompletionRequest | P.CompletionRequest) -> Job:
        cfg, tok = self.config, self.loaded.tokenizer
        model = self.check_budget(req.model, "model")
        max_tokens = self._limit(req.max_tokens, cfg.default_max_tokens, "max_tokens", 1)
        cap = self._limit(req.reasoning_budget, cfg.default_think_cap, "reasoning_budget", 0)
        if isinstance(req, P.ChatCompletionRequest):
            prompt, thinks = tok.encode(P.chat_prompt(req.messages)), True
        else:
            if isinstance(req.prompt, str):
                prompt = tok.encode(req.prompt)
            else:
                bad = [i for i in req.prompt if not 0 <= i < tok.vocab_size]
                if bad:
                    raise P.OpenAIError(
                        400, f"prompt: token ids {bad[:5]} outside [0, {tok.vocab_size})", param="prompt"
                    )
                prompt = list(req.prompt)
            thinks = bool(prompt) and prompt[-1] == tok.think_open_id
        if not prompt:
            raise P.OpenAIError(400, "prompt: empty prompt", param="prompt")
        if len(prompt) > cfg.max_prompt_tokens:
            raise P.OpenAIError(
                400, f"prompt: {len(prompt)} tokens, more than the limit of {cfg.max_prompt_tokens}", param="prompt"
            )
        think = None
        if thinks:
            think = self.check_budget(req.think_model, "think_model") if req.think_model is not None else model
            size_t, size_a = self.cards[think].active_params, self.cards[model].active_params
            if size_t > size_a and not cfg.allow_think_larger:
                raise P.OpenAIError(
                    400, f"think_model: {think!r} ({size_t:,} active parameters) is larger than model {model!r} "
                    f"({size_a:,}); elastic budget control thinks on a smaller budget", param="think_model",
                )  # fmt: skip
        else:
            for name in ("think_model", "reasoning_budget"):
                if getattr(req, name) is not None:
                    raise P.OpenAIError(
                        400, f"{name}: this prompt has no thinking phase (a completion prompt must end with "
                        f"'<think>' to think)", param=name,
                    )  # fmt: skip
        sampling = SamplingParams(
            max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed
        )
        return Job(
            prompt, model, think, cap, max_tokens, sampling, req.stops, req.stream, asyncio.get_running_loop()
        )  # fmt: skip

    def submit(self, job: Job) -> None:
        try:
            self.engine.submit(job)
        except EngineStopped as err:
            raise P.OpenAIError(
                503, f"the model is not serving: {err}", type="server_error", code="unavailable"
            ) from None


async def _result(job: Job) -> JobResult:
    done = False
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "done":
                done = True
                return payload
            if kind == "error":
                done = True
                raise P.OpenAIError(500, payload, type="server_error", code="generation_failed")
    finally:
        if not done:  # the client went away: stop decoding for it
            job.cancelled = True


def _budget_control(job: Job, r: JobResult) -> P.BudgetControl:
    return P.BudgetControl(
        think_model=job.think_budget, answer_model=job.answer_budget, think_stop=r.think_stop,
        answer_start=r.answer_start, answer_fed_tokens=r.answer_fed,
    )  # fmt: skip


def _usage(r: JobResult) -> P.Usage:
    return P.usage(r.prompt_tokens, r.reasoning_tokens, r.answer_tokens)


# ---------------------------------------------------------------------- the FastAPI app
def create_app(state: ServingState) -> FastAPI:
    """The HTTP API over one :class:`ServingState` (see the module docstring for the routes)."""
    app = FastAPI(title="star-elastic", description="Every budget of a nested elastic checkpoint.")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(P.OpenAIError(exc.status_code, str(exc.detail), code=code))

    def finish(route: str, budget: str, status: int, r: JobResult | None = None) -> None:
        tokens = None
        if r is not None:
            gen = r.reasoning_tokens + r.answer_tokens
            tokens = {"prompt": r.prompt_tokens, "reasoning": r.reasoning_tokens, "completion": gen}
        state.metrics.record(
            budget, route, status, r.total_s if r else None, r.first_token_s if r else None, tokens
        )  # fmt: skip

    async def generate(request: Request, route: str, cls: type) -> Response:
        budget = "none"
        try:
            state.authorize(request)
            req = P.parse_request(cls, await state.read_body(request))
            budget = req.model if req.model in state.cards else "unknown"
            job = state.make_job(req)
            state.submit(job)
            if req.stream:
                return StreamingResponse(stream(job, req, route), media_type="text/event-stream")
            r = await _result(job)
        except P.OpenAIError as err:
            finish(route, budget, err.status)
            return error_response(err)
        except Exception as err:  # a bug, not the client's fault: answer 500 and keep serving
            log.exception("request failed")
            finish(route, budget, 500)
            return error_response(P.OpenAIError(500, f"internal error: {type(err).__name__}", type="server_error"))
        finish(route, budget, 200, r)
        rid, created = P.new_id("chatcmpl" if route == "chat" else "cmpl"), P.now()
        if route == "chat":
            msg = P.AssistantMessage(content=r.content, reasoning_content=r.reasoning)
            body: Any = P.ChatCompletion(
                id=rid, created=created, model=req.model, usage=_usage(r), budget_control=_budget_control(job, r),
                choices=[P.ChatChoice(message=msg, finish_reason=r.finish_reason)],
            )  # fmt: skip
        else:
            choice = P.CompletionChoice(text=r.content, reasoning_content=r.reasoning, finish_reason=r.finish_reason)
            body = P.Completion(
                id=rid, created=created, model=req.model, choices=[choice], usage=_usage(r),
                budget_control=_budget_control(job, r),
            )  # fmt: skip
        return Response(body.model_dump_json(), media_type="application/json")

    async def stream(job: Job, req: Any, route: str) -> AsyncIterator[bytes]:
        rid, created, chat = P.new_id("chatcmpl" if route == "chat" else "cmpl"), P.now(), route == "chat"

        def chunk(reasoning: str | None = None, content: str | None = None, finish_reason: str | None = None, **kw):
            if chat:
                delta = P.ChatDelta(role="assistant" if kw.pop("first", False) else None)
                delta.content, delta.reasoning_content = content, reasoning
                choice = P.ChatChunkChoice(delta=delta, finish_reason=finish_reason)
                return P.sse(P.ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[choice], **kw))
            choice = P.CompletionChoice(text=content or "", reasoning_content=reasoning, finish_reason=finish_reason)
            return P.sse(P.Completion(id=rid, created=created, model=req.model, choices=[choice], **kw))

        done = False
        try:
            if chat:
                yield chunk(first=True, content="")
            while True:
                kind, payload = await job.events.get()
                if kind == "reasoning":
                    yield chunk(reasoning=payload)
                elif kind == "content":
                    yield chunk(content=payload)
                elif kind == "error":
                    done = True
                    finish(route, req.model, 500)
                    yield P.sse(P.OpenAIError(500, payload, type="server_error", code="generation_failed").body())
                    break
                else:
                    done = True
                    finish(route, req.model, 200, payload)
                    yield chunk(finish_reason=payload.finish_reason)
                    if req.include_usage:
                        u = _usage(payload)
                        yield P.sse(
                            {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "model": req.model, "choices": [], "usage": u.model_dump()}
                        )  # fmt: skip
                    break
            yield P.sse("[DONE]")
        finally:
            if not done:  # the client disconnected mid-stream
                job.cancelled = True

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat", P.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completions", P.CompletionRequest)

    def cards() -> list[P.ModelCard]:
        created = int(state.started_at)
        fmt = state.loaded.format
        return [
            P.ModelCard(
                id=c.name, created=created, total_params=c.total_params, active_params=c.active_params,
                active_fraction=c.active_fraction, architecture=c.architecture, format=fmt,
            )
            for c in state.cards.values()
        ]  # fmt: skip

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        try:
            state.authorize(request)
        except P.OpenAIError as err:
            return error_response(err)
        return Response(P.ModelList(data=cards()).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str, request: Request) -> Response:
        try:
            state.authorize(request)
            state.check_budget(model_id, "model")
        except P.OpenAIError as err:
            return error_response(err)
        card = next(c for c in cards() if c.id == model_id)
        return Response(card.model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.engine.alive
        body = {"status": "ok" if ok else "unhealthy", "pid": state.pid, "started_at": state.started_at}
        if not ok:
            body["error"] = state.engine.error or "the decode thread is not running"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = state.engine.alive
        return JSONResponse({"ready": ok, "models": list(state.cards)}, status_code=200 if ok else 503)

    @app.get("/stats")
    async def stats(request: Request) -> Response:
        try:
            state.authorize(request)
        except P.OpenAIError as err:
            return error_response(err)
        body = {
            "pid": state.pid, "started_at": state.started_at, "format": state.loaded.format,
            "models": list(state.cards), "engine": state.engine.snapshot_stats(), "metrics": state.metrics.snapshot(),
            "metrics_exported_to_ray": state.metrics.exported, **state.memory(),
        }  # fmt: skip
        return JSONResponse(body)

    return app


# ---------------------------------------------------------------------- Ray Serve
@serve.deployment
@serve.ingress()
class StarElasticServer:
    """One replica: one weight copy, every budget; the FastAPI app is built after loading."""

    def __init__(self, model_uri: str, config: dict[str, Any] | None = None) -> None:
        self.state = ServingState(model_uri, ServingConfig.model_validate(config or {}))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.state)

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: only when the decode thread is gone."""
        if not self.state.engine.alive:
            raise RuntimeError(self.state.engine.error or "the decode thread is not running")

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.close()


def build_app(args: Mapping[str, Any]) -> serve.Application:
    """The Serve application for ``args = {"model_uri": ..., ["config": dict | path], [field overrides]}``."""
    rest = dict(args)
    model_uri = rest.pop("model_uri", None)
    if not model_uri:
        raise ValueError("build_app: args must give model_uri (a checkpoint folder, s3://... or models:/NAME@alias)")
    config = load_config(rest.pop("config", None), **rest)
    return StarElasticServer.options(**config.deployment_options()).bind(str(model_uri), config.model_dump())


def serve_foreground(
    model_uri: str,
    port: int = 8000,
    config: ServingConfig | Mapping[str, Any] | str | Path | None = None,
    host: str = "127.0.0.1",
) -> None:
    """Serve ``model_uri`` on ``http://host:port`` in the foreground until SIGTERM or Ctrl-C.

    Uses the running Ray if there is one, else starts a local one (and stops it on exit). Always
    ends with ``serve.shutdown()``. ``config``: a :class:`ServingConfig`, a dict or a YAML/JSON path.
    """
    import ray

    cfg = load_config(config)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False)
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app({"model_uri": model_uri, "config": cfg.model_dump()}), name=APP_NAME, route_prefix="/")
        print(f"star-elastic: serving {model_uri} at http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
