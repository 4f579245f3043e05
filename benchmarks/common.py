"""Timing helpers shared by the benchmarks: thread pinning, warmup + median-of-N timing, tables, JSON."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Timing:
    """Wall-clock seconds of repeated calls: the median is the figure reported, the rest shows the spread."""

    median_s: float
    min_s: float
    max_s: float
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        values = list(samples)
        return cls(statistics.median(values), min(values), max(values), values)


def set_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads (and as many inter-op threads where that can still be set).

    Both models of a comparison run in the same process after this call, so they get the same budget.
    """
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only allowed before the first parallel region
        torch.set_num_interop_threads(threads)


def time_call(
    fn: Callable[[], Any], warmup: int = 2, repeats: int = 5, setup: Callable[[], Any] | None = None
) -> Timing:
    """Time ``fn()`` ``repeats`` times after ``warmup`` untimed calls.

    ``setup`` (untimed) runs before every call, warmup included; its result is passed to ``fn`` when it
    returns something other than ``None`` (e.g. a fresh decoding cache).
    """
    samples: list[float] = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn() if arg is None else fn(arg)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            samples.append(elapsed)
    return Timing.of(samples)


@dataclass
class Case:
    """One side of a comparison: ``fn`` timed, after ``setup`` (untimed; its result is passed to ``fn``)."""

    fn: Callable[..., Any]
    setup: Callable[[], Any] | None = None


def time_interleaved(cases: dict[str, Case], warmup: int = 2, repeats: int = 5) -> dict[str, Timing]:
    """Time several cases round-robin: every round runs each case once, in the same order.

    On a shared machine the load drifts over a run; interleaving exposes every case to the same drift,
    so their ratio stays meaningful even when the absolute figures move. The order is reversed every
    other round, so no case always runs first (right after another case's memory traffic). Samples
    keep the round order, so :func:`paired_ratio` can compare the cases round by round.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for i in range(warmup + repeats):
        for name in names if i % 2 == 0 else reversed(names):
            case = cases[name]
            arg = case.setup() if case.setup is not None else None
            start = time.perf_counter()
            case.fn() if case.setup is None else case.fn(arg)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: Timing.of(s) for name, s in samples.items()}


def paired_ratio(numerator: Timing, denominator: Timing) -> tuple[float, float, float]:
    """Median and quartiles of ``numerator / denominator`` taken round by round (samples of
    :func:`time_interleaved`, same order). Other processes slow whole rounds, both cases alike, so the
    per-round ratio is steadier than the ratio of the two medians on a busy machine."""
    ratios = sorted(a / b for a, b in zip(numerator.samples, denominator.samples, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), q[0], q[2]


def load_average() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load averages (None where the OS does not report them)."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies over all CPUs from /proc/stat (None where it does not exist)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)


def other_cpu_load(seconds: float = 1.0) -> float | None:
    """Share of all CPUs busy during ``seconds`` of sleep here, i.e. used by other processes (0..1).

    The load average trails by minutes; this says whether the machine is busy right now.
    """
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return None
    return 1.0 - (after[0] - before[0]) / (after[1] - before[1])


def machine_info(threads: int) -> dict[str, Any]:
    """What the figures depend on: CPU, core count, versions, threads used."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": threads,
        "load_average": load_average(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable in a terminal too); floats are shown with 4 significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in text]
    return "\n".join(lines)


def save_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (dataclasses are converted) as indented JSON, creating parent folders."""

    def default(o: Any) -> Any:
        if hasattr(o, "__dataclass_fields__"):
            return asdict(o)
        raise TypeError(f"not JSON serialisable: {type(o).__name__}")

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=default) + "\n", encoding="utf-8")


def replace_section(path: str | Path, heading: str, body: str) -> None:
    """Write ``body`` (which starts with ``heading``) into the Markdown file at ``path``.

    A section already under ``heading`` is replaced up to the next ``## `` heading; other sections are
    kept in place. Without one, ``body`` is appended.
    """
    p = Path(path)
    text = p.read_text() if p.exists() else ""
    if heading in text:
        head, _, rest = text.partition(heading)
        nxt = rest.find("\n## ")
        text = (head.rstrip() + "\n\n" if head.strip() else "") + body.rstrip() + "\n"
        text += "\n" + rest[nxt + 1 :] if nxt >= 0 else ""
    elif text.strip():
        text = text.rstrip() + "\n\n" + body.rstrip() + "\n"
    else:
        text = body.rstrip() + "\n"
    p.write_text(text)
