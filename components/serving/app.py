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
      "messages": [{"role": "user", "content": "Q:7+5*3-2\\n"}], "reasoning_budget": 64, "think_model": "small"}'

Routes: ``GET /health`` (liveness, with the replica's pid and start time), ``GET /ready``,
``GET /v1/models`` (every budget with total/active parameters), ``GET /v1/models/{id}``,
``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming or not), ``GET /stats``
(per-budget metrics, engine counters, resident memory, as JSON), ``GET /metrics`` (the same figures
in the Prometheus text format, for a scraper pointed at the serving port). ``/v1/*`` and ``/stats``
need the bearer key when one is configured; the probes and ``/metrics`` never do (as vLLM's).

Design choices:

* A plain deployment with a FastAPI ingress whose app is built on the replica after the model is
  loaded (``__serve_build_asgi_app__``), so the same app serves with and without Ray. No Serve
  model multiplexing: budgets are views of one weight set, so any replica serves any budget and
  there is nothing to load or evict per model id.
* Every request error is answered here as an OpenAI-style JSON error (4xx for the client's
  mistakes, 503 with ``Retry-After`` when the replica is full or not serving); nothing a request
  carries can raise out of a handler, so a malformed request never costs a replica. Backpressure
  is the replica's own (:class:`~components.serving.state.Admission`, see the config module).
* ``serve_foreground`` checks a local checkpoint completely before Ray starts
  (:func:`~components.serving.loading.preflight`), so a broken checkpoint is one line, not a
  failed deployment after three replica retries.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from components.serving import protocol as P
from components.serving.config import APP_NAME, ServingConfig, load_config
from components.serving.engine import JobResult
from components.serving.responses import Renderer, collect
from components.serving.state import ServingState

__all__ = ["ServingState", "StarElasticServer", "build_app", "create_app", "serve_foreground"]

log = logging.getLogger("star_elastic.serving")
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def error_response(err: P.OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# ---------------------------------------------------------------------- the FastAPI app
def create_app(state: ServingState) -> FastAPI:
    """The HTTP API over one :class:`ServingState` (see the module docstring for the routes)."""
    app = FastAPI(title="star-elastic", description="Every budget of a nested elastic checkpoint.")
    token_text = lambda i: state.loaded.tokenizer.decode([i])  # noqa: E731 - a token as logprobs show it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(P.OpenAIError(exc.status_code, str(exc.detail), code=code))

    def finish(route: str, budget: str, status: int, results: list[JobResult] | None = None, prompt: int = 0) -> None:
        latency = ttft = tokens = None
        if results:
            latency = max(r.total_s for r in results)
            ttft = min(r.first_token_s for r in results)
            tokens = {
                "prompt": prompt,
                "reasoning": sum(r.reasoning_tokens for r in results),
                "completion": sum(r.reasoning_tokens + r.answer_tokens for r in results),
            }
        state.metrics.record(budget, route, status, latency, ttft, tokens)

    async def generate(request: Request, route: str, cls: type) -> Response:
        budget, admitted, streaming = "none", False, False
        try:
            state.authorize(request)
            req = P.parse_request(cls, await state.read_body(request))
            budget = req.model if req.model in state.cards else "unknown"
            jobs, prompts = state.make_jobs(req)
            n_prompt = sum(len(p.ids) for p in prompts)
            await state.admission.acquire()
            admitted = True
            state.submit(jobs)
            render = Renderer(req, jobs, prompts, token_text)
            if req.stream:

                async def events():
                    try:
                        async for event in render.stream(
                            lambda status, rs: finish(route, budget, status, rs, n_prompt)
                        ):
                            yield event
                    finally:
                        state.admission.release()

                streaming = True
                return StreamingResponse(events(), media_type="text/event-stream")
            results = await collect(jobs)
        except P.OpenAIError as err:
            finish(route, budget, err.status)
            return error_response(err)
        except Exception as err:  # a bug, not the client's fault: answer 500 and keep serving
            log.exception("request failed")
            finish(route, budget, 500)
            return error_response(P.OpenAIError(500, f"internal error: {type(err).__name__}", type="server_error"))
        finally:
            if admitted and not streaming:
                state.admission.release()
        finish(route, budget, 200, results, n_prompt)
        return Response(render.body(results).model_dump_json(), media_type="application/json")

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
            "admission": {"running": state.admission.running, "waiting": state.admission.waiting,
                          "rejected": state.admission.rejected},
            "metrics_exported_to_ray": state.metrics.exported, **state.memory(),
        }  # fmt: skip
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.prometheus(state.gauges()), media_type=PROMETHEUS_TEXT)

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
    check: bool = True,
) -> None:
    """Serve ``model_uri`` on ``http://host:port`` in the foreground until SIGTERM or Ctrl-C.

    ``check``: run :func:`~components.serving.loading.preflight` first (off when the caller already did).

    Uses the running Ray if there is one, else starts a local one (and stops it on exit). Always
    ends with ``serve.shutdown()``. ``config``: a :class:`ServingConfig`, a dict or a YAML/JSON path.
    """
    cfg = load_config(config)
    if check:
        from components.serving.loading import preflight

        preflight(model_uri, cfg)  # a broken local checkpoint: one line, before Ray starts
    import ray

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
