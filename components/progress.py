"""Progress of a stage as a person reads it: one helper for every stage, whoever runs it and wherever
its output goes.

Design choices:

* One factory, :func:`progress_bar` (tqdm's ``update`` / ``set_postfix`` / ``close``), picks the form
  from where the output goes, so no stage decides it:

  - the driver writing to a terminal: tqdm, one line that updates in place;
  - the driver writing to a file or a pipe (``make run > log``): :class:`LineProgress`, plain lines with
    count, percent, rate and ETA. A carriage return in a file glues every frame of a bar into one line
    thousands of characters long;
  - a Ray task or Ray Train worker: Ray forwards its output to the driver line by line, so plain lines
    too, unless the driver is on a terminal and said so (:data:`PROGRESS_ENV` = ``bar`` in the job's
    runtime environment, :func:`components.console.worker_runtime_env`): then Ray's distributed tqdm,
    whose line the driver draws.

* :class:`LineProgress` writes at most one line per ``interval`` seconds, and from its own clock thread
  at least one per ``interval`` while the stage works, even when one unit of work takes longer: the
  rate then falls and the ETA grows, which is what a reader wants to see.
* :func:`stage_heartbeat`: the driver's side of the same rule. A stage's own lines start only once its
  task or training workers are up and its model is loaded; until then (and whenever the stage is
  otherwise quiet) the driver writes one ``still running`` line per ``silence`` seconds of console
  silence. It watches the driver's ``sys.stdout`` / ``sys.stderr``, which Ray's forwarded lines go through.
* The driver's output is line-buffered (:func:`line_buffered_console`), so a captured run reads as it
  happens.
* Only one process writes a given stage's lines (rank 0 of a training run, one calibration task): Ray
  folds lines from different processes that differ only in their numbers into one
  ``[repeated Nx across cluster]`` line, several seconds late.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Protocol, TextIO

PROGRESS_ENV = "STAR_ELASTIC_PROGRESS"
"""Set by the driver in its Ray workers' environment: ``bar`` when the driver draws on a terminal, else ``lines``."""

LINE_INTERVAL_S = 8.0
"""Seconds between two progress lines: under 10 s with room for Ray's log forwarding delay."""

INTERVAL_ENV = "STAR_ELASTIC_PROGRESS_INTERVAL_S"
"""Overrides :data:`LINE_INTERVAL_S` (0: a line at every update, as a test that follows each step wants)."""

HEARTBEAT_SILENCE_S = 9.0
"""Seconds of console silence after which the driver writes a stage's ``still running`` line."""


class Bar(Protocol):
    """What every form of progress offers (tqdm's names)."""

    def update(self, n: int = 1) -> Any: ...

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, **values: Any) -> Any: ...

    def close(self) -> Any: ...


# ---------------------------------------------------------------------- formatting
def format_seconds(seconds: float) -> str:
    """``42s``, ``2m07s``, ``1h02m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _format_rate(rate: float, unit: str) -> str:
    """``4.1 steps/s``, or ``12.5 s/format`` when one unit takes more than a second."""
    return f"{rate:.1f} {_plural(unit)}/s" if rate >= 1.0 else f"{1.0 / rate:.1f} s/{unit}"


# ---------------------------------------------------------------------- plain lines
def line_interval() -> float:
    """Seconds between two progress lines: :data:`INTERVAL_ENV` when set, else :data:`LINE_INTERVAL_S`."""
    value = os.environ.get(INTERVAL_ENV, "").strip()
    return max(0.0, float(value)) if value else LINE_INTERVAL_S


class LineProgress:
    """Progress as plain lines, e.g. ``[distill p1] step 120/640 (19%), 4.1 steps/s, ETA 2m07s, loss=0.25``.

    The first line comes ``interval`` seconds after the start (until then the driver's heartbeat speaks),
    the last one at :meth:`close`. ``initial``: units already done (a resumed run): the rate counts only
    the units done here. ``interval``: None reads :data:`INTERVAL_ENV`, else :data:`LINE_INTERVAL_S`.
    ``clock``: seconds, monotonic (tests pass a fake one). ``ticker``: start the thread that writes a
    line when ``interval`` seconds pass without an ``update``.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "it",
        *,
        initial: int = 0,
        interval: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        ticker: bool = True,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.interval = line_interval() if interval is None else interval
        self.n = self._first = initial
        self._stream = stream
        self._clock = clock
        self._start = self._last = clock()
        self._postfix = ""
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if ticker and self.interval > 0:
            self._thread = threading.Thread(target=self._tick, name=f"progress {desc}", daemon=True)
            self._thread.start()

    def line(self, final: bool = False) -> str:
        """The line for the current count (``final``: with the total time instead of the ETA)."""
        elapsed = self._clock() - self._start
        done = self.n - self._first
        rate = done / elapsed if elapsed > 0 else 0.0
        parts = [f"[{self.desc}] {self.unit} {self.n}" + (f"/{self.total}" if self.total > 0 else "")]
        if self.total > 0:
            parts[0] += f" ({100 * self.n // self.total}%)"
        if rate > 0:
            parts.append(_format_rate(rate, self.unit))
        if final:
            parts.append(f"done in {format_seconds(elapsed)}")
        elif self.total > 0:
            parts.append(f"ETA {format_seconds((self.total - self.n) / rate)}" if rate > 0 else "ETA ?")
        if self._postfix:
            parts.append(self._postfix)
        return ", ".join(parts)

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            self._write_if_due()

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, **values: Any) -> None:
        """Values shown at the end of the line (as ``key=value``), replacing the previous ones."""
        items = {**(ordered_dict or {}), **values}
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def close(self) -> None:
        """Stop the clock thread and write the final line (once)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._write(self.line(final=True))

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tick(self) -> None:
        while not self._stop.wait(min(1.0, self.interval / 4)):
            with self._lock:
                if not self._closed:
                    self._write_if_due()

    def _write_if_due(self) -> None:
        if self._clock() - self._last >= self.interval:
            self._write(self.line())

    def _write(self, text: str) -> None:
        self._last = self._clock()
        stream = self._stream or sys.stdout  # looked up at each line: pytest and the heartbeat swap it
        stream.write(text + "\n")
        stream.flush()


class _RayBar:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` over Ray's distributed tqdm (the driver draws it)."""

    def __init__(self, total: int, desc: str, unit: str, initial: int) -> None:
        from ray.experimental.tqdm_ray import tqdm as ray_tqdm

        self.desc = desc
        self.bar = ray_tqdm(total=total, desc=desc, unit=unit)
        if initial:
            self.bar.update(initial)

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, **values: Any) -> None:
        items = {**(ordered_dict or {}), **values}
        self.bar.set_description(self.desc + " " + ", ".join(f"{k}={v}" for k, v in items.items()))

    def close(self) -> None:
        self.bar.close()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- choosing the form
