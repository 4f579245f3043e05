"""Models that are partitioned from the start under ZeRO-3: built under ``zero.Init``, filled tensor by tensor.

Under ZeRO-3 no rank may ever hold a whole copy of the student or the teacher (at the real scale one
copy is 63 GB in bf16). This module builds a :class:`~model.hybrid.HybridLM` whose parameters are
partitioned as they are created (:func:`build_partitioned`, ``deepspeed.zero.Init``), then streams the
checkpoint's tensors one at a time (:func:`iter_canonical`) and copies each rank's slice of each tensor
into that rank's partition (:func:`load_into_partitions`). The frozen teacher becomes its own ZeRO-3
engine without an optimizer (:func:`teacher_engine`): DeepSpeed gathers one layer at a time for its
forward and releases it after, so a rank holds ``teacher bytes / world`` plus the gathered layers.

Design choices:

* Slices, not gathers. A ZeRO-3 parameter's partition on rank ``r`` of ``w`` is elements
  ``[r * s, (r + 1) * s)`` of the flattened tensor, ``s = ceil(numel / w)``, zero-padded at the end
  (DeepSpeed's ``_partition_param``). Every rank reads the checkpoint (each worker has the folder) and
  copies its own slice: no collective, one full tensor in host memory at a time. The layout is checked
  on every parameter (:func:`_slice_bounds`), so a DeepSpeed version that changed it fails loudly.
* The parameters are filled before ``deepspeed.initialize``: the engine's optimizer copies its float32
  master partitions from them.
* Per-expert tensors (``...experts.{j}.up_proj.weight``, transformers' layout) are stacked into their
  (E, out, in) parameter as they arrive and yielded when the last expert is in, so a layer's experts
  are the largest buffer; tied embeddings (no ``lm_head.weight`` in the files) read the embedding again.
* The ZeRO-3 bucket settings are derived from the model (:func:`zero3_settings`) rather than
  DeepSpeed's defaults: the defaults (5e8-element reduce bucket, 1e9-parameter reuse distance and
  live set) keep a model of up to a billion parameters gathered, which is no partitioning at all.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from model.checkpoint import (
    CheckpointError,
    ExpertStacker,
    canonical_name,
    iter_views,
    loaded_dtype,
    read_config,
    tied_head,
    verify_manifest,
)
from model.config import HybridConfig
from model.hybrid import HybridLM

LIVE_LAYERS = 2
"""Layers one ZeRO-3 engine keeps gathered at once (the computing one and the prefetched next one); the
plan's ``live_layers``."""


# ---------------------------------------------------------------------- settings
def largest_layer_params(config: HybridConfig) -> int:
    """Parameters of the largest unit ZeRO-3 gathers at once: one block, or the embedding / lm_head."""
    from components.plan import layer_params

    return max(max(layer_params(config).values()), config.vocab_size * config.hidden_size)


def zero3_settings(config: HybridConfig, live_layers: int = LIVE_LAYERS, per_parameter: bool = False) -> dict[str, Any]:
    """The ``zero_optimization`` section of a ZeRO-3 engine for ``config``: buckets of one layer.

    Prefetch, reduce bucket and optimizer sub-group are one largest layer; at most ``live_layers`` of
    them stay gathered, and nothing is kept for reuse beyond one layer ahead. ``per_parameter``:
    each parameter gathered straight into its own buffer (``stage3_allgather_sequential``) instead of
    through one flat buffer per bucket and a copy out of it.
    """
    big = largest_layer_params(config)
    return {
        "stage": 3,
        "stage3_allgather_sequential": per_parameter,
        "stage3_prefetch_bucket_size": big,
        "stage3_max_live_parameters": live_layers * big,
        "stage3_max_reuse_distance": big,
        "reduce_bucket_size": big,
        "sub_group_size": big,
        # zero.Init would otherwise replace torch.nn.functional.linear for the whole process with DeepSpeed's own
        # autograd function (the teacher's forward and the KD loss included)
        "memory_efficient_linear": False,
    }


