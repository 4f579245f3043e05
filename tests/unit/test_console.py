"""Library noise filtered where it is emitted: the named messages go, anything else from the same libraries
stays; the workers' runtime environment carries the same setup."""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from components import console
from components.console import quiet_libraries, worker_runtime_env


@pytest.fixture
def fresh_loggers():
    """The loggers without this module's filters (an earlier test may have run the pipeline's entry point),
    and as they were again after the test."""
    before = {name: list(logging.getLogger(name).filters) for name in console.LOG_MESSAGES}
    for name, filters in before.items():
        logging.getLogger(name).filters[:] = [f for f in filters if not isinstance(f, console._DropMessages)]
    yield
    for name, filters in before.items():
        logging.getLogger(name).filters[:] = filters


def all_gather_into_tensor_once(store: Path) -> None:
    """torch's real deprecated collective, in a one-process gloo group (``store``: a file in an existing folder)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", timeout=timedelta(seconds=30), rank=0, world_size=1)
    try:
        out = torch.zeros(2)
        dist.all_gather_into_tensor(out, torch.ones(2))
        assert out.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def mlflow_any_hint() -> None:
    """MLflow's real schema inference of a ``dict[str, Any]`` type hint (what the served model's predict has)."""
    from mlflow.types.type_hints import _infer_colspec_type_from_type_hint

    _infer_colspec_type_from_type_hint(dict[str, Any])


def messages(seen: list[warnings.WarningMessage]) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in seen]


def test_the_named_warnings_are_silenced_and_an_unrelated_one_is_not(fresh_loggers, tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        all_gather_into_tensor_once(tmp_path / "store-a")
        mlflow_any_hint()
    loud = messages(seen)
    assert any("all_gather_into_tensor` is deprecated" in m for m in loud), loud  # the triggers are real
    assert any("Any type hint is inferred as AnyType" in m for m in loud), loud

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries()
        quiet_libraries()  # twice: still one filter each
        all_gather_into_tensor_once(tmp_path / "store-b")
        mlflow_any_hint()
        same_words = "`torch.distributed.all_gather_into_tensor` is deprecated (said by us)"
        warnings.warn(same_words, FutureWarning, stacklevel=1)
        warnings.warn("another FutureWarning", FutureWarning, stacklevel=1)
        warnings.warn("Any type hint is inferred as AnyType (said by us)", UserWarning, stacklevel=1)
        ours = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None and "AnyType" in f[1].pattern]
    assert messages(seen) == [
        # only the libraries' own are filtered: the same words from another module still show
        "FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated (said by us)",
        "FutureWarning: another FutureWarning",
        "UserWarning: Any type hint is inferred as AnyType (said by us)",
    ]
    assert len(ours) == 1


def test_a_warning_mlflow_shows_under_its_own_filter_is_hidden_too(fresh_loggers, monkeypatch):
    from mlflow.utils.annotations import filter_user_warnings_once  # MLflow's "once" filter around its calls

    def other() -> None:
        warnings.warn("another UserWarning", UserWarning, stacklevel=1)

    shown: list[str] = []
    with warnings.catch_warnings():
        monkeypatch.setattr(warnings, "showwarning", lambda message, *args: shown.append(str(message)))
        warnings.onceregistry.clear()  # "once": shown once per process, and an earlier test may have shown it
        filter_user_warnings_once(mlflow_any_hint)()
        assert len(shown) == 1 and "Any type hint is inferred as AnyType" in shown[0]  # the trigger is real
        warnings.onceregistry.clear()
        quiet_libraries()
        quiet_libraries()
        filter_user_warnings_once(mlflow_any_hint)()
        filter_user_warnings_once(other)()
    assert shown[1:] == ["another UserWarning"]


@pytest.mark.parametrize(
    ("logger", "noise"),
    [
        ("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."),
        ("mlflow.models.signature", "Running the predict function to generate output based on input example"),
        ("mlflow.store.db.utils", "Creating initial MLflow database tables..."),
        ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this cluster"),
    ],
)
def test_the_named_log_messages_are_dropped_and_the_rest_of_the_logger_is_not(fresh_loggers, logger, noise):
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger(logger)
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.warning(noise)
        quiet_libraries()
        quiet_libraries()
        log.warning(noise)
        log.warning("something that matters")
        log.info("Setting something else")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert records == [noise, "something that matters", "Setting something else"]
    assert sum(isinstance(f, console._DropMessages) for f in log.filters) == 1


def test_the_workers_run_the_same_setup_and_only_a_local_runtime_drops_the_preemption_watcher():
    local, cluster = worker_runtime_env(local=True), worker_runtime_env(local=False)
    assert local["worker_process_setup_hook"] == "components.console.quiet_libraries"
    assert callable(quiet_libraries)
    assert local["env_vars"]["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
    assert local["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in cluster["env_vars"]
    assert local["env_vars"]["STAR_ELASTIC_PROGRESS"] == "lines"  # pytest's stdout is no terminal


def test_forwarded_worker_lines_carry_no_colour_codes_into_a_file(monkeypatch):
    """Output to a file or pipe: Ray's forwarded lines are plain; on a terminal they keep Ray's colours; a
    user's own RAY_COLOR_PREFIX is never overridden."""
    import io

    from components.console import RAY_COLOR_ENV, plain_forwarded_lines

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv(RAY_COLOR_ENV, raising=False)
    assert not plain_forwarded_lines(Terminal()) and RAY_COLOR_ENV not in os.environ
    assert plain_forwarded_lines(io.StringIO()) and os.environ[RAY_COLOR_ENV] == "0"
    monkeypatch.setenv(RAY_COLOR_ENV, "1")
    assert not plain_forwarded_lines(io.StringIO()) and os.environ[RAY_COLOR_ENV] == "1"
