"""Quantized checkpoints: calibrate, quantize a model, read the folder back (writing it once from a nested
checkpoint is :func:`model.quant.quantize.quantize_checkpoint`).

The folder is what NVIDIA Model-Optimizer exports: the published layout (:mod:`model.layout`) with
``X.weight``, ``X.weight_scale``, ``X.weight_scale_2`` (nvfp4) and ``X.input_scale`` (fp8, nvfp4_w4a4)
per quantized projection, routed experts per expert, FP8 KV-cache scales when the preset asks for them;
``config.json`` with ModelOpt's ``quantization_config`` and ``hf_quant_config.json`` beside it
(:mod:`model.quant.modelopt`); ``manifest.json``. Activation scales (fp8, nvfp4_w4a4) and KV scales are
calibrated on the full model and under every budget's hard mask (the max), so one per-tensor scale covers
every nested sub-model. ``nvfp4`` is weight-only (W4A16), ``nvfp4_w4a4`` quantizes activations too.

Layout and design notes: docs/quantization.md ("Quantized checkpoints").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.checkpoint import (
    CONFIG_NAME,
    CheckpointError,
    check_state,
    read_tensors,
    to_canonical,
    verify_manifest,
)
from model.config import HybridConfig
from model.hybrid import HybridLM
from model.masks import ModelMask
from model.mlp import relu2
from model.moe import Experts, MoE, TopKRouter

from .experts import DEFAULT_CACHE_DEQUANTIZED, QuantExperts
from .fp8 import FP8_DTYPE, AmaxObserver
from .modelopt import (
    QUANT_ALGOS,
    file_module_name,
    format_of,
    hf_quant_config,
    quantization_config_of,
    run_under_hooks,
    weight_format,
)
from .nvfp4 import NVFP4_BLOCK_SIZE
from .qlinear import QUANT_PRESETS, QuantFormat, QuantLinear, QuantPreset, quantize_module

__all__ = [
    "QUANT_ALGOS",
    "calibrate_input_amax",
    "dequantize_model",
    "kept_dense_names",
    "build_quantized_model",
    "load_quantized_model",
    "quantization_config",
    "quantize_model",
    "quantized_format",
    "read_quantized_tensors",
    "synthetic_calibration_batches",
]

HF_QUANT_CONFIG = "hf_quant_config.json"
_SCALE_KEYS = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")
_KV_KEYS = (".k_proj.k_scale", ".v_proj.v_scale")
_DENSE_EXPERT = re.compile(r"^.*\.mixer\.experts\.\d+\.(up_proj|down_proj)\.weight$")


def _preset(preset: str | QuantPreset) -> QuantPreset:
    if isinstance(preset, QuantPreset):
        return preset
    if preset not in QUANT_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(QUANT_PRESETS)}")
    return QUANT_PRESETS[preset]


def _check_format(fmt: str) -> None:
    weight_format(fmt)  # raises naming the formats


def _moe_layers(model: HybridLM) -> list[tuple[str, MoE]]:
    """``(qualified name of the MoE mixer, mixer)`` for every MoE layer."""
    return [(f"model.layers.{i}.mixer", b.mixer) for i, b in enumerate(model.model.layers) if b.kind == "moe"]


# ---------------------------------------------------------------------- calibration
def synthetic_calibration_batches(vocab_size: int, n: int = 4, seq_len: int = 64, seed: int = 0) -> list[Tensor]:
    """``n`` random token batches (2, seq_len): a stand-in when no calibration data is given.

    Real text gives tighter, more representative activation ranges; the quantize stage passes
    batches of the task's data.
    """
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (2, seq_len), generator=g) for _ in range(n)]


@torch.no_grad()
def calibrate_input_amax(
    model: HybridLM,
    batches: Iterable[Tensor],
    masks: Sequence[ModelMask | None] = (None,),
    preset: str | QuantPreset = "all",
) -> dict[str, Tensor]:
    """Observed input amax of every projection ``preset`` would quantize, over ``batches`` x ``masks``.

    Args:
        model: the unquantized model.
        batches: token ids, each (batch, seq).
        masks: run every batch once per mask (``None``: the full model).
        preset: which projections to observe.

    Returns:
        ``{qualified name: fp32 scalar}``; routed experts as ``...mixer.experts.{j}.up_proj`` /
        ``.down_proj`` (experts no token reached: docs/quantization.md).
    """
    preset = _preset(preset)
    observers: dict[str, AmaxObserver] = {}
    handles = []

    def linear_hook(name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            observers.setdefault(name, AmaxObserver()).update(args[0])

        return hook

    def experts_hook(name: str):
        def hook(module: Experts, args: tuple, kwargs: dict) -> None:
            names = ("x", "idx", "weights", "ffn_mask", "observer")
            bound = dict(zip(names, args, strict=False)) | kwargs
            x, idx, ffn_mask = bound["x"], bound["idx"], bound.get("ffn_mask")
            for e in idx.unique().tolist():
                xs = x[(idx == e).any(-1)]
                observers.setdefault(f"{name}.{e}.up_proj", AmaxObserver()).update(xs)
                h = relu2(xs @ module.up_proj[e].t())
                if ffn_mask is not None:
                    h = h * ffn_mask.to(h.dtype)
                observers.setdefault(f"{name}.{e}.down_proj", AmaxObserver()).update(h)

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and preset.should_quantize(name):
            handles.append(module.register_forward_pre_hook(linear_hook(name)))
    moe_names = []
    for name, moe in _moe_layers(model):
        if isinstance(moe.experts, Experts) and preset.should_quantize(f"{name}.experts.up_proj"):
            moe_names.append((f"{name}.experts", moe.experts.num_experts))
            handles.append(moe.experts.register_forward_pre_hook(experts_hook(f"{name}.experts"), with_kwargs=True))
    run_under_hooks(model, batches, masks, handles)
    amax = {name: obs.amax for name, obs in observers.items()}
    for prefix, n_experts in moe_names:  # unrouted experts: the layer's largest observed amax
        for proj in ("up_proj", "down_proj"):
            seen = [amax[f"{prefix}.{j}.{proj}"] for j in range(n_experts) if f"{prefix}.{j}.{proj}" in amax]
            fallback = torch.stack(seen).max() if seen else torch.zeros(())
            for j in range(n_experts):
                amax.setdefault(f"{prefix}.{j}.{proj}", fallback.clone())
    return amax


# ---------------------------------------------------------------------- in-memory quantization
@torch.no_grad()
def quantize_model(
    model: HybridLM,
    fmt: QuantFormat,
    preset: str | QuantPreset = "default",
    input_amax: dict[str, Tensor] | None = None,
    cache_dequantized: bool = DEFAULT_CACHE_DEQUANTIZED,
) -> list[str]:
    """Quantize ``model`` in place: the preset's projections and every routed expert.

    Args:
        model: an unquantized :class:`HybridLM`.
        fmt: ``"fp8"``, ``"nvfp4"`` (weight-only) or ``"nvfp4_w4a4"``.
        preset: which projections stay dense (lm_head, routers and non-linear tensors always do).
        input_amax: from :func:`calibrate_input_amax`; sets ``input_scale`` for fp8 and nvfp4_w4a4
            (ignored for weight-only nvfp4). nvfp4_w4a4 experts get their layer's largest amax, per
            projection: engines that share one activation scale across a layer's experts take that max.
        cache_dequantized: passed to every quantized module.

    Returns:
        Sorted qualified names of the quantized projections (experts as ``...experts.{j}.up_proj``).
    """
    wfmt = weight_format(fmt)
    preset = _preset(preset).for_config(model.config)
    h = model.config.hidden_size
    experts_to_quantize = []
    for name, moe in _moe_layers(model):
        if not (isinstance(moe.experts, Experts) and preset.should_quantize(f"{name}.experts.up_proj")):
            continue
        e, f, _ = moe.experts.up_proj.shape
        if wfmt == "nvfp4" and (f % NVFP4_BLOCK_SIZE or h % NVFP4_BLOCK_SIZE):
            raise ValueError(
                f"{name}.experts: hidden={h}, moe_intermediate_size={f}; NVFP4 needs both (the input "
                f"dimensions of up_proj and down_proj) to be multiples of {NVFP4_BLOCK_SIZE}"
            )
        experts_to_quantize.append((name, moe, e))
    names = quantize_module(model, wfmt, preset, cache_dequantized)
    use_amax = input_amax if fmt != "nvfp4" else None
    if use_amax is not None:
        for name in names:
            if name in use_amax:
                model.get_submodule(name).calibrate_input_scale(use_amax[name])
    for name, moe, e in experts_to_quantize:
        up = down = None
        if use_amax is not None and f"{name}.experts.0.up_proj" in use_amax:
            up = torch.stack([use_amax[f"{name}.experts.{j}.up_proj"] for j in range(e)])
            down = torch.stack([use_amax[f"{name}.experts.{j}.down_proj"] for j in range(e)])
            if fmt == "nvfp4_w4a4":
                up, down = up.max().expand(e), down.max().expand(e)
        moe.experts = QuantExperts.from_experts(moe.experts, wfmt, cache_dequantized, up, down)
        names += [f"{name}.experts.{j}.{p}" for j in range(e) for p in ("up_proj", "down_proj")]
    return sorted(names)


def kept_dense_names(model: nn.Module) -> list[str]:
    """Linear-like modules left in high precision: dense ``nn.Linear`` layers and MoE routers."""
    return sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear | TopKRouter | Experts) and n)


def quantized_format(model: nn.Module) -> str | None:
    """``"fp8"`` / ``"nvfp4"`` when ``model`` holds quantized projections, else ``None``."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            return m.fmt
    return None


