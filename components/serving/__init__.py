"""Serving: every budget of one nested checkpoint behind an OpenAI-compatible API on Ray Serve.

``build_app(args)`` is the Serve application builder (``components.serving.app:build_app``),
``serve_foreground(model_uri, port, config)`` serves locally until SIGTERM / Ctrl-C (what
``star-elastic serve`` runs), ``ServingApp(state)`` is the HTTP API without Ray
(:mod:`components.serving.api`), ``ServingConfig`` documents every setting. The entry points are imported on
first use so that reading the config does not start importing Ray or torch.
"""

from __future__ import annotations

from typing import Any

from components.serving.config import AutoscalingSettings, ServingConfig, load_config

__all__ = ["AutoscalingSettings", "ServingApp", "ServingConfig", "build_app", "load_config", "serve_foreground"]


def __getattr__(name: str) -> Any:
    if name == "ServingApp":
        from components.serving.api import ServingApp

        return ServingApp
    if name in ("build_app", "serve_foreground"):
        from components.serving import app

        return getattr(app, name)
    raise AttributeError(f"module 'components.serving' has no attribute {name!r}")
