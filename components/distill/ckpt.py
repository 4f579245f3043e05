"""Checkpoints of a distillation run: what one Ray Train checkpoint holds, and how it is read back.

Layout of one checkpoint folder (the merge of every rank's folder; Ray Train merges them)::

    student.safetensors     rank 0: the student HybridLM state dict (float32, canonical keys)
    router.safetensors      rank 0: the BudgetRouter state dict
    state.json              rank 0: next step, attempt, tokens seen, world size, logged history
    optim/rank<r>.pt        every rank r: its (ZeRO-partitioned) optimizer state

Design choices:

* Weights are safetensors, never pickles. The optimizer state has to be a ``torch.save`` file
  (DeepSpeed's ZeRO optimizers return nested dicts), but it is stripped to tensors and plain
  Python values before saving (:func:`safe_tree`) so that it loads with
  ``torch.load(weights_only=True)``: a checkpoint in shared storage can never run code on load.
  The stripped entries (DeepSpeed's loss scaler object, enum tags, slice-mapping records) are
  rebuilt by the live optimizer: on load, the saved tree is merged INTO the live optimizer's own
  ``state_dict()`` (:func:`merge_tree`) and that complete dict is what DeepSpeed loads.
* ZeRO stages 1 and 2 partition the optimizer state by data-parallel rank, so each rank saves and
  loads its own file; a resume with a different world size restores weights and step but restarts
  the optimizer moments (with a warning), rather than loading partitions that do not line up.
* Under ZeRO-3 the parameters themselves are partitioned: :func:`gathered` materialises them for a
  block of code (a collective: every rank must enter it).
* There is no RNG state to keep: the data batch, the budget draw and the router noise of a step
  are all derived from ``(seed, phase, step)``, so the step counter IS the data position.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field
from safetensors.torch import load_file, save_file
from torch import nn

STUDENT_FILE = "student.safetensors"
ROUTER_FILE = "router.safetensors"
STATE_FILE = "state.json"
OPTIM_DIR = "optim"

_PLAIN = (int, float, bool, str, type(None))


class TrainState(BaseModel):
    """Progress of a run, saved by rank 0 in ``state.json``."""

    next_step: int = Field(0, description="First step still to run (= steps completed).")
    attempt: int = Field(0, description="0 for the first start; +1 on every resume from a checkpoint.")
    tokens_seen: int = Field(0, description="Tokens (all workers) processed up to next_step.")
    train_seconds: float = Field(0.0, description="Wall time spent in the training loop, all attempts.")
    world_size: int = Field(1, description="Data-parallel ranks that wrote the optimizer shards.")
    zero_stage: int = Field(0, description="ZeRO stage of the optimizer shards.")
    phase: int = Field(1, description="Distillation phase.")
    history: list[dict[str, Any]] = Field(default_factory=list, description="Logged rows up to next_step.")


# ---------------------------------------------------------------------- safe pickles
def safe_tree(obj: Any) -> Any:
    """Keep only what ``torch.load(weights_only=True)`` accepts: tensors, plain scalars, str, None,
    and dicts / lists / tuples of those. Anything else is dropped (``_DROP``); a list or tuple that
    would lose an element is dropped whole, so positions never shift."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if type(obj) in _PLAIN:  # exact types: an IntEnum is an int subclass and would not load
        return obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if type(k) not in _PLAIN:
                continue
            kept = safe_tree(v)
            if kept is not _DROP:
                out[k] = kept
        return out
    if isinstance(obj, list | tuple):
        items = [safe_tree(v) for v in obj]
        if any(v is _DROP for v in items):
            return _DROP
        return items if isinstance(obj, list) else tuple(items)
    return _DROP


class _Dropped:
    def __repr__(self) -> str:
        return "<dropped>"


_DROP = _Dropped()


def merge_tree(live: Any, saved: Any) -> Any:
    """``saved`` laid over ``live``: dicts merge key by key, anything else is taken from ``saved``."""
    if isinstance(live, dict) and isinstance(saved, dict):
        out = dict(live)
        for k, v in saved.items():
            out[k] = merge_tree(live[k], v) if k in live else v
        return out
    return saved


# ---------------------------------------------------------------------- ZeRO-3 gathering
@contextlib.contextmanager
def gathered(module: nn.Module, zero_stage: int) -> Iterator[None]:
    """Full parameters of ``module`` inside the block under ZeRO-3 (collective); a no-op otherwise."""
    if zero_stage < 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """float32 CPU copies of a state dict (floating tensors upcast; bf16 training saves fp32 weights)."""
    return {
        k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous().clone()
        for k, v in module.state_dict().items()
    }


