"""Consolidating a ZeRO-3 checkpoint stored on a real S3-compatible server: only the files consolidation reads are
downloaded, into the configured folder, after a free-disk check; the output equals consolidation of the local folder.

The checkpoint is real: a one-rank DeepSpeed ZeRO-3 engine around the distilled module (student + router) writes
its shards with :func:`ckpt.save_checkpoint`, and the folder is published to S3 as Ray Train stores it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from components.distill import ckpt
from components.distill.config import DistillConfig
from components.distill.worker import build_engine, build_student
from components.storage import publish
from model.checkpoint import read_config
from tests.helpers import save_tiny_parent

pytestmark = pytest.mark.integration


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def zero3_checkpoint(single_process_group, tmp_path_factory) -> Path:
    """A Ray Train checkpoint folder written by a one-rank ZeRO-3 engine: state.json and DeepSpeed's shards."""
    root = tmp_path_factory.mktemp("z3ckpt")
    parent = save_tiny_parent(root)
    config = read_config(parent)[0]
    cfg = DistillConfig(
        teacher_uri=str(parent), output_dir=str(root / "out"), space={"hidden": [32, 16]},
        budgets=[{"name": "full", "fraction": 1.0}], zero_stage=3, num_workers=1,
    )  # fmt: skip
    engine, _ = build_engine(cfg, build_student(cfg, config, parent, torch.device("cpu"), 1), 1, config)
    folder = root / "checkpoint"
    ckpt.save_checkpoint(engine, folder, 0, ckpt.TrainState(next_step=1, world_size=1, zero_stage=3))
    (folder / "unrelated.bin").write_bytes(b"\x07" * 1000)  # a file consolidation never reads
    return folder


def test_consolidation_from_s3_fetches_its_files_only_and_checks_the_disk(s3_server, zero3_checkpoint, tmp_path):
    from ray.train import Checkpoint

    uri = "s3://test-bucket/consolidate/checkpoint_000001"
    publish(zero3_checkpoint, uri)
    path, fs = ckpt.storage_target(uri)
    remote = Checkpoint(path=path, filesystem=fs)
    needs = lambda relative: ckpt.consolidation_needs(relative, 3)  # noqa: E731
    wanted = {
        "state.json",
        "deepspeed/zero/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "deepspeed/zero/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    }
    local = _files(zero3_checkpoint)
    assert wanted < set(local)  # the shard writer's file names, as consolidation_needs expects them
    needed = sum(len(local[name]) for name in wanted)

    # not enough room: the error names the size and the setting, and nothing is downloaded
    scratch = tmp_path / "scratch"
    too_full = ckpt.fetch(remote, needs, scratch, "distill_phase1.consolidation_dir", headroom=1 << 60)
    with pytest.raises(OSError, match=rf"needs [0-9.]+ GiB \({needed} bytes\).*consolidation_dir"), too_full:
        pass
    assert list(scratch.iterdir()) == []

    # enough room: exactly the files consolidation reads, downloaded under the configured folder, then removed
    with ckpt.fetch(remote, needs, scratch, "distill_phase1.consolidation_dir") as folder:
        assert folder.parent == scratch
        assert _files(folder) == {name: local[name] for name in wanted}
        (tmp_path / "s3").mkdir()
        ckpt.consolidate(folder, tmp_path / "s3", tmp_path / "s3" / "router.safetensors", torch.float32)
    assert list(scratch.iterdir()) == []
    (tmp_path / "local").mkdir()
    ckpt.consolidate(zero3_checkpoint, tmp_path / "local", tmp_path / "local" / "router.safetensors", torch.float32)
    for name in ("model", "router"):
        s3, local = tmp_path / "s3" / f"{name}.safetensors", tmp_path / "local" / f"{name}.safetensors"
        assert s3.read_bytes() == local.read_bytes()
    assert os.path.getsize(tmp_path / "local" / "model.safetensors") > 0
