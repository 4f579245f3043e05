"""Checkpoints of a distillation run: each rank's own shard in DeepSpeed's format, read back without pickles,
and consolidated into the phase output tensor by tensor.

Layout of one Ray Train checkpoint folder (the merge of every rank's folder; Ray Train merges them)::

    state.json                  rank 0: next step, attempt, tokens seen, world size, ZeRO stage, history
    deepspeed/zero/...          DeepSpeed's engine.save_checkpoint(tag="zero"), every rank its own files:
      zero_pp_rank_<r>_mp_rank_00_model_states.pt     ZeRO-3: buffers and parameter shapes (no weights)
      [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  ZeRO-1/2/3: rank r's float32 master partition and
                                                        Adam moments
      mp_rank_00_model_states.pt                        ZeRO-0/1/2: rank 0, the (replicated) weights
                                                        (ZeRO-0: and the optimizer)

Design choices:

* DeepSpeed's own format (``engine.save_checkpoint`` / ``load_checkpoint``): each rank writes only what
  it holds, nothing is gathered, and DeepSpeed restores its partitions and float32 master weights
  itself. A resume must use the world size and ZeRO stage that wrote the shards (checked first, with
  the fix in the message).
* No pickle runs code on load. DeepSpeed loads with ``weights_only=False``; the engine's checkpoint
  loader is replaced by :class:`SafeCheckpointEngine`, which loads with ``weights_only=True`` and allows
  exactly three DeepSpeed types the files contain (the loss scaler, the ZeRO stage enum and the
  fragment-address tuple), so a checkpoint in shared storage cannot run code in the workers.
* A resuming rank fetches only its own files (:func:`fetch`): on remote storage each worker would
  otherwise download every rank's optimizer shards.
* Consolidating a ZeRO-3 checkpoint from remote storage downloads every rank's optimizer file to one
  node: DeepSpeed writes a rank's float32 master partition and its two Adam moments into the same
  ``optim_states.pt`` file, so the weights cannot be fetched without the moments. That is about 12 bytes
  per trained parameter (31.6B parameters: ~380 GB), checked against the free disk before the download
  starts (:func:`check_free_disk`; ``DistillConfig.consolidation_dir`` moves the download folder), plus
  the consolidated output in ``output_dir`` (2 bytes per parameter in bf16, 4 in float32).
* Consolidation (:func:`consolidate`) is a separate step on the driver: it reads the shards memory-mapped
  and writes the student and router tensor by tensor (:func:`model.layout.write_weights`), one full tensor in
  memory at a time, in the training dtype (bf16 training writes bf16: phase 2 starts from exactly the
  weights phase 1 trained). ZeRO-3 tensors are rebuilt from every rank's float32 master partition (the
  layout DeepSpeed's ``zero_to_fp32`` reads; the tests compare with it); ZeRO-0/1/2 weights are the
  replicated ones rank 0 wrote.
* There is no RNG state to keep: the data batch, the budget draw and the router noise of a step are all
  derived from ``(seed, phase, step)``, so the step counter IS the data position.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from components.settings import S3Settings, from_environment

ROUTER_FILE = "router.safetensors"
STATE_FILE = "state.json"
DS_DIR = "deepspeed"
TAG = "zero"

_FP32_TENSORS = ("e_score_correction_bias",)


class TrainState(BaseModel):
    """Progress of a run, saved by rank 0 in ``state.json``."""

    next_step: int = Field(0, description="First step still to run (= steps completed).")
    attempt: int = Field(0, description="0 for the first start; +1 on every resume from a checkpoint.")
    tokens_seen: int = Field(0, description="Tokens (all workers) processed up to next_step.")
    train_seconds: float = Field(0.0, description="Wall time spent in the training loop, all attempts.")
    world_size: int = Field(1, description="Data-parallel ranks that wrote the shards.")
    zero_stage: int = Field(0, description="ZeRO stage of the shards.")
    phase: int = Field(1, description="Distillation phase.")
    history: list[dict[str, Any]] = Field(default_factory=list, description="Logged rows up to next_step.")


# ---------------------------------------------------------------------- loading without pickles
def _allowed_globals() -> list[Any]:
    """The non-tensor types DeepSpeed's checkpoint files contain (plain data, no code on load)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a DeepSpeed checkpoint file (see :func:`_allowed_globals`)."""
    with torch.serialization.safe_globals(_allowed_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


@functools.cache
def _safe_engine_class() -> type:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True``."""

        def load(self, path: str, map_location: Any = None) -> Any:  # noqa: D102 - see the class
            return safe_load(path, map_location=map_location)

    return SafeCheckpointEngine


def install_safe_loader(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` read files with ``weights_only=True`` (:func:`safe_load`)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = engine.checkpoint_engine
    if type(current) is _safe_engine_class():
        return
    if type(current) is not TorchCheckpointEngine:
        raise TypeError(
            f"the engine's checkpoint engine is {type(current).__name__}; distillation checkpoints need DeepSpeed's "
            "default torch checkpoint engine (remove 'checkpoint' engine settings from the DeepSpeed config)"
        )
    engine.checkpoint_engine = _safe_engine_class()(engine._config)


# ---------------------------------------------------------------------- save / load
def save_checkpoint(engine: Any, folder: Path, rank: int, state: TrainState) -> None:
    """Write this rank's shard of a checkpoint into ``folder`` (collective: every rank calls it).
    Rank 0 adds ``state.json``."""
    folder = Path(folder)
    engine.save_checkpoint(str(folder / DS_DIR), tag=TAG, save_latest=False)
    if rank == 0:
        tmp = folder / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state.model_dump(), indent=1))
        os.replace(tmp, folder / STATE_FILE)


def read_state(folder: Path) -> TrainState:
    """``state.json`` of a checkpoint folder."""
    return TrainState.model_validate_json((Path(folder) / STATE_FILE).read_text())


def load_checkpoint(engine: Any, folder: Path, world_size: int, zero_stage: int) -> TrainState:
    """Restore weights, float32 master weights and optimizer moments of this rank from ``folder``; returns the
    saved state. Raises ``ValueError`` when the shards were written by another world size or ZeRO stage."""
    state = read_state(folder)
    if (state.world_size, state.zero_stage) != (world_size, zero_stage):
        raise ValueError(
            f"{folder}: the checkpoint shards were written by {state.world_size} ranks at ZeRO-{state.zero_stage}; "
            f"this run has {world_size} ranks at ZeRO-{zero_stage}. Resume with num_workers={state.world_size} and "
            f"zero_stage={state.zero_stage}, or start a fresh run (another run_name) from the consolidated output"
        )
    install_safe_loader(engine)
    path, _ = engine.load_checkpoint(
        str(Path(folder) / DS_DIR), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint under {DS_DIR}/{TAG}")
    return state


def rank_needs(relative: str, rank: int) -> bool:
    """Whether rank ``rank`` reads the checkpoint file ``relative`` (a path inside the folder) to resume."""
    name = relative.rsplit("/", 1)[-1]
    return name == STATE_FILE or name.startswith("mp_rank_") or f"zero_pp_rank_{rank}_" in name


def consolidation_needs(relative: str, zero_stage: int) -> bool:
    """Whether :func:`consolidate` reads ``relative``: the state, the model-state files and, at ZeRO-3 only, the
    optimizer shards (their float32 master partitions are the weights)."""
    name = relative.rsplit("/", 1)[-1]
    optim = zero_stage == 3 and name.endswith("optim_states.pt")
    return name == STATE_FILE or name.endswith("_model_states.pt") or optim


FREE_DISK_HEADROOM = 1 << 30
"""Bytes :func:`fetch` leaves free on the download folder's disk beyond the files it downloads."""


def check_free_disk(folder: str | Path, needed: int, setting: str, headroom: int = FREE_DISK_HEADROOM) -> None:
    """Raise ``OSError`` naming ``needed`` and ``setting`` when ``folder``'s disk has less than ``needed +
    headroom`` bytes free (checked before a download starts, not half way through it)."""
    free = shutil.disk_usage(folder).free
    if needed + headroom > free:
        gib = 1 << 30
        raise OSError(
            f"{folder}: downloading the checkpoint files needs {needed / gib:.2f} GiB ({needed} bytes) plus "
            f"{headroom / gib:.2f} GiB headroom, but its disk has {free / gib:.2f} GiB free; point {setting} at a "
            "folder on a disk with that much space"
        )


@contextlib.contextmanager
def fetch(
    checkpoint: Any,
    wanted: Any,
    scratch: str | Path | None = None,
    setting: str = "TMPDIR",
    headroom: int = FREE_DISK_HEADROOM,
) -> Iterator[Path]:
    """A local folder holding the files of a Ray Train ``checkpoint`` for which ``wanted(relative_path)``.

    Local storage: the checkpoint's own folder (nothing copied). Remote storage (``s3://``): only the wanted
    files are downloaded, into a temporary folder under ``scratch`` (None: the system temporary folder)
    removed on exit. Their total size is read from the listing first: when the disk under ``scratch`` lacks
    it (plus ``headroom``), raises ``OSError`` naming the size and ``setting`` (the option that moves
    ``scratch``) before anything is downloaded.
    """
    import pyarrow.fs

    fs, root = checkpoint.filesystem, checkpoint.path
    if fs is None or isinstance(fs, pyarrow.fs.LocalFileSystem):
        yield Path(root)
        return
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    files = [(info, info.path[len(root.rstrip("/")) + 1 :]) for info in infos if info.type == pyarrow.fs.FileType.File]
    files = [(info, relative) for info, relative in files if wanted(relative)]
    if scratch is not None:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="distill-ckpt-", dir=scratch) as tmp:
        check_free_disk(tmp, sum(info.size for info, _ in files), setting, headroom)
        local = pyarrow.fs.LocalFileSystem()
        for info, relative in files:
            (Path(tmp) / relative).parent.mkdir(parents=True, exist_ok=True)
            pyarrow.fs.copy_files(info.path, str(Path(tmp) / relative), fs, local)
        yield Path(tmp)


