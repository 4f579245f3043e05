"""The Ray Serve deployments: model replicas behind a light ingress that outlives them.

``StarElasticServer`` is a model replica: one weight copy, every budget, the HTTP API of
:class:`~components.serving.api.ServingApp` driven in-process (no HTTP of its own), and a
``check_health`` that fails when the decode thread is gone or wedged, so Serve replaces the replica.
``StarElasticIngress`` answers HTTP: it holds no model, forwards each request to a model replica
through a deployment handle and relays the answer, and is what still answers when a replica dies:
an in-flight request ends as an OpenAI-shaped JSON 503 with ``Retry-After`` (a stream ends with a
terminal SSE error event), ``/health`` and ``/ready`` say 503 while no replica answers, and a request
that no replica takes within ``replica_wait_s`` is a 503 too, never an unbounded wait.

Design notes (why an ingress, what a client sees): docs/serving.md ("Replica death, health and autoscaling").
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from components.serving import protocol as P
from components.serving.config import ServingConfig

__all__ = ["StarElasticIngress", "StarElasticServer", "asgi_messages"]

log = logging.getLogger("star_elastic.serving")

REPLICA_GONE = (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)
"""What a handle call raises when its replica died (kill -9, OOM, node lost) or none is left."""
PROBES = ("/health", "/ready")


# ---------------------------------------------------------------------- the model replica
async def asgi_messages(app: Any, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any]]:
    """Run one HTTP request through the ASGI ``app`` in this process; yield what it sends.

    The request body arrives whole; closing the generator early (the client left) tells the app the
    client disconnected and cancels it, so a stream stops decoding for nobody.
    """
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(None)  # the app returned or raised: nothing more will come

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
        task.result()  # re-raise what the app raised
    finally:
        gone.set()
        if not task.done():
            task.cancel()


@serve.deployment
class StarElasticServer:
    """One model replica: one weight copy, every budget; called by the ingress, never over HTTP.

    Serve calls ``__del__`` when it stops the replica (scale-down, redeploy), which stops the decode thread.
    """

    def __init__(self, model_uri: str, config: dict[str, Any] | None = None) -> None:
        # here, not at the top: the ingress imports this module too and holds no model (no torch, no engine)
        from components.serving.api import ServingApp
        from components.serving.state import ServingState

        self.config = ServingConfig.model_validate(config or {})
        self.api = ServingApp(ServingState(model_uri, self.config))

    async def forward(
        self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[dict[str, Any]]:
        """One HTTP request as ASGI messages, after an ``accepted`` marker that tells the ingress a
        replica has taken it (so the ingress bounds the wait for a replica, not the generation)."""
        yield {"type": "accepted", "pid": os.getpid()}
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": query, "headers": [(bytes(k), bytes(v)) for k, v in headers],
            "client": None, "server": None,
        }  # fmt: skip
        async for message in asgi_messages(self.api.fastapi, scope, body):
            yield message

    def probe(self) -> dict[str, Any]:
        """What ``/health`` and ``/ready`` report for this replica (``error`` None when it serves)."""
        state = self.api.state
        return {
            "pid": state.pid,
            "started_at": state.started_at,
            "models": list(state.cards),
            "error": state.engine.health_error(self.config.stall_timeout_s),
        }

    def check_health(self) -> None:
        """Serve's health check: raising makes Serve replace this replica (decode thread gone or wedged)."""
        error = self.api.state.engine.health_error(self.config.stall_timeout_s)
        if error:
            raise RuntimeError(error)

    def __del__(self) -> None:
        api = getattr(self, "api", None)
        if api is not None:
            api.close()


