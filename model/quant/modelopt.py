"""Quantization configs as NVIDIA Model-Optimizer writes them, and the KV-cache scales engines read.

A quantized checkpoint carries ``hf_quant_config.json`` (ModelOpt's own file) and the same content in
``config.json``'s ``quantization_config`` (ModelOpt's ``convert_hf_quant_config_format``: compressed-tensors
style ``config_groups`` plus ``quant_algo``, ``ignore``, ``kv_cache_scheme``, ``producer`` and
``quant_method: modelopt``). vLLM's and TensorRT-LLM's ModelOpt loaders read either; llama.cpp's converter
reads ``quantization_config``. Module names are the file keys' (``backbone.`` prefix), so the engines match
``exclude_modules`` against the tensors they load. The source lines each field was checked against are
cited in docs/quantization.md ("Engine configs").

Formats (the project's name -> ``quant_algo``):

* ``fp8``: ``FP8``, per-tensor E4M3 weights and static per-tensor activation scales (``input_scale``).
* ``nvfp4``: ``W4A16_NVFP4``, NVFP4 weights, activations in the compute dtype.
* ``nvfp4_w4a4``: ``NVFP4``, NVFP4 weights and NVFP4 activations with a calibrated global activation scale
  ``input_scale = amax / (6 * 448)`` per quantized linear and per routed expert projection.

With ``kv_cache_quant_algo: FP8`` the attention layers carry ``mixer.k_proj.k_scale`` and
``mixer.v_proj.v_scale`` (fp32 scalars, ``amax / 448`` of the keys and values, ModelOpt's definition).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .fp8 import FP8_E4M3_MAX, AmaxObserver
from .nvfp4 import NVFP4_BLOCK_SIZE

__all__ = [
    "CHECKPOINT_FORMATS",
    "MODELOPT_VERSION",
    "QUANT_ALGOS",
    "calibrate_kv_amax",
    "format_of",
    "hf_quant_config",
    "kv_scale_names",
    "quantization_config_of",
    "weight_format",
]

CHECKPOINT_FORMATS: tuple[str, ...] = ("fp8", "nvfp4", "nvfp4_w4a4")
QUANT_ALGOS: dict[str, str] = {"fp8": "FP8", "nvfp4": "W4A16_NVFP4", "nvfp4_w4a4": "NVFP4"}
"""The project's format name -> ModelOpt ``quant_algo``."""

MODELOPT_VERSION = "0.46.0rc2"
"""The ModelOpt release whose export format these configs follow (``producer.version``)."""

_KV_SCALES = {"k_proj": "k_scale", "v_proj": "v_scale"}


def weight_format(fmt: str) -> str:
    """How the weights of checkpoint format ``fmt`` are stored: ``"fp8"`` or ``"nvfp4"``."""
    if fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {list(CHECKPOINT_FORMATS)}")
    return "fp8" if fmt == "fp8" else "nvfp4"


def format_of(quantization_config: dict[str, Any] | None) -> str | None:
    """The project's format of a ``quantization_config`` (ours or ModelOpt's), None when not quantized.

    Reads ``quant_algo`` at the top (``config.json``) or under ``quantization`` (``hf_quant_config.json``).
    """
    if not isinstance(quantization_config, dict):
        return None
    algo = quantization_config.get("quant_algo")
    if algo is None and isinstance(quantization_config.get("quantization"), dict):
        algo = quantization_config["quantization"].get("quant_algo")
    by_algo = {v: k for k, v in QUANT_ALGOS.items()}
    return by_algo.get(str(algo).upper()) if algo is not None else None


def hf_quant_config(fmt: str, exclude_modules: Iterable[str], kv_cache_quant_algo: str | None = None) -> dict[str, Any]:
    """``hf_quant_config.json`` as ModelOpt's ``get_quant_config`` writes it for one format.

    Keys in ModelOpt's order: ``quant_algo``, ``kv_cache_quant_algo`` (null when the KV cache is not
    quantized), ``group_size`` (NVFP4 algorithms only), ``exclude_modules`` (sorted file-key module names).
    """
    algo = QUANT_ALGOS.get(fmt)
    if algo is None:
        raise ValueError(f"unknown format {fmt!r}; expected one of {list(CHECKPOINT_FORMATS)}")
    quantization: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": kv_cache_quant_algo}
    if "NVFP4" in algo:
        quantization["group_size"] = NVFP4_BLOCK_SIZE
    quantization["exclude_modules"] = sorted(set(exclude_modules))
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": quantization}


