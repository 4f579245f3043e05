"""Faults injected into the distillation workers through ``DistillConfig.step_callback`` (the training loop
itself carries no test code). Imported by the Ray Train workers: the repository root is on their path."""

from __future__ import annotations

import os
from pathlib import Path

from components.distill.config import DistillConfig

FAIL_AT_STEP = 4
"""Step index at which :func:`exit_last_rank_once` kills the last rank (after 4 steps)."""

CALLBACK = f"{__name__}:exit_last_rank_once"
"""The ``step_callback`` value that selects :func:`exit_last_rank_once`."""


def exit_last_rank_once(config: DistillConfig, step: int, rank: int, world: int) -> None:
    """The last rank kills its own process (no cleanup, as a lost node would) at step ``FAIL_AT_STEP`` of
    the first attempt; a marker file in ``output_dir`` keeps the restarted worker group alive."""
    if step != FAIL_AT_STEP or rank != world - 1:
        return
    marker = Path(config.output_dir) / ".exit_last_rank_once.marker"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} exited at step {step}\n")
    print(f"[distill test] rank {rank} exits at step {step}", flush=True)
    os._exit(1)