# ---------------------------------------------------------------------- the ingress
@serve.deployment
class StarElasticIngress:
    """HTTP in front of the model replicas; answers for them when none can (see the module docstring)."""

    def __init__(self, model: DeploymentHandle, config: dict[str, Any] | None = None) -> None:
        self.config = ServingConfig.model_validate(config or {})
        self.model = model
        self.streaming = model.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        path = _app_path(request.scope)
        if request.method == "GET" and path in PROBES:
            return await self.probe(path)
        body = await self._body(request)
        call = self.streaming.forward.remote(request.method, path, request.scope.get("query_string", b""),
                                             list(request.headers.raw), body)  # fmt: skip
        try:
            try:
                await asyncio.wait_for(call.__anext__(), self.config.replica_wait_s)  # the "accepted" marker
            except TimeoutError:
                raise P.unavailable(
                    f"no model replica took the request within {self.config.replica_wait_s:g} s (replica_wait_s); "
                    "replicas are starting or restarting: retry later",
                    self.config.retry_after_s,
                    code="replica_unavailable",
                ) from None
            start = await call.__anext__()
            headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
            if dict(headers).get(b"content-type", b"").startswith(b"text/event-stream"):
                response: Response = StreamingResponse(self._relay(call), status_code=start["status"])
                response.raw_headers = headers
                return response
            chunks = [message.get("body", b"") async for message in call]
        except Exception as err:
            call.cancel()
            return _error_response(self._as_error(err))
        response = Response(b"".join(chunks), status_code=start["status"])
        response.raw_headers = headers  # the replica's, Content-Length included (the body is complete)
        return response

    async def probe(self, path: str) -> JSONResponse:
        """``/health`` (the replica's pid and start time) or ``/ready`` (its models); 503 when no replica
        answers within ``probe_timeout_s`` or the one that answers cannot serve."""
        reply = self.model.probe.remote()
        try:
            info = await asyncio.wait_for(_result(reply), self.config.probe_timeout_s)
            error = info["error"]
        except TimeoutError:
            reply.cancel()
            info, error = {}, f"no model replica answered within {self.config.probe_timeout_s:g} s"
        except Exception as err:  # a dead replica, no replica, or a bug in the probe: not serving either way
            info, error = {}, f"no model replica: {type(err).__name__}: {err}"
        ok = error is None
        if path == "/health":
            body = {"status": "ok" if ok else "unavailable"}
            body.update({k: info[k] for k in ("pid", "started_at") if k in info})
        else:
            body = {"ready": ok, "models": info.get("models", [])}
        if not ok:
            body["error"] = error
        headers = None if ok else P.unavailable("", self.config.retry_after_s).headers
        return JSONResponse(body, status_code=200 if ok else 503, headers=headers)

    async def _body(self, request: Request) -> bytes:
        """The body, read up to one byte past ``max_request_bytes``: the replica answers a larger one 413."""
        limit, chunks, size = self.config.max_request_bytes, [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                break
        return b"".join(chunks)

    async def _relay(self, call: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        """A stream's body; a replica that dies mid-stream ends it with a terminal SSE error event."""
        finished = False
        try:
            async for message in call:
                if message.get("body"):
                    yield message["body"]
            finished = True
        except Exception as err:
            finished = True
            yield P.sse(self._as_error(err).body())
        finally:
            if not finished:  # the client left: stop the replica's work for it
                call.cancel()

    def _as_error(self, err: Exception) -> P.OpenAIError:
        """The answer for a failed handle call: a replica gone or full is a 503 to retry; anything else a 500."""
        if isinstance(err, P.OpenAIError):
            return err
        if isinstance(err, BackPressureError):
            return P.unavailable(
                f"the server is overloaded: {err.message}; retry later", self.config.retry_after_s, code="overloaded"
            )
        if isinstance(err, REPLICA_GONE):
            log.warning("model replica lost during a request: %s", type(err).__name__)
            return P.unavailable(
                f"the model replica serving this request stopped ({type(err).__name__}); a new one is starting: "
                "retry later",
                self.config.retry_after_s,
                code="replica_unavailable",
            )
        log.error("request failed in the ingress", exc_info=err)
        return P.OpenAIError(500, f"internal error: {type(err).__name__}", type="server_error")


async def _result(reply: Any) -> Any:
    return await reply


def _app_path(scope: dict[str, Any]) -> str:
    """The request's path inside the application (without the route prefix Serve mounted it at)."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path or "/"


def _error_response(err: P.OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