def quantization_config(fmt: str, ignore: Sequence[str], kv_cache: str | None = None) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` (ModelOpt's, :mod:`model.quant.modelopt`); ``ignore``
    are the dense modules under the model's names (written with the files' ``backbone.`` prefix)."""
    _check_format(fmt)
    return quantization_config_of(hf_quant_config(fmt, [file_module_name(n) for n in ignore], kv_cache))


# ---------------------------------------------------------------------- loading
def _read_quant_config(folder: Path) -> tuple[dict[str, Any], str]:
    if not (folder / CONFIG_NAME).exists():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME}")
    raw = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    qc = raw.get("quantization_config")
    fmt = format_of(qc)
    if fmt is None:
        raise CheckpointError(
            f"{folder}: config.json has no quantization_config with quant_algo in {sorted(QUANT_ALGOS.values())}; "
            "not a quantized checkpoint (load it with HybridLM.from_pretrained)"
        )
    return qc, fmt


def read_quantized_tensors(folder: str | Path) -> dict[str, Tensor]:
    """All tensors of a quantized checkpoint under the model's names (``backbone.`` read as ``model.``); routed
    experts kept dense and stored per expert are stacked as the dense model holds them."""
    tensors = {(file_module_name_to_model(k)): v for k, v in read_tensors(Path(folder)).items()}
    dense_experts = [k for k in tensors if _DENSE_EXPERT.match(k) and f"{k[:-7]}.weight_scale" not in tensors]
    if dense_experts:
        tensors.update(to_canonical({k: tensors.pop(k) for k in dense_experts}))
    return tensors


def file_module_name_to_model(key: str) -> str:
    """A file key under the model's name (``backbone.`` -> ``model.``)."""
    return "model." + key[len("backbone.") :] if key.startswith("backbone.") else key


def _expected_dtypes(fmt: str) -> dict[str, torch.dtype]:
    if fmt == "fp8":
        return {"weight": FP8_DTYPE, "weight_scale": torch.float32, "input_scale": torch.float32}
    scales = {"weight_scale_2": torch.float32, "input_scale": torch.float32}
    return {"weight": torch.uint8, "weight_scale": FP8_DTYPE, **scales}


def _pop_kv_scales(model: HybridLM, tensors: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """Take the FP8 KV-cache scales (``mixer.k_proj.k_scale`` / ``v_proj.v_scale``) out of ``tensors``; each
    must belong to an attention layer and be an fp32 scalar. Our engine keeps the cache in the compute dtype;
    the scales are for the engines that store it in FP8."""
    from .modelopt import kv_scale_names

    found = {k: tensors.pop(k) for k in [k for k in tensors if k.endswith(_KV_KEYS)]}
    allowed = set(kv_scale_names(model))
    bad = [f"{k} {tuple(v.shape)} {v.dtype}" for k, v in found.items() if k not in allowed or v.numel() != 1]
    bad += [f"{k} {v.dtype}" for k, v in found.items() if v.dtype != torch.float32 and k in allowed]
    if bad:
        raise CheckpointError(f"{where}: KV-cache scales that fit no attention layer as fp32 scalars: {bad[:20]}")
    return found


def load_quantized_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    cache_dequantized: bool = DEFAULT_CACHE_DEQUANTIZED,
) -> HybridLM:
    """A :class:`HybridLM` whose quantized projections are ``QuantLinear`` and experts ``QuantExperts``.

    Masks, caches and generation work as on the dense model. ``dtype`` converts the dense tensors
    (and so the compute dtype); quantized buffers keep their format. ``cache_dequantized`` keeps a
    dense copy of each quantized weight after its first use (the default: faster decoding on
    CPU, figures in ``benchmarks/RESULTS.md``). All-or-nothing: missing, unexpected,
    mis-shaped or wrongly typed tensors raise :class:`CheckpointError` naming them.
    """
    folder = Path(path)
    _, fmt = _read_quant_config(folder)
    verify_manifest(folder)
    config = HybridConfig.from_json_file(folder / CONFIG_NAME)
    return build_quantized_model(config, read_quantized_tensors(folder), fmt, dtype, cache_dequantized, str(folder))


def build_quantized_model(
    config: HybridConfig,
    tensors: dict[str, Tensor],
    fmt: str,
    dtype: torch.dtype | None = None,
    cache_dequantized: bool = DEFAULT_CACHE_DEQUANTIZED,
    where: str = "quantized checkpoint",
) -> HybridLM:
    """The quantized model holding ``tensors`` (file keys); which projections are quantized is read
    from the keys that carry a ``weight_scale``. See :func:`load_quantized_model`."""
    wfmt = weight_format(fmt)
    tensors = dict(tensors)
    quantized = {k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")}
    with torch.device("meta"):
        model = HybridLM(config)
    kv = _pop_kv_scales(model, tensors, where)
    if fmt == "nvfp4_w4a4":  # W4A4: an FP4 GEMM needs the activation scale of every quantized linear
        missing = sorted(f"{n}.input_scale" for n in quantized if f"{n}.input_scale" not in tensors)
        if missing:
            raise CheckpointError(
                f"{where}: quant_algo NVFP4 (W4A4) needs an input_scale for every quantized linear; missing "
                f"{missing[:20]}. A weight-only NVFP4 checkpoint is quant_algo W4A16_NVFP4"
            )
    for name, moe in _moe_layers(model):
        if f"{name}.experts.0.up_proj" in quantized:
            e, f, h = moe.experts.up_proj.shape
            moe.experts = QuantExperts(e, h, f, wfmt, cache_dequantized, device="meta")
    modules = dict(model.named_modules())
    for name in sorted(quantized):
        if isinstance(modules.get(name), QuantLinear):  # an expert projection, built above
            continue
        lin = modules.get(name)
        if not isinstance(lin, nn.Linear):
            raise CheckpointError(f"{where}: {name}.weight_scale belongs to no linear layer of the config")
        parent, _, child = name.rpartition(".")
        q = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, wfmt, cache_dequantized, device="meta")
        setattr(model.get_submodule(parent) if parent else model, child, q)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and f"{name}.input_scale" in tensors:
            m.input_scale = torch.empty((), dtype=torch.float32, device="meta")  # filled by load_state_dict
    check_state(model.state_dict(), tensors, where)
    want = _expected_dtypes(wfmt)
    wrong = []
    for k in sorted(tensors):
        base, _, leaf = k.rpartition(".")
        if base in quantized and leaf in want and tensors[k].dtype != want[leaf]:
            wrong.append(f"{k}: {tensors[k].dtype} (expected {want[leaf]})")
    if wrong:
        raise CheckpointError(f"{where}: quantized tensors with the wrong dtype: {'; '.join(wrong[:20])}")
    if dtype is not None:
        tensors = {k: _to_compute_dtype(k, v, dtype) for k, v in tensors.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    model.kv_cache_scales = kv  # not part of the state dict: what was read, for inspection
    return model.eval()


def _to_compute_dtype(key: str, value: Tensor, dtype: torch.dtype) -> Tensor:
    """Dense floating tensors follow ``dtype``; scales, codes and the selection bias stay as stored."""
    keep = (
        not value.is_floating_point()
        or value.dtype == FP8_DTYPE
        or key.rsplit(".", 1)[-1] in _SCALE_KEYS
        or key.endswith("e_score_correction_bias")
    )
    return value if keep else value.to(dtype)


@torch.no_grad()
def dequantize_model(model: HybridLM, dtype: torch.dtype = torch.float32) -> HybridLM:
    """A dense copy of a quantized model: every quantized weight replaced by its dequantized value.

    Activation scales are dropped (a dense model has none), so outputs differ from the quantized
    model's by the FP8 activation rounding only. Used to compare nested slicing before and after
    quantization, and to evaluate weight-only effects.
    """
    import copy

    dense = copy.deepcopy(model)
    for _, moe in _moe_layers(dense):
        if isinstance(moe.experts, QuantExperts):
            up, down = moe.experts.dequantized(dtype)
            with torch.device("meta"):
                ex = Experts(dense.config)
            ex.up_proj, ex.down_proj, ex.num_experts = nn.Parameter(up), nn.Parameter(down), up.shape[0]
            moe.experts = ex
    for name, m in list(dense.named_modules()):
        if isinstance(m, QuantLinear):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            lin.weight = nn.Parameter(m.dequantized_weight(dtype))
            if m.bias is not None:
                lin.bias = nn.Parameter(m.bias.detach().to(dtype))
            parent, _, child = name.rpartition(".")
            setattr(dense.get_submodule(parent) if parent else dense, child, lin)
    return dense.eval()
