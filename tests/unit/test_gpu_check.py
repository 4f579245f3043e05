"""``benchmarks/gpu_check.py`` on a CPU: its ``--device cpu --quick`` run reports every check and the CPU rows pass;
the runner keeps a section's rows when it fails, times out, crashes or hangs, and goes on with the next; the
captured-decode comparison flags a step that replays frozen host values, as a CUDA graph does.

This module imports nothing heavy at its top: the isolated sections below run in child processes that import it.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from benchmarks.gpu.common import Context, Options, describe
from benchmarks.gpu.runner import SECTIONS, Section, planned, run_sections


# ---------------------------------------------------------------------- sections for the runner tests
def two_plan(options: Options) -> list[str]:
    return ["first", "second"]


def one_plan(options: Options) -> list[str]:
    return ["only"]


def broken_run(ctx: Context) -> None:
    ctx.row("first", "pass", value=1)
    raise KeyError("the second check cannot start")


def slow_run(ctx: Context) -> None:
    ctx.row("first", "pass")
    while True:  # polite: checks its deadline
        ctx.check_time("the second check")
        time.sleep(0.02)


def ok_run(ctx: Context) -> None:
    ctx.row("only", "pass", seconds=0.0)


def crash_run(ctx: Context) -> None:
    ctx.row("first", "pass")
    os._exit(3)


def hang_run(ctx: Context) -> None:
    ctx.row("first", "pass")
    time.sleep(600)  # never looks at its deadline


def _section(name: str, run: str, plan: str = "two_plan") -> Section:
    return Section(name, 1.0, __name__, plan, run)


# ---------------------------------------------------------------------- the CPU smoke run
def test_cpu_quick_run_reports_every_check_and_the_cpu_rows_pass(tmp_path: Path, capsys):
    from benchmarks.gpu_check import main

    out = tmp_path / "gpu_check.json"
    code = main(["--device", "cpu", "--quick", "--json", str(out), "--workdir", str(tmp_path / "work")])
    data = json.loads(out.read_text())
    rows = data["rows"]
    options = Options("cpu", True, str(tmp_path))
    by_section = {s.name: [r["check"] for r in rows if r["section"] == s.name] for s in SECTIONS}
    assert by_section == {s.name: planned(s, options) for s in SECTIONS}  # every check, in order, nothing else
    checks = {r["check"]: r for r in rows}
    for name in ("eager full b1", "eager small b64", "captured medium b16", "ZeRO-3 distillation step gloo world 1",
                 "evaluate on cpu", "serve load on cpu", "serve chat small on cpu"):  # fmt: skip
        assert name in checks
    kernels = [r for r in rows if r["section"] == "kernels"]
    assert kernels and all(r["status"] == "skip" and r["note"] == "no CUDA" for r in kernels)
    failed = [(r["check"], r["status"], r["note"]) for r in rows if r["section"] != "kernels" and r["status"] != "pass"]
    assert failed == []
    assert code == 0 and data["passed"] is True
    for r in rows:
        if r["check"].startswith("eager "):
            assert r["figures"]["tok_s"] > 0
        if r["check"].startswith("captured "):
            f = r["figures"]
            assert f["tokens_equal"] is True and f["state_max_rel_err"] == 0.0 and f["graph"] is False
    step = checks["ZeRO-3 distillation step gloo world 1"]["figures"]
    assert step["backend"] == "gloo" and math.isfinite(step["kd"]) and step["step_s"] > 0
    assert checks["evaluate on cpu"]["figures"]["device"] == "cpu"
    assert checks["serve chat full on cpu"]["figures"]["completion_tokens"] > 0
    printed = capsys.readouterr().out
    assert "| section | check" in printed and "captured small b64" in printed


# ---------------------------------------------------------------------- the runner
def test_a_failing_or_slow_section_keeps_its_rows_and_the_next_one_runs(tmp_path: Path):
    options = Options("cpu", True, str(tmp_path))
    ok = Section("ok", 1.0, __name__, "one_plan", "ok_run")
    sections = [_section("broken", "broken_run"), _section("slow", "slow_run"), ok]
    start = time.monotonic()
    rows = run_sections(sections, options, budget_s=6.0, isolate=False, log=lambda message: None)
    assert time.monotonic() - start < 10.0
    got = {(r.section, r.check): r for r in rows}
    assert [(r.section, r.check) for r in rows] == [("broken", "first"), ("broken", "second"), ("slow", "first"),
                                                   ("slow", "second"), ("ok", "only")]  # fmt: skip
    assert got["broken", "first"].status == "pass" and got["broken", "first"].figures == {"value": 1}
    second = got["broken", "second"]
    assert second.status == "error" and "KeyError: 'the second check cannot start'" in second.note
    assert got["slow", "first"].status == "pass"
    assert got["slow", "second"].status == "timeout" and "before the second check" in got["slow", "second"].note
    assert got["ok", "only"].status == "pass"


def test_an_isolated_section_that_crashes_or_hangs_costs_only_itself(tmp_path: Path):
    options = Options("cpu", True, str(tmp_path))
    hang = Section("hang", 1.0, __name__, "two_plan", "hang_run")  # 3 s of the 12
    crash = Section("crash", 3.0, __name__, "two_plan", "crash_run")  # the rest: ample time to start and crash
    start = time.monotonic()
    rows = run_sections([hang, crash], options, budget_s=12.0, isolate=True, log=lambda message: None)
    assert time.monotonic() - start < 30.0  # the hanging child is killed at its limit, not waited for
    got = {(r.section, r.check): r for r in rows}
    assert got["crash", "first"].status == "pass"  # reported before the crash, kept
    assert got["crash", "second"].status == "error" and "exit code 3" in got["crash", "second"].note
    assert got["hang", "second"].status == "timeout" and "killed at its" in got["hang", "second"].note


def test_describe_names_the_first_error_and_where_the_project_raised_it():
    import torch

    from model.ssd import ssd_step

    try:
        ssd_step(torch.zeros(1, 2, 4, 8), torch.zeros(1, 3, 4), torch.ones(1, 3), -torch.ones(3),
                 torch.zeros(1, 1, 8), torch.zeros(1, 1, 8))  # fmt: skip
    except ValueError as err:
        text = describe(err)
    assert text.startswith("ValueError: state must have shape") and "model/ssd.py:" in text
    assert "in _check_step_inputs" in text
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        except RuntimeError:
            raise ValueError("capture ended badly")  # noqa: B904 - the implicit chain is what is described
    except ValueError as err:
        chained = describe(err)
    assert (
        chained
        == "ValueError: capture ended badly [first: RuntimeError: operation not permitted when stream is capturing]"
    )


# ---------------------------------------------------------------------- the captured-decode comparison
def test_a_step_replaying_frozen_host_values_is_flagged_by_the_state_comparison():
    """What a CUDA graph of the decode step does (every replay writes the KV slot and attends the length of its
    capture) must fail the comparison even where the greedy tokens happen to agree."""
    import torch

    from benchmarks.gpu.decode import STATE_TOLERANCE
    from benchmarks.gpu.graphs import StaticStep, compare_states
    from model.cache import clone_cache
    from model.config import HybridConfig
    from model.hybrid import HybridLM
    from tests.conftest import TINY

    model = HybridLM(HybridConfig(**TINY)).init_weights(0).eval()
    with torch.no_grad():
        res = model(torch.arange(8)[None] % TINY["vocab_size"], use_cache=True, logits_to_keep=1)
        tok = res.logits[:, -1].argmax(-1, keepdim=True)
        eager, t = clone_cache(res.cache), tok
        for _ in range(3):
            t = model(t, cache=eager).logits[:, -1].argmax(-1, keepdim=True)
        honest = StaticStep(model, clone_cache(res.cache), tok, capture=False)
        frozen = StaticStep(model, clone_cache(res.cache), tok, capture=False)
        for _ in range(3):
            honest()
            frozen._step(advance_host=False)  # host values of the first step, as a graph replays them
    assert compare_states(eager, honest.cache).max_rel_err == 0.0
    diff = compare_states(eager, frozen.cache)
    assert diff.max_rel_err > 100 * STATE_TOLERANCE["float32"], diff