# ---------------------------------------------------------------------- save
def save_checkpoint(
    folder: Path,
    rank: int,
    state: TrainState,
    student: dict[str, torch.Tensor] | None,
    router: dict[str, torch.Tensor] | None,
    optimizer: Any,
) -> None:
    """Write this rank's part of a checkpoint into ``folder`` (rank 0 adds weights and state)."""
    folder = Path(folder)
    (folder / OPTIM_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(safe_tree(optimizer.state_dict()), folder / OPTIM_DIR / f"rank{rank}.pt")
    if rank != 0:
        return
    if student is None or router is None:
        raise ValueError("rank 0 must save the student and router weights")
    save_file(student, str(folder / STUDENT_FILE), metadata={"format": "pt"})
    save_file(router, str(folder / ROUTER_FILE), metadata={"format": "pt"})
    tmp = folder / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state.model_dump(), indent=1))
    os.replace(tmp, folder / STATE_FILE)


# ---------------------------------------------------------------------- load
def read_state(folder: Path) -> TrainState:
    """``state.json`` of a checkpoint folder."""
    return TrainState.model_validate_json((Path(folder) / STATE_FILE).read_text())


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(student state dict, router state dict) of a checkpoint folder."""
    folder = Path(folder)
    return load_file(str(folder / STUDENT_FILE)), load_file(str(folder / ROUTER_FILE))


def read_optimizer(folder: Path, rank: int) -> dict[str, Any] | None:
    """This rank's saved optimizer tree (loaded with ``weights_only=True``), or None if absent."""
    path = Path(folder) / OPTIM_DIR / f"rank{rank}.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def load_optimizer(optimizer: Any, saved: dict[str, Any], world_size: int) -> None:
    """Load a tree from :func:`read_optimizer` into a live torch or DeepSpeed optimizer.

    torch optimizers and DeepSpeed's unfused bf16 wrapper (ZeRO-0) take one dict; DeepSpeed's ZeRO
    optimizers take a list indexed by data-parallel rank (each rank reads its own entry) and restore
    their fp32 master weights from it (``load_from_fp32_weights``), so bf16 training resumes without
    a precision loss.
    """
    merged = merge_tree(optimizer.state_dict(), saved)
    params = inspect.signature(optimizer.load_state_dict).parameters
    if isinstance(optimizer, torch.optim.Optimizer) or "load_from_fp32_weights" not in params:
        optimizer.load_state_dict(merged)  # torch optimizers, DeepSpeed's unfused bf16/fp16 wrapper (ZeRO-0)
    else:
        optimizer.load_state_dict([merged] * world_size, load_optimizer_states=True, load_from_fp32_weights=True)


@dataclass
class Restored:
    """Everything one rank needs from a checkpoint, read into memory (the folder may be temporary)."""

    state: TrainState
    student: dict[str, torch.Tensor]
    router: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


def read_checkpoint(folder: Path, rank: int) -> Restored:
    """Read state, weights and this rank's optimizer shard of a checkpoint folder."""
    student, router = read_weights(folder)
    return Restored(read_state(folder), student, router, read_optimizer(folder, rank))


def restore_optimizer(optimizer: Any, restored: Restored, rank: int, world_size: int, zero_stage: int) -> bool:
    """Restore this rank's optimizer shard when the layout matches; warn and keep fresh moments otherwise."""
    state = restored.state
    if state.world_size != world_size or state.zero_stage != zero_stage:
        warnings.warn(
            f"checkpoint optimizer shards were written by {state.world_size} ranks at ZeRO-{state.zero_stage}; "
            f"this run has {world_size} ranks at ZeRO-{zero_stage}: weights and step are restored, the optimizer "
            "moments restart",
            stacklevel=2,
        )
        return False
    if restored.optimizer is None:
        warnings.warn(f"the checkpoint has no optimizer shard for rank {rank}; moments restart", stacklevel=2)
        return False
    load_optimizer(optimizer, restored.optimizer, world_size)
    return True


# ---------------------------------------------------------------------- storage
def storage_target(uri: str) -> tuple[str, Any]:
    """``(storage_path, storage_filesystem)`` for Ray Train's ``RunConfig``.

    Local paths pass through (made absolute). ``s3://bucket/prefix`` gets a pyarrow
    ``S3FileSystem`` built from the standard AWS variables plus ``AWS_ENDPOINT_URL(_S3)`` (needed for
    S3-compatible servers, which pyarrow does not read by itself), and the path loses its scheme, as
    Ray expects when a filesystem is given. The filesystem (credentials included) is pickled to the
    Ray Train controller and workers.

    S3-compatible servers: the AWS C++ SDK inside pyarrow sends checksummed ``aws-chunked`` uploads by
    default, which some servers (SeaweedFS, older MinIO / Ceph) reject or store verbatim. Set
    ``AWS_REQUEST_CHECKSUM_CALCULATION=when_required`` in the environment the Ray cluster starts with;
    this function sets it (if unset) for the driver process, which reads the final checkpoint.
    """
    if not uri.startswith("s3://"):
        return str(Path(uri).expanduser().resolve()), None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return uri, None  # real AWS: Ray resolves s3:// itself from the environment
    os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    from urllib.parse import urlparse

    import pyarrow.fs

    parsed = urlparse(endpoint)
    fs = pyarrow.fs.S3FileSystem(
        access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        region=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
        endpoint_override=parsed.netloc or endpoint,
        scheme=parsed.scheme or "https",
    )
    return uri[len("s3://") :], fs
