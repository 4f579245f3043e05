"""The serving application deployed on the test session's Ray Serve, for the serving test modules."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx


@contextmanager
def running_app(name: str, model_uri: str | Path, config: dict[str, Any], port: int) -> Iterator[str]:
    """Deploy ``build_app`` over ``model_uri`` as application ``name`` at ``/``, wait until ``/ready``
    answers 200, yield its URL, then delete the application."""
    from ray import serve

    from components.serving.app import build_app

    serve.run(build_app({"model_uri": str(model_uri), "config": config}), name=name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
            assert time.time() < deadline, "the app never became ready"
            time.sleep(0.5)
        yield url
    finally:
        serve.delete(name)
