"""Quantize a nested checkpoint once: calibrate under every budget, check the nesting survives, write it.

Writing needs both sides of :mod:`model.quant`: the quantized model and its files (:mod:`.checkpoint`)
and the budgets' slicing rules (:mod:`.nesting`, which checks NVFP4's block alignment before anything is
quantized). The folder it writes, and how scales cover every budget: :mod:`model.quant.checkpoint`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from model.checkpoint import CONFIG_NAME, write_checkpoint
from model.config import HybridConfig
from model.hybrid import HybridLM
from model.masks import ModelMask

from .checkpoint import (
    HF_QUANT_CONFIG,
    _check_format,
    _preset,
    _to_compute_dtype,
    calibrate_input_amax,
    kept_dense_names,
    quantize_model,
    synthetic_calibration_batches,
)
from .modelopt import (
    QUANT_ALGOS,
    calibrate_kv_amax,
    file_module_name,
    hf_quant_config,
    kv_scales,
    quantization_config_of,
    weight_format,
)
from .nesting import budget_architectures, check_nvfp4_alignment
from .qlinear import QuantFormat

__all__ = ["quantize_checkpoint"]


def quantize_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    fmt: QuantFormat,
    preset: str = "default",
    calib_batches: Iterable[Tensor] | None = None,
    calibrate_budgets: bool = True,
    dense_dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Path:
    """Quantize a (nested) checkpoint once and write it as a quantized checkpoint folder.

    Args:
        src_dir: an unquantized ``nemotron_h`` checkpoint, usually nested (``elastic`` section).
        out_dir: the folder to write (replaced atomically if it exists).
        fmt: ``"fp8"`` or ``"nvfp4"``.
        preset: ``"default"`` | ``"conservative"`` | ``"all"`` (see :data:`QUANT_PRESETS`).
        calib_batches: token id batches (batch, seq) for the fp8 activation scales; ``None`` uses
            :func:`synthetic_calibration_batches`. Unused for nvfp4.
        calibrate_budgets: also calibrate under every budget's hard mask (module docstring).
        dense_dtype: dtype of the tensors kept in high precision (e.g. ``torch.bfloat16``, what
            serving engines load); ``None`` keeps the source dtype. Scales and the router's
            selection bias stay fp32 either way.
        device: where the fp8 calibration forwards run (e.g. ``"cuda"`` in a task that reserves a GPU); the
            model comes back to the CPU before it is quantized and written, so only the observed activation
            ranges depend on it.

    Returns:
        ``out_dir``. Raises ``ValueError`` for an already quantized source, an unknown format or
        preset, and (nvfp4) a nested width that splits a 16-element block, naming axis and width.
    """
    _check_format(fmt)
    src = Path(src_dir)
    raw = json.loads((src / CONFIG_NAME).read_text(encoding="utf-8")) if (src / CONFIG_NAME).exists() else {}
    if raw.get("quantization_config"):
        raise ValueError(f"{src}: already quantized ({raw['quantization_config'].get('quant_algo')}); start from bf16")
    model = HybridLM.from_pretrained(src)  # verifies the manifest
    config: HybridConfig = model.config
    preset_obj = _preset(preset).for_config(config)
    archs, depth_order = budget_architectures(src)
    if weight_format(fmt) == "nvfp4":
        check_nvfp4_alignment(config, archs, depth_order, preset_obj)
    amax = None
    kv: dict[str, Tensor] = {}
    if fmt != "nvfp4" or preset_obj.kv_cache:  # static activation or KV-cache scales to calibrate
        from model.elastic.build_masks import hard_mask

        batches = list(calib_batches) if calib_batches is not None else synthetic_calibration_batches(config.vocab_size)
        device = torch.device(device)
        masks: list[ModelMask | None] = [None]
        if calibrate_budgets:
            masks += [hard_mask(config, a, depth_order, device) for a in archs.values() if a.to_dict()]
        model.to(device)
        try:
            if fmt != "nvfp4":
                amax = {k: v.cpu() for k, v in calibrate_input_amax(model, batches, masks, preset_obj).items()}
            if preset_obj.kv_cache:
                kv = kv_scales(calibrate_kv_amax(model, batches, masks))
        finally:
            model.to("cpu")  # quantized and written on the CPU whatever the calibration device
    quantize_model(model, fmt, preset_obj, amax)
    hf = hf_quant_config(fmt, [file_module_name(n) for n in kept_dense_names(model)], preset_obj.kv_cache)
    from model.layout import tokenizer_files

    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if dense_dtype is not None:
        state = {k: _to_compute_dtype(k, v, dense_dtype) for k, v in state.items()}
    state.update(kv)
    return write_checkpoint(
        out_dir,
        state,
        config,
        metadata={"quant_algo": QUANT_ALGOS[fmt]},
        extra_config={"quantization_config": quantization_config_of(hf)},
        extra_files=tokenizer_files(src),
        extra_json={HF_QUANT_CONFIG: hf},
    )
