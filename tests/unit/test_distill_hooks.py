"""The distillation worker's hooks: the per-step callback a config names (the fault tests' way into the loop)
and the host-heap settings a CPU worker applies to itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from components.distill.config import DistillConfig, preflight, resolve_step_callback
from tests.integration import distill_faults

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **changes) -> DistillConfig:
    base = dict(teacher_uri=str(tmp_path / "parent"), output_dir=str(tmp_path / "out"), space={"hidden": [32, 16]},
                budgets=[{"name": "full", "fraction": 1.0}])  # fmt: skip
    return DistillConfig(**{**base, **changes})


def test_step_callback_names_an_importable_function(tmp_path):
    assert resolve_step_callback(None) is None
    assert resolve_step_callback(distill_faults.CALLBACK) is distill_faults.exit_last_rank_once
    with pytest.raises(ValueError, match="step_callback='tests.integration.distill_faults:nope'"):
        resolve_step_callback("tests.integration.distill_faults:nope")
    with pytest.raises(ValueError, match="step_callback='no_such_module_here:f'.*importable"):
        resolve_step_callback("no_such_module_here:f")
    with pytest.raises(ValueError, match="not callable"):
        resolve_step_callback("tests.integration.distill_faults:FAIL_AT_STEP")
    with pytest.raises(ValueError, match="step_callback"):
        _config(tmp_path, step_callback="tests.integration.distill_faults.exit_last_rank_once")  # no ':'
    # the driver's preflight refuses a callback the workers could not import, before anything else
    with pytest.raises(ValueError, match="no_such_module_here"):
        preflight(_config(tmp_path, step_callback="no_such_module_here:f"))
    # a callback does not change what is trained: the run key (and so the resumed run) stays the same
    assert _config(tmp_path).run_key() == _config(tmp_path, step_callback=distill_faults.CALLBACK).run_key()


def test_the_fault_callback_kills_the_last_rank_once(tmp_path):
    """In a child process: nothing happens on other steps or ranks; at the step on the last rank the process
    exits with status 1 and leaves its marker; called again (the restarted worker) it returns."""
    script = textwrap.dedent(f"""
        from components.distill.config import DistillConfig
        from tests.integration.distill_faults import FAIL_AT_STEP, exit_last_rank_once
        cfg = DistillConfig.model_validate_json({_config(tmp_path).model_dump_json()!r})
        exit_last_rank_once(cfg, FAIL_AT_STEP - 1, 1, 2)
        exit_last_rank_once(cfg, FAIL_AT_STEP, 0, 2)
        print("alive", flush=True)
        exit_last_rank_once(cfg, FAIL_AT_STEP, 1, 2)
        print("survived", flush=True)
    """)
    run = lambda: subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)  # noqa: E731
    first = run()
    assert first.returncode == 1 and "alive" in first.stdout and "survived" not in first.stdout, first.stderr
    assert (tmp_path / "out" / ".exit_last_rank_once.marker").read_text() == "rank 1 exited at step 4\n"
    second = run()
    assert second.returncode == 0 and "survived" in second.stdout, second.stderr