# ---------------------------------------------------------------------- consolidation
def _zero_dir(folder: Path) -> Path:
    path = Path(folder) / DS_DIR / TAG
    if not path.is_dir():
        raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint under {DS_DIR}/{TAG}")
    return path


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def _as_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if not t.is_floating_point():
        return t.dtype
    return torch.float32 if name.endswith(_FP32_TENSORS) else dtype


def consolidated_tensors(
    folder: Path, dtype: torch.dtype
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Iterator[tuple[str, torch.Tensor]]]:
    """The full tensors of the trained module in a checkpoint folder, without loading it whole.

    Returns ``(entries, tensors)``: ``entries`` lists ``(name, shape, dtype)`` of every tensor in the order
    ``tensors`` yields them; ``tensors`` yields ``(name, tensor)`` one at a time (floating tensors in
    ``dtype``, the MoE router bias in float32). Names are the trained module's (``student.``, ``router.``).
    """
    zdir = _zero_dir(folder)
    optim = sorted(zdir.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank_of)
    z3_states = sorted(zdir.glob("zero_pp_rank_*_model_states.pt"), key=_rank_of)
    if not z3_states:  # ZeRO-0/1/2: rank 0 wrote the replicated weights
        module = safe_load(zdir / "mp_rank_00_model_states.pt", mmap=True)["module"]
        entries = [(n, tuple(t.shape), _as_dtype(n, t, dtype)) for n, t in module.items()]

        def replicated() -> Iterator[tuple[str, torch.Tensor]]:
            for name, shape, want in entries:
                yield name, module[name].to(want, copy=True).reshape(shape)

        return entries, replicated()

    head = safe_load(z3_states[0], mmap=True)
    shapes: dict[str, tuple[int, ...]] = {}
    for group in head["param_shapes"]:
        shapes.update({n: tuple(s) for n, s in group.items()})
    buffers = {n: head["module"][n] for n in head["buffer_names"]}
    world = len(optim)
    states = [safe_load(p, mmap=True)["optimizer_state_dict"] for p in optim]
    if [_rank_of(p) for p in optim] != list(range(world)) or states[0]["partition_count"] != world:
        raise ValueError(
            f"{zdir}: expected one optimizer shard per rank 0..{states[0]['partition_count'] - 1}, found "
            f"{[p.name for p in optim]}"
        )
    flats = [s["fp32_flat_groups"] for s in states]  # per rank: float32 master partitions, one per sub-group
    entries = [(n, s, _as_dtype(n, torch.empty(0), dtype)) for n, s in shapes.items()]
    entries += [(n, tuple(b.shape), _as_dtype(n, b, dtype)) for n, b in buffers.items()]

    def partitioned() -> Iterator[tuple[str, torch.Tensor]]:
        bounds = [0]
        for g in flats[0]:
            bounds.append(bounds[-1] + g.numel())
        offset = 0
        for name, shape in shapes.items():
            numel = 1
            for d in shape:
                numel *= d
            size = -(-numel // world)  # ceil: every rank's partition, zero-padded at the end
            pieces = []
            for groups in flats:  # rank by rank: this parameter's partition may straddle two sub-groups
                start, stop = offset, offset + size
                for gi, group in enumerate(groups):
                    lo, hi = max(start, bounds[gi]), min(stop, bounds[gi + 1])
                    if lo < hi:
                        pieces.append(group[lo - bounds[gi] : hi - bounds[gi]])
            full = torch.cat(pieces)[:numel]
            offset += size
            yield name, full.to(_as_dtype(name, full, dtype)).reshape(shape)
        if offset != bounds[-1]:
            raise ValueError(f"{zdir}: the parameter shapes use {offset} elements of {bounds[-1]} per rank")
        for name, b in buffers.items():
            yield name, b.to(_as_dtype(name, b, dtype), copy=True)

    return entries, partitioned()


def consolidate(
    folder: Path, weights_dir: Path, router: Path, dtype: torch.dtype, max_shard_size: int | str | None = None
) -> list[Path]:
    """Write the student into ``weights_dir`` in the published nemotron_h layout (:mod:`model.layout`:
    ``backbone.`` keys, one tensor per routed expert, sharded above ``max_shard_size``; None: transformers'
    default) and the router as ``router``, tensor by tensor (:func:`consolidated_tensors`). The router file
    is small and built in memory. Returns the weight files."""
    from safetensors.torch import save_file

    from model.layout import DEFAULT_MAX_SHARD_SIZE, write_weights

    entries, tensors = consolidated_tensors(Path(folder), dtype)
    prefix = "student."
    student_entries = [(n[len(prefix) :], s, d) for n, s, d in entries if n.startswith(prefix)]
    others = {n for n, _, _ in entries if not n.startswith(prefix) and not n.startswith("router.")}
    if others:
        raise ValueError(f"{folder}: tensors outside the student and the router: {sorted(others)[:10]}")
    router_sd: dict[str, torch.Tensor] = {}

    def student_stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors:
            if name.startswith(prefix):
                yield name[len(prefix) :], t
            else:
                router_sd[name[len("router.") :]] = t

    files = write_weights(  # also drains the router's tensors
        Path(weights_dir), student_entries, student_stream(), max_shard_size or DEFAULT_MAX_SHARD_SIZE
    )
    save_file(router_sd, str(router), metadata={"format": "pt"})
    return files


# ---------------------------------------------------------------------- storage
def storage_target(uri: str, s3: S3Settings | None = None) -> tuple[str, Any]:
    """``(storage_path, storage_filesystem)`` for Ray Train's ``RunConfig``.

    Local paths pass through (made absolute). ``s3://bucket/prefix`` with an S3-compatible endpoint gets a
    pyarrow ``S3FileSystem`` built from ``s3`` (default: :mod:`components.settings` from the environment:
    endpoint, credentials, region; pyarrow does not read the endpoint by itself), and the path loses its
    scheme, as Ray expects when a filesystem is given. The filesystem (credentials included) is pickled to
    the Ray Train controller and workers. Nothing is written to the environment: the checksum setting an
    S3-compatible server needs for uploads reaches the workers through their runtime environment
    (:meth:`~components.settings.S3Settings.checksum_env`, see :func:`components.distill.stage.build_trainer`).
    """
    if not uri.startswith("s3://"):
        return str(Path(uri).expanduser().resolve()), None
    s3 = s3 or from_environment().s3
    if not s3.endpoint_url:
        return uri, None  # real AWS: Ray resolves s3:// itself from the environment
    from urllib.parse import urlparse

    import pyarrow.fs

    parsed = urlparse(s3.endpoint_url)
    fs = pyarrow.fs.S3FileSystem(
        access_key=s3.access_key_id,
        secret_key=s3.secret_access_key,
        session_token=s3.session_token,
        region=s3.region or "us-east-1",
        endpoint_override=parsed.netloc or s3.endpoint_url,
        scheme=parsed.scheme or "https",
    )
    return uri[len("s3://") :], fs
