"""What every GPU-check section shares: a table row, the options and context a section runs with, timing that
waits for the device, the error measure of the kernel tests, and one-line descriptions of exceptions.

A section reports as it goes (:meth:`Context.row`), so that rows already measured survive a later failure or
the section's time limit; it calls :meth:`Context.check_time` between pieces of work, which raises
:class:`SectionTimeout` once the section's deadline has passed (the driver also kills an isolated section that
overruns it).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["pass", "fail", "skip", "error", "timeout"]
STATUSES: tuple[str, ...] = ("pass", "fail", "skip", "error", "timeout")
FAILED: frozenset[str] = frozenset({"fail", "error", "timeout"})
"""Statuses that make the run fail (exit 1); ``skip`` says why a check could not run here."""

REPO = Path(__file__).resolve().parents[2]
_OWN_CODE = ("model", "components", "pipelines")


@dataclass
class Row:
    """One line of the table: ``figures`` are the measured values (JSON-able), ``note`` why it is not a pass."""

    section: str
    check: str
    status: Status
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        return cls(**data)


@dataclass(frozen=True)
class Options:
    """How the sections run: ``device`` ``"cuda"`` or ``"cpu"``; ``quick``: tiny configs and few steps (the CPU
    smoke run); ``workdir``: a folder the sections may write checkpoints into. Picklable (sent to a child)."""

    device: str
    quick: bool
    workdir: str

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {self.device!r}")


class SectionTimeout(Exception):
    """The section's time limit was reached; the message says before what."""


@dataclass
class Context:
    """What a running section sees: its options, its name, its deadline (``time.monotonic()`` seconds) and where
    its rows go."""

    options: Options
    section: str
    deadline: float
    emit: Callable[[Row], None]

    @property
    def device(self) -> str:
        return self.options.device

    @property
    def quick(self) -> bool:
        return self.options.quick

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - time.monotonic()

    def check_time(self, before: str) -> None:
        """Raise :class:`SectionTimeout` when the deadline has passed (``before``: the work that would start)."""
        if self.left() <= 0:
            raise SectionTimeout(f"time limit reached before {before}")

    def row(self, check: str, status: Status, note: str = "", **figures: Any) -> Row:
        """Report one check (emitted at once) and return its row."""
        row = Row(self.section, check, status, figures, note)
        self.emit(row)
        return row

    def log(self, message: str) -> None:
        """A progress line on stderr (the table goes to stdout)."""
        print(f"[gpu_check {self.section}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- timing and errors
def synchronize(device: str) -> None:
    """Wait for queued device work (a no-op on CPU), so that wall-clock time covers the work."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int = 1) -> tuple[float, Any]:
    """(fastest of ``repeats`` wall-clock seconds of ``fn()``, each synchronised with the device; its last result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, result


def rel_err(got: Any, ref: Any) -> float:
    """Max absolute difference relative to the reference's magnitude (at least 1): the measure of
    ``tests/gpu/test_ssd_kernels.py``, whose tolerances the kernel rows use."""
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1.0)).item()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def _innermost(exc: BaseException) -> BaseException:
    """The first exception of an implicit or explicit chain (what went wrong before the handlers reacted)."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def where(exc: BaseException) -> str | None:
    """``path:line in function`` of the innermost frame of the project's own code (model/, components/,
    pipelines/) in ``exc``'s traceback, or None when it never passed through it."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            rel = Path(frame.filename).resolve().relative_to(REPO)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in _OWN_CODE:
            found = f"{rel}:{frame.lineno} in {frame.name}"
    return found


def describe(exc: BaseException, limit: int = 300) -> str:
    """One line: the exception's type and first line, the first exception of its chain when another one was
    raised while handling it (a failed CUDA-graph capture raises again as it ends), and where in the project's
    code the first one was raised."""
    first = _innermost(exc)
    text = _first_line(exc)
    if first is not exc:
        text += f" [first: {_first_line(first)}]"
    at = where(first) or where(exc)
    if at:
        text += f" (at {at})"
    return text if len(text) <= limit else text[: limit - 3] + "..."
