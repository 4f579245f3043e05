"""Library messages that tell a person running the pipeline nothing, silenced where they are emitted.

Design choices:

* Each message is named by its logger or warning category and the start of its text, never a whole
  library or every warning: a new warning from the same library still shows. A named warning is
  filtered twice: by a warnings filter, and by ``warnings.showwarning`` for a library that shows its
  warnings under a filter of its own (MLflow does).
* :func:`quiet_libraries` installs the filters in the process that calls it (idempotent). The pipeline
  calls it on the driver, and every Ray worker of the pipeline's job runs it at start-up as Ray's
  ``worker_process_setup_hook`` (:func:`worker_runtime_env`), so tasks, Ray Train's workers and its
  controller are quiet before any of their code is imported.
* What a library only lets an environment variable decide (MLflow's artifact-download bars, Ray
  Train's preemption watcher) is set in the workers' runtime environment, never in the driver's
  ``os.environ``. One exception: Ray wraps the worker lines it forwards in colour codes unless the
  driver's ``RAY_COLOR_PREFIX`` is ``0``; when the driver's output is not a terminal (a log file, CI)
  :func:`plain_forwarded_lines` sets it, unless the user set it already.

Silenced:

* torch's ``FutureWarning`` that ``all_gather_into_tensor`` is deprecated (DeepSpeed calls it each step);
* DeepSpeed's "Setting accelerator to CPU" (once per process on a CPU machine, where CPU is expected);
* MLflow's "Any type hint is inferred as AnyType" ``UserWarning`` (the served model's inputs are
  validated by the model itself), its "Running the predict function ..." note per logged model, its
  "Creating initial MLflow database tables" notes on a new store, and its artifact-download bars;
* Ray's notice that token authentication is on (the default of a local runtime);
* Ray Train's preemption watcher on a local runtime (one machine is never preempted): its actor
  logs an error line about its constructor arguments at every training start.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

from components.progress import PROGRESS_ENV, is_terminal

WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", "torch.distributed"),
    (UserWarning, r"(\x1b\[[0-9;]*m)?Any type hint is inferred as AnyType", "mlflow"),  # MLflow colours it
)
"""(category, start of the message (a regex), the package it is attributed to) of each warning."""

LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    "DeepSpeed": ("Setting accelerator to CPU",),
    "mlflow.models.signature": ("Running the predict function to generate output",),
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables"),
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled",),
}
"""Logger name -> starts of the messages it drops."""

WORKER_ENV = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
"""Environment of every worker: MLflow reads this one switch for its download and upload bars."""

LOCAL_WORKER_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""Added on a local runtime, which one machine holds and nothing preempts."""


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def _named(message: str, category: type[Warning], filename: str) -> bool:
    """Whether a warning about to be shown is one of :data:`WARNINGS` (its package found by its file)."""
    path = filename.replace("\\", "/")
    return any(
        issubclass(category, cat) and re.match(text, message, re.I) and f"/{package.replace('.', '/')}/" in path
        for cat, text, package in WARNINGS
    )


def _hiding_named(show: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` that skips :data:`WARNINGS`: MLflow shows its own warnings under a filter of
    its own (``simplefilter("once")`` inside the call), which outranks any filter set before the call."""

    def showwarning(message: Any, category: type[Warning], filename: str, lineno: int, *args: Any) -> None:
        if not _named(str(message), category, filename):
            show(message, category, filename, lineno, *args)

    showwarning.hides_named = True  # type: ignore[attr-defined]
    return showwarning


def quiet_libraries() -> None:
    """Install this module's filters in this process (a second call changes nothing)."""
    for category, message, package in WARNINGS:
        # filterwarnings moves an identical filter to the front instead of adding it twice
        warnings.filterwarnings("ignore", message=message, category=category, module=re.escape(package) + r"\.")
    if not getattr(warnings.showwarning, "hides_named", False):
        warnings.showwarning = _hiding_named(warnings.showwarning)
    for name, starts in LOG_MESSAGES.items():
        logger = logging.getLogger(name)  # the same object the library gets, before or after it is imported
        if not any(isinstance(f, _DropMessages) and f.starts == starts for f in logger.filters):
            logger.addFilter(_DropMessages(starts))


RAY_COLOR_ENV = "RAY_COLOR_PREFIX"


def plain_forwarded_lines(stream: Any = None) -> bool:
    """No colour codes around the worker lines Ray forwards to this (driver) process when ``stream`` (default
    stdout) is not a terminal, where they would be written out as ``ESC[36m``; a user's own
    ``RAY_COLOR_PREFIX`` wins. Returns whether the lines will be plain."""
    if not is_terminal(sys.stdout if stream is None else stream):
        os.environ.setdefault(RAY_COLOR_ENV, "0")
    return os.environ.get(RAY_COLOR_ENV) == "0"


def worker_runtime_env(local: bool) -> dict[str, Any]:
    """The ``runtime_env`` of the pipeline's Ray job: every worker runs :func:`quiet_libraries` at start-up,
    gets :data:`WORKER_ENV` (plus :data:`LOCAL_WORKER_ENV` when ``local``: the runtime was started here),
    and learns whether the driver draws progress on a terminal (:data:`components.progress.PROGRESS_ENV`)."""
    env = {**WORKER_ENV, **(LOCAL_WORKER_ENV if local else {})}
    env[PROGRESS_ENV] = "bar" if is_terminal(sys.stdout) else "lines"
    return {"worker_process_setup_hook": f"{__name__}.quiet_libraries", "env_vars": env}
