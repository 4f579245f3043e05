"""Progress on the console: plain lines (count, percent, rate, ETA) at a bounded interval off a terminal,
tqdm on one, Ray's bar in a worker whose driver draws on one, and the driver's heartbeat in silences."""

from __future__ import annotations

import io
import sys
import time

import pytest

from components import progress
from components.progress import LineProgress, format_seconds, progress_bar, stage_heartbeat


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def wait_for(condition, timeout: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (or ``timeout`` passes): what a thread writes arrives when it does."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_line_has_count_percent_rate_eta_and_the_postfix():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(400, "distill p1", "step", interval=8.0, stream=out, clock=clock, ticker=False)
    clock.now += 30.0
    bar.set_postfix({"loss": "0.2579", "tok/s": "12,803"})
    bar.update(120)  # 120 steps in 30 s: 4 steps/s, 280 left
    assert lines_of(out) == ["[distill p1] step 120/400 (30%), 4.0 steps/s, ETA 1m10s, loss=0.2579, tok/s=12,803"]
    clock.now += 70.0
    bar.update(280)
    bar.set_postfix()
    bar.close()
    bar.close()  # once only
    assert lines_of(out)[-1] == "[distill p1] step 400/400 (100%), 4.0 steps/s, done in 1m40s"
    assert len(lines_of(out)) == 3


def test_lines_come_at_most_and_at_least_once_per_interval_while_updates_flow():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(100, "evaluate", "run", interval=8.0, stream=out, clock=clock, ticker=False)
    written_at = []
    for _ in range(40):  # one run a second for 40 s
        clock.now += 1.0
        before = len(lines_of(out))
        bar.update(1)
        if len(lines_of(out)) > before:
            written_at.append(clock.now)
    gaps = [b - a for a, b in zip([100.0, *written_at], written_at, strict=False)]
    assert len(written_at) == 5 and all(gap == 8.0 for gap in gaps), written_at
    assert lines_of(out)[0] == "[evaluate] run 8/100 (8%), 1.0 runs/s, ETA 1m32s"


def test_a_resumed_run_counts_its_rate_from_here_and_slow_units_show_seconds_per_unit():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(6, "quantize", "step", initial=2, interval=8.0, stream=out, clock=clock, ticker=False)
    clock.now += 25.0
    bar.update(1)
    assert lines_of(out) == ["[quantize] step 3/6 (50%), 25.0 s/step, ETA 1m15s"]


def test_the_clock_thread_writes_a_line_when_one_unit_takes_longer_than_the_interval():
    out = io.StringIO()
    bar = LineProgress(10, "quantize", "step", interval=0.05, stream=out)
    try:
        assert wait_for(lambda: len(lines_of(out)) >= 2), "no line without an update"
    finally:
        bar.close()
    assert all(line.startswith("[quantize] step 0/10 (0%), ETA ?") for line in lines_of(out)[:-1])


def test_no_line_has_a_carriage_return_or_runs_past_300_characters():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(10**6, "distill p2", "step", interval=1.0, stream=out, clock=clock, ticker=False)
    for _ in range(50):
        clock.now += 1.0
        bar.set_postfix(loss="0.1234", kd="0.0211", budget="0.0258", tok_s="12,851")
        bar.update(997)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text and max(len(line) for line in text.splitlines()) <= 300


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0s"), (42, "42s"), (127, "2m07s"), (3720, "1h02m")])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_the_form_follows_where_the_output_goes(monkeypatch):
    from tqdm import tqdm

    terminal = progress_bar(3, "x", stream=FakeTerminal())
    assert isinstance(terminal, tqdm)
    terminal.close()
    plain = progress_bar(3, "x", stream=io.StringIO())
    assert isinstance(plain, LineProgress)
    plain.close()
    quiet = progress_bar(3, "x", disable=True)
    quiet.update(1)
    quiet.set_postfix(a=1)
    quiet.close()

    monkeypatch.setattr(progress, "in_ray_task", lambda: True)  # a Ray worker: its stdout is a log file
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    assert progress.console_form(FakeTerminal()) == "lines"
    monkeypatch.setenv(progress.PROGRESS_ENV, "bar")  # the driver draws on a terminal
    assert progress.console_form(io.StringIO()) == "ray"


def test_the_interval_can_be_set_from_the_environment(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")  # a line at every update
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(3, "distill p1", "step", stream=out, clock=clock)
    clock.now += 1.0
    bar.update(1)
    bar.update(1)
    bar.close()
    got = [line.split(", ")[0] for line in lines_of(out)]
    assert got == ["[distill p1] step 1/3 (33%)", "[distill p1] step 2/3 (66%)", "[distill p1] step 2/3 (66%)"]
    assert "done in" in lines_of(out)[-1]


def test_the_heartbeat_speaks_in_silences_and_puts_the_streams_back():
    said: list[str] = []
    stdout, stderr = sys.stdout, sys.stderr
    with stage_heartbeat("[7/8] quantize", said.append, silence=0.05):
        assert wait_for(lambda: len(said) >= 1)
        print("a stage's own line")  # passes through the watched stream
    assert sys.stdout is stdout and sys.stderr is stderr
    assert said[0].startswith("[7/8] quantize: still running, ")


def test_the_heartbeat_keeps_quiet_while_the_stage_writes():
    said: list[str] = []
    clock = FakeClock()
    with stage_heartbeat("[6/8] evaluate", said.append, silence=5.0, clock=clock):
        for _ in range(50):  # 50 fake seconds with a line each, over about one real second (two checks)
            clock.now += 1.0
            sys.stdout.write("[evaluate] run ...\n")
            time.sleep(0.02)
    assert said == []


def test_the_console_is_written_line_by_line_into_a_file(monkeypatch, tmp_path):
    with (tmp_path / "out.log").open("w") as out, (tmp_path / "err.log").open("w") as err:
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        assert not out.line_buffering
        progress.line_buffered_console()
        print("[3/8] distill_phase1: running")
        assert out.line_buffering and err.line_buffering
        assert (tmp_path / "out.log").read_text() == "[3/8] distill_phase1: running\n"  # before any flush or close