def per_parameter_gathers(mode: str, use_gpu: bool) -> bool:
    """Whether ZeRO-3 gathers each parameter straight into its own buffer (``DistillConfig.zero3_gathers``: 'auto',
    'coalesced' or 'per_parameter'; auto: on CPU workers).

    DeepSpeed's coalesced gather fills one flat buffer per bucket and then copies every parameter out of it
    (``torch.cat``), so each gathered layer is allocated and written twice; per parameter, the parameter IS a view
    of the buffer its collective fills. On a CPU that halves the gathers' allocations (and so their page faults
    when freed layers are returned, :mod:`.heap`) and drops the copy; on GPUs the coalesced form's fewer, larger
    NCCL calls matter more, and the CUDA caching allocator reuses the buffers anyway.
    """
    return (not use_gpu) if mode == "auto" else mode == "per_parameter"


# ---------------------------------------------------------------------- partitioned parameters
def is_partitioned(p: Tensor) -> bool:
    """Whether ``p`` is a ZeRO-3 parameter (its data live in per-rank partitions)."""
    return hasattr(p, "ds_id")


@contextlib.contextmanager
def gathered(params: Iterable[Tensor], modifier_rank: int | None = None) -> Iterator[None]:
    """Full values of the ZeRO-3 parameters among ``params`` inside the block (a collective: every rank
    enters it); a no-op for ordinary tensors."""
    zero_params = [p for p in params if is_partitioned(p)]
    if not zero_params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero_params, modifier_rank=modifier_rank):
        yield


def build_partitioned(factory: Callable[[], nn.Module], ds_config: dict[str, Any]) -> nn.Module:
    """``factory()`` under ``deepspeed.zero.Init``: every parameter is partitioned as soon as its module
    is built, in the dtype of ``ds_config`` (bf16 when enabled). The values are DeepSpeed's placeholders
    (uninitialised for Mamba's A / D): fill them with :func:`load_into_partitions`."""
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        return factory()


def _slice_bounds(p: Tensor) -> tuple[int, int]:
    """(start, length) of this rank's slice of ``p``'s flattened values, checked against its partition."""
    group = p.ds_process_group
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    size = p.ds_tensor.numel()
    if size != math.ceil(p.ds_numel / world):
        raise RuntimeError(
            f"ZeRO-3 partition of {tuple(p.ds_shape)} has {size} elements on each of {world} ranks, expected "
            f"ceil({p.ds_numel} / {world}); this DeepSpeed version lays partitions out differently"
        )
    start = rank * size
    return start, max(0, min(size, p.ds_numel - start))


@torch.no_grad()
def load_into_partitions(module: nn.Module, tensors: Iterable[tuple[str, Tensor]]) -> set[str]:
    """Copy each ``(name, full tensor)`` into ``module``: this rank's slice into a ZeRO-3 partition, the
    whole tensor into an ordinary parameter or buffer. Returns the names filled. Raises ``KeyError`` for
    a name the module lacks and ``ValueError`` for a shape that does not match."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    filled: set[str] = set()
    for name, full in tensors:
        target = params.get(name, buffers.get(name))
        if target is None:
            raise KeyError(f"{name}: no such parameter or buffer in {type(module).__name__}")
        shape = tuple(target.ds_shape) if is_partitioned(target) else tuple(target.shape)
        if tuple(full.shape) != shape:
            raise ValueError(f"{name}: tensor {tuple(full.shape)} does not fit the parameter {shape}")
        if is_partitioned(target):
            start, n = _slice_bounds(target)
            part = target.ds_tensor
            part[:n].copy_(full.reshape(-1)[start : start + n])
            part[n:].zero_()
        else:
            target.copy_(full)
        filled.add(name)
    return filled


def full_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Unpartitioned shape of every parameter and buffer of ``module`` (ZeRO-3 or not)."""
    out = {n: tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape) for n, p in module.named_parameters()}
    out.update({n: tuple(b.shape) for n, b in module.named_buffers()})
    return out