def in_ray_task() -> bool:
    """Whether this code runs inside a Ray task or actor (not on the driver)."""
    try:
        import ray
        import ray._private.worker as ray_worker
    except ImportError:  # pragma: no cover - Ray is a dependency
        return False
    return ray.is_initialized() and ray_worker.global_worker.mode == ray.WORKER_MODE


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for files, pipes, closed streams and objects without ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def console_form(stream: TextIO | None = None) -> Literal["tqdm", "ray", "lines"]:
    """How progress is shown here: tqdm (the driver on a terminal), Ray's bar (a worker whose driver is on
    a terminal) or plain lines (everything else)."""
    if in_ray_task():
        return "ray" if os.environ.get(PROGRESS_ENV) == "bar" else "lines"
    return "tqdm" if is_terminal(stream or sys.stdout) else "lines"


def progress_bar(
    total: int,
    desc: str,
    unit: str = "it",
    disable: bool = False,
    *,
    initial: int = 0,
    stream: TextIO | None = None,
) -> Bar:
    """A progress display of ``total`` units named ``desc``, in the form :func:`console_form` picks."""
    if disable:
        return _NoBar()
    form = console_form(stream)
    if form == "ray":
        return _RayBar(total, desc, unit, initial)
    if form == "lines":
        return LineProgress(total, desc, unit, initial=initial, stream=stream)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=stream or sys.stdout, dynamic_ncols=True)


# ---------------------------------------------------------------------- the driver's heartbeat
def line_buffered_console() -> None:
    """Write this process's ``sys.stdout`` / ``sys.stderr`` line by line, also into a file or a pipe (where
    Python buffers 8 KiB): ``tail -f`` on a captured run then sees each line, Ray's forwarded ones included,
    when it is written, not minutes later."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


class _Watched:
    """A text stream that notes when it was last written to, passing everything through."""

    def __init__(self, inner: TextIO, note: Callable[[], None]) -> None:
        self._inner, self._note = inner, note

    def write(self, text: str) -> int:
        if text:
            self._note()
        return self._inner.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, buffer, ...
        return getattr(self._inner, name)


@contextlib.contextmanager
def stage_heartbeat(
    name: str,
    log: Callable[[str], None] = print,
    silence: float = HEARTBEAT_SILENCE_S,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[None]:
    """While the body runs, ``log("<name>: still running, <elapsed>")`` after each ``silence`` seconds in which
    nothing was written to ``sys.stdout`` or ``sys.stderr`` (the stage's own lines, Ray's forwarded ones)."""
    start = clock()
    last = [start]

    def note() -> None:
        last[0] = clock()

    originals = sys.stdout, sys.stderr
    watched = _Watched(sys.stdout, note), _Watched(sys.stderr, note)
    sys.stdout, sys.stderr = watched  # type: ignore[assignment]
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(0.5, silence / 4)):
            now = clock()
            if now - last[0] >= silence:
                last[0] = now  # the line itself counts, even when log writes elsewhere
                log(f"{name}: still running, {format_seconds(now - start)}")

    thread = threading.Thread(target=beat, name=f"heartbeat {name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        # put the streams back unless someone replaced them meanwhile (then theirs stays)
        if sys.stdout is watched[0]:
            sys.stdout = originals[0]
        if sys.stderr is watched[1]:
            sys.stderr = originals[1]
