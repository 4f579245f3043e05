"""Running the GPU-check sections one after another, each within its own time limit, none able to stop the rest.

A section is a module with ``plan(options)`` (its checks, in order) and ``run(ctx)``. Its time limit is its
share of what is left of the total budget, so time a section leaves unused goes to the ones after it and the
whole run stays within the budget. Rows a section reported are kept whatever happens next; every planned
check it did not report gets a row saying why (the section's error, its time limit, or no report at all).

In process (``isolate=False``), the limit is cooperative: a section checks its deadline between pieces of work
(:meth:`~benchmarks.gpu.common.Context.check_time`). Isolated, each section runs in a child process of its own
(``spawn``; rows come back through a pipe as they are reported): a crash, a CUDA context broken by a failed
graph capture, or a hang costs that section only, and a child still running at its limit is killed.
"""

from __future__ import annotations

import importlib
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu.common import Context, Options, Row, SectionTimeout, describe


@dataclass(frozen=True)
class Section:
    """A section: its name, its share of the time budget, the module holding its functions and their names
    (``plan(options) -> list[str]``, ``run(ctx)``). Names, not functions: an isolated section's process imports
    only its own module."""

    name: str
    share: float
    module: str
    plan: str = "plan"
    run: str = "run"

    def function(self, which: str) -> Callable[..., Any]:
        """The section's ``plan`` or ``run`` function (imports its module)."""
        return getattr(importlib.import_module(self.module), getattr(self, which))


SECTIONS: tuple[Section, ...] = (
    Section("kernels", 0.3, "benchmarks.gpu.kernels"),  # Triton compiles and autotunes at each new shape
    Section("decode", 0.35, "benchmarks.gpu.decode"),
    Section("distill", 0.15, "benchmarks.gpu.distill"),
    Section("serve", 0.2, "benchmarks.gpu.serve"),
)

Failure = tuple[str, str] | None
"""How a section ended early: (status for its unreported checks, why), or None when it ran to its end."""


def _grace(limit_s: float) -> float:
    """Seconds an isolated section stops before its hard limit, to report its timeout itself."""
    return min(10.0, 0.1 * limit_s)


def planned(section: Section, options: Options) -> list[str]:
    """The checks ``section`` reports with these options."""
    return list(section.function("plan")(options))


def complete(section: str, checks: Sequence[str], got: Sequence[Row], failure: Failure) -> list[Row]:
    """The planned checks in order, each the row the section reported or one saying why there is none; then
    any row the section reported that was not planned."""
    reported: dict[str, Row] = {}
    for row in got:
        reported.setdefault(row.check, row)
    if failure is None:
        status, why = "error", "the section ended without reporting this check"
    else:
        status, why = failure[0], f"not run: {failure[1]}"
    rows = [reported[c] if c in reported else Row(section, c, status, note=why) for c in checks]  # type: ignore[arg-type]
    known = set(checks)
    return rows + [r for r in got if r.check not in known]


def _in_process(section: Section, options: Options, deadline: float) -> tuple[list[Row], Failure]:
    rows: list[Row] = []
    ctx = Context(options, section.name, deadline, rows.append)
    try:
        section.function("run")(ctx)
    except SectionTimeout as err:
        return rows, ("timeout", str(err))
    except Exception as err:
        return rows, ("error", f"the section stopped: {describe(err)}")
    return rows, None


def _child(section: Section, options: Options, deadline: float, out: Any) -> None:
    """Entry point of an isolated section's process: rows as ("row", dict), then ("end", failure), each sent at
    once through the pipe ``out`` (so a row survives a crash right after it)."""
    ctx = Context(options, section.name, deadline, lambda row: out.send(("row", row.to_dict())))
    end: Failure = None
    try:
        section.function("run")(ctx)
    except SectionTimeout as err:
        end = ("timeout", str(err))
    except BaseException as err:
        end = ("error", f"the section stopped: {describe(err)}")
    out.send(("end", end))
    out.close()


def _isolated(section: Section, options: Options, deadline: float, limit_s: float) -> tuple[list[Row], Failure]:
    mp = multiprocessing.get_context("spawn")
    receive, send = mp.Pipe(duplex=False)
    soft = deadline - _grace(limit_s)
    # Not a daemon: a section may start processes of its own (a daemon may not); killed below if it outlives us.
    proc = mp.Process(target=_child, args=(section, options, soft, send))
    proc.start()
    send.close()  # the child holds the only writing end: its exit ends the stream
    rows: list[Row] = []
    try:
        while True:
            if not receive.poll(max(0.0, min(0.5, deadline - time.monotonic()))):
                if time.monotonic() < deadline:
                    continue
                proc.kill()
                failure: Failure = ("timeout", f"killed at its {limit_s:.0f} s limit")
                break
            try:
                kind, payload = receive.recv()
            except EOFError:  # the child ended without its final report
                proc.join(timeout=10)
                failure = ("error", f"the section's process died (exit code {proc.exitcode})")
                break
            if kind == "end":
                failure = payload
                break
            rows.append(Row.from_dict(payload))
        proc.join(timeout=10)  # it has reported its end; threads it left running get 10 s, then it is killed
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        receive.close()
    return rows, failure


def run_sections(
    sections: Sequence[Section],
    options: Options,
    budget_s: float,
    isolate: bool,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Every section in order within ``budget_s`` seconds in all; returns every row (see the module docstring)."""
    start = time.monotonic()
    rows: list[Row] = []
    for i, section in enumerate(sections):
        checks = planned(section, options)
        left = budget_s - (time.monotonic() - start)
        limit = left * section.share / sum(s.share for s in sections[i:])
        if limit <= 1.0:
            rows += complete(section.name, checks, [], ("timeout", "no time left in --budget-s"))
            continue
        log(f"section {section.name}: {len(checks)} checks, limit {limit:.0f} s ({left:.0f} s of the budget left)")
        began = time.monotonic()
        deadline = began + limit
        if isolate:
            got, failure = _isolated(section, options, deadline, limit)
        else:
            got, failure = _in_process(section, options, deadline)
        done = complete(section.name, checks, got, failure)
        passed = sum(r.status == "pass" for r in done)
        log(f"section {section.name}: {passed}/{len(done)} passed in {time.monotonic() - began:.0f} s")
        rows += done
    return rows