# ---------------------------------------------------------------------- streaming a checkpoint
def iter_canonical(
    folder: str | Path, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` under the model's own names for every tensor of a nemotron_h checkpoint.

    ``shapes``: the expected full shape of every name (:func:`full_shapes`). Keys are renamed
    (``backbone.`` -> ``model.``), multi-token-prediction tensors skipped, per-expert tensors stacked, all
    as the loader does (:func:`~model.checkpoint.canonical_name`, :class:`~model.checkpoint.ExpertStacker`);
    floating tensors become ``dtype`` (the router bias stays float32). Each yielded tensor is the
    caller's own copy. After the last tensor, raises :class:`CheckpointError` naming every missing,
    unexpected or mis-shaped tensor.
    """
    folder = Path(folder)
    _, raw = read_config(folder)
    verify_manifest(folder)
    stacker = ExpertStacker(shapes, dtype)
    seen: set[str] = set()
    problems: list[str] = []
    embedding_key = None
    for file_key, view in iter_views(folder):
        named = canonical_name(file_key)
        if named is None:  # multi-token prediction: not part of the model
            continue
        key, index = named
        if index is not None:
            stacked = stacker.add(key, index, view)
            if stacked is not None:
                seen.add(key)
                yield key, stacked
            continue
        if key not in shapes:
            problems.append(f"unexpected tensor {key}")
            continue
        if tuple(view.shape) != tuple(shapes[key]):
            problems.append(f"{key}: file {tuple(view.shape)} vs model {tuple(shapes[key])}")
            continue
        if key == "model.embeddings.weight":
            embedding_key = file_key
        seen.add(key)
        yield key, view.to(loaded_dtype(key, view, dtype), copy=True)
    if "lm_head.weight" in shapes and tied_head(seen, raw, folder, strict=False):  # untied: named missing below
        for key, view in iter_views(folder):  # tied: lm_head starts as a copy of the embedding (as load_model does)
            if key == embedding_key:
                seen.add("lm_head.weight")
                yield "lm_head.weight", view.to(loaded_dtype(key, view, dtype), copy=True)
                break
    problems += stacker.problems()
    missing = sorted(set(shapes) - seen - set(stacker.pending))
    if missing:
        problems.append(f"missing tensors {missing[:20]}{' ...' if len(missing) > 20 else ''}")
    if problems:
        raise CheckpointError(f"{folder}: " + " | ".join(problems[:20]))


# ---------------------------------------------------------------------- the models
def load_hybrid(
    folder: str | Path, config: HybridConfig, dtype: torch.dtype, ds_config: dict[str, Any] | None
) -> HybridLM:
    """The checkpoint in ``folder`` as a :class:`HybridLM` in ``dtype``: partitioned under ZeRO-3 when
    ``ds_config`` is given (built under ``zero.Init``, each rank filled with its slices), else whole."""
    if ds_config is None:
        return HybridLM.from_pretrained(folder, dtype=dtype)
    model = build_partitioned(lambda: HybridLM(config), ds_config)
    load_into_partitions(model, iter_canonical(folder, full_shapes(model), dtype))
    return model


def share_fp32_master(engine: Any) -> int:
    """Float32 training under ZeRO-3: let the optimizer's float32 master partitions BE the weight partitions.

    DeepSpeed's ZeRO-3 optimizer means to skip the master copy when the weights already are float32 on its
    device (it does so under torch autocast), but compares a ``torch.device`` with a device string, which is
    never equal, so a float32 run keeps two identical copies of every partition. This points each master
    partition at its weight partition (equal values at this point: the master was cloned from it); the step
    then updates the weights in place and DeepSpeed's copy back is a copy onto itself. Returns the bytes
    freed; a no-op (0) for bf16 weights or an engine without ZeRO-3 partitions. Call it right after
    ``deepspeed.initialize``, before the first step.
    """
    opt = engine.optimizer
    low = getattr(opt, "fp16_partitioned_groups_flat", None)
    masters = getattr(opt, "fp32_partitioned_groups_flat", None)
    if not low or not masters or len(low) != len(masters):
        return 0
    freed = 0
    for w, m in zip(low, masters, strict=True):
        if w is None or w.dtype != m.dtype or w.device != m.device or w.shape != m.shape:
            continue
        if w.data_ptr() == m.data_ptr():
            continue
        if not torch.equal(w, m):
            raise RuntimeError(
                "share_fp32_master: a master partition differs from its weights; call it before any step"
            )
        freed += m.numel() * m.element_size()
        m.data = w.data
    return freed


def teacher_engine(model: HybridLM, ds_config: dict[str, Any]) -> Any:
    """A frozen partitioned ``model`` as a DeepSpeed ZeRO-3 engine WITHOUT an optimizer: calling it runs
    the forward with DeepSpeed gathering and releasing each layer's parameters (DeepSpeed's
    parameter-offload hooks, which an engine without an optimizer installs)."""
    import deepspeed

    model.requires_grad_(False).eval()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine
