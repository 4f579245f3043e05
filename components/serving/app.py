"""The Ray Serve application: an OpenAI-compatible API over every budget of one nested checkpoint.

Entry points: ``build_app(args)`` for ``serve run`` / ``serve deploy`` / a KubeRay RayService (the model
replicas behind an ingress, :mod:`components.serving.deployments`);
``serve_foreground(model_uri, port, config)`` for ``star-elastic serve`` (checks a local checkpoint
before Ray starts, serves until SIGTERM or Ctrl-C). The HTTP API each replica runs, usable without Ray,
is :class:`~components.serving.api.ServingApp`.

Routes, examples and design notes: docs/serving.md ("The application").
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve

from components.serving.config import APP_NAME, ServingConfig, load_config
from components.serving.deployments import StarElasticIngress, StarElasticServer

__all__ = ["build_app", "serve_foreground"]


# ---------------------------------------------------------------------- Ray Serve
def build_app(args: Mapping[str, Any]) -> serve.Application:
    """The Serve application for ``args = {"model_uri": ..., ["config": dict | path], [field overrides]}``:
    the model replicas (``StarElasticServer``) behind the ingress that answers HTTP (``StarElasticIngress``)."""
    rest = dict(args)
    model_uri = rest.pop("model_uri", None)
    if not model_uri:
        raise ValueError("build_app: args must give model_uri (a checkpoint folder, s3://... or models:/NAME@alias)")
    config = load_config(rest.pop("config", None), **rest)
    settings = config.model_dump()
    model = StarElasticServer.options(**config.deployment_options()).bind(str(model_uri), settings)
    return StarElasticIngress.options(**config.ingress_options()).bind(model, settings)


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
