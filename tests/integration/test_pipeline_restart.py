"""The whole pipeline SIGKILLed mid-distillation and started again, as a RayJob restart or a lost head node would.

``star-elastic run`` runs the demo up to its export, with a short phase 1, in its own process group,
tracked on a real MLflow server. Once phase 1 has committed its second checkpoint the whole group
(driver, Ray, the workers) is killed with SIGKILL. The same command again must skip the finished
stages, resume phase 1 from its newest checkpoint (its log says from which step), and end with a
nested checkpoint equal to that of an uninterrupted run of the same config within the tolerance the
ZeRO-0 / ZeRO-3 equivalence test allows; no MLflow run may be left RUNNING, and the new parent run
names the one it resumes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO = Path(__file__).resolve().parents[2] / "pipelines" / "configs" / "demo.yaml"
PHASE1_STEPS = 16
CHECKPOINT_EVERY = 4
SHORT = [
    "rank.calibration.num_samples=16",
    "rank.calibration.batch_size=8",
    "rank.num_tasks=1",
    f"distill_phase1.steps={PHASE1_STEPS}",
    "distill_phase1.micro_batch_size=4",
    f"distill_phase1.checkpoint_every={CHECKPOINT_EVERY}",
    "distill_phase1.log_every=2",
    "distill_phase2.steps=2",
    "distill_phase2.micro_batch_size=2",
    "distill_phase2.checkpoint_every=2",
    "distill_phase2.log_every=1",
]
UP_TO_EXPORT = ("parent", "rank", "distill_phase1", "distill_phase2", "export")
COMMITTED_TWICE = re.compile(rf"\[distill p1\] step (\d+)/{PHASE1_STEPS}")  # logged after the step-8 commit
RESUMED = re.compile(r"\[distill p1\] attempt \d+: resumed at step (\d+)")
TIMEOUT_S = 900


def command(runs: Path, tracking_uri: str) -> list[str]:
    sets = [*SHORT, f"runs_dir={runs}", f"tracking_uri={tracking_uri}"]
    only = [a for stage in UP_TO_EXPORT for a in ("--only", stage)]  # evaluate, quantize, register add nothing here
    return [sys.executable, "-m", "pipelines.cli", "run", str(DEMO), *only, *[a for s in sets for a in ("--set", s)]]


def environment() -> dict[str, str]:
    # a progress line at every step (not every few seconds): the kill follows the steps
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STAR_ELASTIC_PROGRESS_INTERVAL_S": "0"}
    env.pop("RAY_ADDRESS", None)  # each run starts (and, when killed, loses) its own local Ray
    return env


def run_to_end(runs: Path, tracking_uri: str, log: Path) -> str:
    """Run the pipeline to its end; returns its output (the test fails with the log's tail otherwise)."""
    with log.open("w") as fh:
        proc = subprocess.run(command(runs, tracking_uri), stdout=fh, stderr=subprocess.STDOUT, env=environment(),
                              timeout=TIMEOUT_S, cwd=DEMO.parents[2])  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def run_and_kill(runs: Path, tracking_uri: str, log: Path) -> int:
    """Start the pipeline in its own process group and SIGKILL the group (and anything that left it) once
    phase 1 logs a step past its second checkpoint. Returns the step that line reported."""
    import psutil

    fh = log.open("w")
    proc = subprocess.Popen(command(runs, tracking_uri), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=environment(), cwd=DEMO.parents[2], start_new_session=True, text=True)  # fmt: skip
    seen: list[int] = []
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            fh.write(line)
            fh.flush()
            match = COMMITTED_TWICE.search(line)
            if match and int(match.group(1)) > 2 * CHECKPOINT_EVERY:
                seen.append(int(match.group(1)))
                done.set()
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert done.wait(TIMEOUT_S) and seen, (
            f"phase 1 never passed step {2 * CHECKPOINT_EVERY}:\n" + log.read_text()[-4000:]
        )
        family = psutil.Process(proc.pid).children(recursive=True)  # Ray's daemons may start their own sessions
        os.killpg(proc.pid, signal.SIGKILL)
        for child in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(30)
        fh.close()
    assert proc.returncode == -signal.SIGKILL
    return seen[0]


def nested_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from model.checkpoint import iter_tensors

    folder = run_dir / "export" / "nested"
    return dict(iter_tensors(folder))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mlflow_server):
    root = tmp_path_factory.mktemp("restart")
    killed_at = run_and_kill(root / "killed", mlflow_server, root / "first.log")
    rerun = run_to_end(root / "killed", mlflow_server, root / "rerun.log")
    straight = run_to_end(root / "straight", mlflow_server, root / "straight.log")
    return {"root": root, "killed_at": killed_at, "rerun": rerun, "straight": straight, "uri": mlflow_server}


def test_rerun_skips_finished_stages_and_resumes_phase_1_from_its_checkpoint(runs):
    rerun = runs["rerun"]
    resumed = [int(m) for m in RESUMED.findall(rerun)]
    assert resumed, "phase 1 did not resume:\n" + rerun[-4000:]
    step = resumed[0]
    # the newest committed checkpoint: the second one (step 8) or one the run committed before the kill landed
    assert 2 * CHECKPOINT_EVERY <= step <= runs["killed_at"] + CHECKPOINT_EVERY and step % CHECKPOINT_EVERY == 0
    assert "resuming the interrupted attempt (kept checkpoints)" in rerun
    first_logged = [int(m) for m in COMMITTED_TWICE.findall(rerun)]
    assert first_logged and min(first_logged) > step  # no step before the checkpoint was trained again
    assert re.search(r"\] rank: cached", rerun), "the finished rank stage ran again"


def test_resumed_family_equals_an_uninterrupted_one(runs):
    got = nested_weights(runs["root"] / "killed" / "demo")
    want = nested_weights(runs["root"] / "straight" / "demo")
    assert got.keys() == want.keys()
    for key in want:  # the tolerance of the ZeRO-0 / ZeRO-3 equivalence test (tests/integration/test_distill.py)
        torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=2e-5, msg=key)


def test_no_mlflow_run_is_left_running_and_the_rerun_names_the_one_it_resumes(runs):
    from mlflow import MlflowClient

    client = MlflowClient(runs["uri"])
    experiment = client.get_experiment_by_name("star-elastic")
    every = client.search_runs([experiment.experiment_id], max_results=1000)
    assert every and not [r.info.run_name for r in every if r.info.status == "RUNNING"]
    interrupted = [r for r in every if r.data.tags.get("interrupted")]
    assert interrupted and all(r.info.status == "FAILED" for r in interrupted)
    resuming = [r for r in every if r.data.tags.get("resumes_run_id")]
    assert len(resuming) == 1
    assert resuming[0].data.tags["resumes_run_id"] in {r.info.run_id for r in interrupted}