def quantization_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for an ``hf_quant_config.json`` dict, as ModelOpt converts it."""
    q = hf["quantization"]
    algo = q["quant_algo"]
    weights: dict[str, Any] = {"dynamic": False, "num_bits": 8, "type": "float"}
    group: dict[str, Any]
    if algo == "FP8":
        group = {"input_activations": dict(weights), "weights": weights}
    else:
        gs = q.get("group_size", NVFP4_BLOCK_SIZE)
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}
        group = {"weights": weights} if algo == "W4A16_NVFP4" else {"input_activations": dict(weights)}
        group["weights"] = weights
    out: dict[str, Any] = {
        "config_groups": {"group_0": {**group, "targets": ["Linear"]}},
        "ignore": list(q.get("exclude_modules") or []),
        "quant_algo": algo,
    }
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    elif q.get("kv_cache_quant_algo"):
        out["kv_cache_scheme"] = q["kv_cache_quant_algo"]
    out["producer"] = dict(hf["producer"])
    out["quant_method"] = "modelopt"
    return out


def file_module_name(name: str) -> str:
    """A module's name as the engines see it (the file keys' ``backbone.`` prefix)."""
    return "backbone" + name[len("model") :] if name.startswith("model.") else name


def kv_scale_names(model: nn.Module) -> list[str]:
    """``model.layers.N.mixer.k_proj.k_scale`` / ``v_proj.v_scale`` for every attention layer."""
    return [
        f"model.layers.{i}.mixer.{proj}.{scale}"
        for i, block in enumerate(model.model.layers)
        if block.kind == "attention"
        for proj, scale in _KV_SCALES.items()
    ]


@torch.no_grad()
def calibrate_kv_amax(model: nn.Module, batches: Iterable[Tensor], masks: Sequence[Any] = (None,)) -> dict[str, Tensor]:
    """Observed amax of the keys and values every attention layer caches, over ``batches`` x ``masks``.

    The ``nemotron_h`` attention has no rotary embedding, so the cached keys / values are the outputs of
    ``k_proj`` / ``v_proj``. Returns ``{"model.layers.N.mixer.k_proj.k_scale": amax, ...}`` (fp32 scalars;
    divide by 448 for the scale, :func:`kv_scales`).
    """
    observers: dict[str, AmaxObserver] = {}
    handles = []
    for name in kv_scale_names(model):
        module = model.get_submodule(name.rsplit(".", 1)[0])

        def hook(_m: nn.Module, _args: tuple, out: Tensor, key: str = name) -> None:
            observers.setdefault(key, AmaxObserver()).update(out)

        handles.append(module.register_forward_hook(hook))
    run_under_hooks(model, batches, masks, handles)
    return {k: obs.amax.to(torch.float32).cpu() for k, obs in observers.items()}


@torch.no_grad()
def run_under_hooks(model: nn.Module, batches: Iterable[Tensor], masks: Sequence[Any], handles: list[Any]) -> None:
    """Forward every (batch, mask) pair in eval mode, then remove ``handles`` (the observers' hooks) and restore
    the model's training flag, whatever happens. ``batches``: (rows, seq) token ids."""
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            for mask in masks:
                model(ids.to(model.device), mask=mask)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def kv_scales(amax: dict[str, Tensor]) -> dict[str, Tensor]:
    """FP8 KV-cache scales ``amax / 448`` (1.0 for a zero amax), fp32 scalars, as ModelOpt exports them."""
    return {k: torch.where(v > 0, v / FP8_E4M3_MAX, torch.ones_like(v)).reshape(()) for k, v in amax.items()}
