"""What a person reads: ``star-elastic run`` on the demo (parent, rank and a short distillation phase, with
its Ray Train workers, DeepSpeed and MLflow) written to a file has no line over 300 characters, no carriage
return, no warning line, and the stages' progress as plain lines with rate and ETA."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO = Path(__file__).resolve().parents[2] / "pipelines" / "configs" / "demo.yaml"
STEPS = 24
SHORT = [
    "rank.calibration.num_samples=32",
    "rank.calibration.batch_size=8",
    f"distill_phase1.steps={STEPS}",
    "distill_phase1.micro_batch_size=4",
    f"distill_phase1.checkpoint_every={STEPS}",
    "distill_phase1.log_every=4",
]
NOISE = re.compile(r"warn|Setting accelerator|all_gather_into_tensor|PreemptionWatcher|Downloading artifacts", re.I)


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> str:
    runs = tmp_path_factory.mktemp("console")
    sets = [*SHORT, f"runs_dir={runs}", f"tracking_uri=sqlite:///{runs / 'mlflow.db'}"]
    only = [a for stage in ("parent", "rank", "distill_phase1") for a in ("--only", stage)]
    args = [sys.executable, "-m", "pipelines.cli", "run", str(DEMO), *only, *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "STAR_ELASTIC_PROGRESS_INTERVAL_S")}
    log = runs / "console.log"
    with log.open("w") as fh:  # a file, as `make run > log` writes: no terminal
        proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=900, cwd=DEMO.parents[2])
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def test_no_long_line_no_carriage_return_no_warning(console):
    lines = console.splitlines()
    assert "\r" not in console
    assert max(len(line) for line in lines) <= 300, max(lines, key=len)
    assert [line for line in lines if NOISE.search(line)] == []


def test_the_distillation_shows_plain_progress_lines_with_rate_and_its_end(console):
    done = re.findall(rf"\[distill p1\] step {STEPS}/{STEPS} \(100%\), [\d.]+ steps/s, done in \d+s, loss=", console)
    assert len(done) == 1, console[-4000:]
    assert "[3/8] distill_phase1: done in" in console
