"""Quantized drop-in replacement for ``nn.Linear`` and a name-based module quantizer.

:class:`QuantLinear` stores its weight in FP8 E4M3 (``weight`` (out, in), per-tensor
``weight_scale``, optional static ``input_scale``) or NVFP4 (``weight`` uint8 (out, in // 2),
``weight_scale`` fp8 (out, in // 16), global ``weight_scale_2``) and dequantizes on the fly, or once
into a cache, for a dense matmul: a numerics reference, not a fast kernel. A nested width uses a
prefix of the inputs (from ``x``) and optionally of the outputs, sliced, never requantized.

State-dict layout table: docs/quantization.md ("Quantized linear layers").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .fp8 import FP8_DTYPE, calibrate_input_scale, dequantize_fp8, fake_quantize_fp8_activation, quantize_fp8
from .nvfp4 import (
    NVFP4_BLOCK_SIZE,
    dequantize_nvfp4,
    fake_quantize_nvfp4_activation,
    nvfp4_input_scale,
    quantize_nvfp4,
    slice_nvfp4,
)

__all__ = [
    "QUANT_FORMATS",
    "QUANT_PRESETS",
    "QuantFormat",
    "QuantLinear",
    "QuantPreset",
    "bound_dequantized_caches",
    "quantize_module",
]

QuantFormat = Literal["fp8", "nvfp4"]
QUANT_FORMATS: tuple[str, ...] = ("fp8", "nvfp4")

# Buffers whose dtype encodes the format: a module-wide ``.half()`` / ``.to(bfloat16)`` must move them
# between devices but never convert them (float8 counts as "floating point" to nn.Module.to).
_QUANT_BUFFERS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in FP8 E4M3 or NVFP4.

    Args:
        in_features: input width (a multiple of 16 for nvfp4).
        out_features: output width.
        bias: whether the layer has a (dense, unquantized) bias.
        fmt: ``"fp8"`` or ``"nvfp4"``.
        cache_dequantized: keep the dequantized weight (in the activation dtype) after the first forward
            instead of dequantizing on every call; trades memory for speed. Not part of the state dict.
        bias_dtype: dtype of the bias parameter.
        device: where to allocate the (zero-initialized) buffers.

    Buffers are zero-initialized; fill them via :meth:`from_linear`, :meth:`set_weight` or
    :meth:`load_state_dict`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        fmt: QuantFormat = "nvfp4",
        cache_dequantized: bool = False,
        bias_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"QuantLinear: unknown format {fmt!r}; expected one of {QUANT_FORMATS}")
        if fmt == "nvfp4" and in_features % NVFP4_BLOCK_SIZE != 0:
            raise ValueError(
                f"QuantLinear: in_features={in_features}; the input dimension must be a multiple of "
                f"{NVFP4_BLOCK_SIZE} (NVFP4 block size)"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.fmt: QuantFormat = fmt
        self.cache_dequantized = cache_dequantized
        f32 = {"dtype": torch.float32, "device": device}
        if fmt == "fp8":
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
            self.register_buffer("weight_scale", torch.ones((), **f32))
            self.register_buffer("weight_scale_2", None)
        else:
            n_blocks = in_features // NVFP4_BLOCK_SIZE
            self.register_buffer(
                "weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer("weight_scale", torch.zeros(out_features, n_blocks, dtype=FP8_DTYPE, device=device))
            self.register_buffer("weight_scale_2", torch.ones((), **f32))
        # Registered as None so it stays out of the state dict until a scale is calibrated.
        self.register_buffer("input_scale", None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._dequant_cache: Tensor | None = None

    # ------------------------------------------------------------------------------------------------
    # Construction / mutation
    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fmt: QuantFormat,
        cache_dequantized: bool = False,
        input_scale: Tensor | float | None = None,
    ) -> QuantLinear:
        """Quantize a dense ``nn.Linear`` (weight ``(out, in)``) into a new module on the same device."""
        bias = linear.bias is not None
        q = cls(
            linear.in_features,
            linear.out_features,
            bias=bias,
            fmt=fmt,
            cache_dequantized=cache_dequantized,
            bias_dtype=linear.bias.dtype if bias else torch.float32,
            device=linear.weight.device,
        )
        q.set_weight(linear.weight.detach())
        if bias:
            q.bias.data.copy_(linear.bias.detach())
        if input_scale is not None:
            q.set_input_scale(input_scale)
        return q

    @torch.no_grad()
    def set_weight(self, weight: Tensor) -> None:
        """Quantize and store a dense weight of shape ``(out_features, in_features)``."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"QuantLinear.set_weight: expected shape {(self.out_features, self.in_features)}, "
                f"got {tuple(weight.shape)}"
            )
        weight = weight.to(self.weight.device)
        if self.fmt == "fp8":
            q, scale = quantize_fp8(weight)
            self.weight.copy_(q)
            self.weight_scale.copy_(scale)
        else:
            packed, block_scales, global_scale = quantize_nvfp4(weight)
            self.weight.copy_(packed)
            self.weight_scale.copy_(block_scales)
            self.weight_scale_2.copy_(global_scale)
        self._dequant_cache = None

    def set_input_scale(self, scale: Tensor | float | None) -> None:
        """Set (or clear with ``None``) the static activation scale: fp8 ``amax / 448`` (W8A8), nvfp4 the
        global activation scale ``amax / (6 * 448)`` (W4A4: activations rounded to NVFP4 with dynamic
        per-block fp8 scales under it, as FP4 tensor cores take them)."""
        if scale is None:
            self.input_scale = None
            return
        s = torch.as_tensor(scale, dtype=torch.float32).reshape(())
        if not bool(torch.isfinite(s)) or float(s) <= 0:
            raise ValueError(f"QuantLinear: input_scale must be finite and > 0, got {float(s)}")
        self.input_scale = s.to(self.weight.device)

    def calibrate_input_scale(self, amax: Tensor | float) -> None:
        """Set the activation scale from an observed activation amax (fp8 ``amax / 448``, nvfp4
        ``amax / (6 * 448)``)."""
        self.set_input_scale(calibrate_input_scale(amax) if self.fmt == "fp8" else nvfp4_input_scale(amax))

    # ------------------------------------------------------------------------------------------------
    # Dequantization
    # ------------------------------------------------------------------------------------------------

    def dequantized_weight(
        self,
        dtype: torch.dtype = torch.float32,
        out_features: int | None = None,
        in_features: int | None = None,
    ) -> Tensor:
        """Dense weight ``(out_features, in_features)`` (prefixes; default full size) in ``dtype``.

        Slices the quantized tensors before dequantizing, so the result is bitwise equal to the
        corresponding block of the full dequantized weight.
        """
        out_f = self.out_features if out_features is None else out_features
        in_f = self.in_features if in_features is None else in_features
        self._check_prefix(out_f, in_f)
        if self.fmt == "fp8":
            # Per-tensor scale: any sub-block dequantizes independently.
            return dequantize_fp8(self.weight[:out_f, :in_f], self.weight_scale, dtype)
        # Round the input prefix up to whole blocks, dequantize, then trim the tail of the last block.
        in_blocks = -(-in_f // NVFP4_BLOCK_SIZE) * NVFP4_BLOCK_SIZE
        packed, block_scales = slice_nvfp4(self.weight, self.weight_scale, out_f, in_blocks)
        return dequantize_nvfp4(packed, block_scales, self.weight_scale_2, dtype)[:, :in_f]

    def _check_prefix(self, out_f: int, in_f: int) -> None:
        if not 0 < out_f <= self.out_features:
            raise ValueError(f"QuantLinear: out_features={out_f} outside [1, {self.out_features}]")
        if not 0 < in_f <= self.in_features:
            raise ValueError(f"QuantLinear: input width {in_f} outside [1, {self.in_features}]")

    def _full_weight(self, dtype: torch.dtype) -> Tensor:
        """Full dequantized weight, memoized when ``cache_dequantized`` is set."""
        cache = self._dequant_cache
        if cache is not None and cache.dtype == dtype and cache.device == self.weight.device:
            return cache
        w = self.dequantized_weight(dtype)
        if self.cache_dequantized:
            self._dequant_cache = w
        return w

    def clear_cache(self) -> None:
        """Drop the cached dequantized weight (it is rebuilt lazily)."""
        self._dequant_cache = None

    # ------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------

    def forward(self, x: Tensor, out_features: int | None = None) -> Tensor:
        """Apply the layer.

        Args:
            x: ``(..., in')`` with ``in' <= in_features``; a narrower input uses the leading ``in'``
                input features (nested sub-network).
            out_features: optional output prefix ``out' <= out_features``.

        Returns:
            ``(..., out')`` in ``x.dtype``.
        """
        in_f = x.shape[-1]
        out_f = self.out_features if out_features is None else out_features
        self._check_prefix(out_f, in_f)
        if self.cache_dequantized:
            w = self._full_weight(x.dtype)
            if (out_f, in_f) != (self.out_features, self.in_features):
                w = w[:out_f, :in_f]
        else:
            w = self.dequantized_weight(x.dtype, out_f, in_f)
        if self.input_scale is not None and self.fmt == "fp8":
            x = fake_quantize_fp8_activation(x, self.input_scale)
        elif self.input_scale is not None:
            x = fake_quantize_nvfp4_activation(x, self.input_scale)
        b = None if self.bias is None else self.bias[:out_f].to(x.dtype)
        return F.linear(x, w, b)

    # ------------------------------------------------------------------------------------------------
    # nn.Module plumbing
    # ------------------------------------------------------------------------------------------------

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QuantLinear:
        before = {n: getattr(self, n) for n in _QUANT_BUFFERS if getattr(self, n, None) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = getattr(self, name)
            if new is not None and new.dtype != old.dtype:
                # Keep the device change, undo the dtype change (the dtype *is* the format).
                setattr(self, name, old.to(device=new.device))  # a registered buffer stays one
        self._dequant_cache = None
        return self

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # input_scale is optional: materialize the buffer when the checkpoint carries one so that a
        # freshly constructed module can load a calibrated checkpoint.
        if prefix + "input_scale" in state_dict and self.input_scale is None:
            self.input_scale = torch.ones((), dtype=torch.float32, device=self.weight.device)
        self._dequant_cache = None
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fmt={self.fmt}, cache_dequantized={self.cache_dequantized}, "
            f"input_scale={'set' if self.input_scale is not None else 'none'}"
        )


# ----------------------------------------------------------------------------------------------------
# Model-level quantization
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantPreset:
    """Which ``nn.Linear`` layers to leave dense, by module name.

    A layer is skipped when any component of its dotted name (e.g. ``layers.3.attn.q_proj``) is in
    ``skip``; matching whole components keeps ``gate`` (an MoE router) from also catching an MLP's
    ``gate_proj``. ``skip_modules`` skips exact modules (and everything under them); presets whose
    choice depends on the layer pattern fill it in :meth:`for_config`. ``kv_cache`` asks for FP8
    KV-cache scales beside the weights.
    """

    name: str
    skip: frozenset[str]
    description: str = ""
    skip_modules: frozenset[str] = frozenset()
    keep_mamba_before_attention: bool = False
    kv_cache: str | None = None

    def should_quantize(self, qualified_name: str) -> bool:
        if any(qualified_name == m or qualified_name.startswith(m + ".") for m in self.skip_modules):
            return False
        return not any(part in self.skip for part in qualified_name.split("."))

    def for_config(self, config: Any) -> QuantPreset:
        """This preset with the pattern-dependent modules of ``config`` (a ``HybridConfig``) resolved.

        ``keep_mamba_before_attention``: the in/out projections of the last Mamba layer before every
        attention layer stay dense (the Mamba layers that feed attention, NVIDIA's Nemotron 3 Nano recipe).
        """
        if not self.keep_mamba_before_attention:
            return self
        kinds = list(config.layer_kinds)
        kept = set(self.skip_modules)
        for i, kind in enumerate(kinds):
            if kind != "attention":
                continue
            before = [j for j in range(i) if kinds[j] == "mamba"]
            if before:
                kept |= {f"model.layers.{before[-1]}.mixer.in_proj", f"model.layers.{before[-1]}.mixer.out_proj"}
        return dataclasses.replace(self, skip_modules=frozenset(kept), keep_mamba_before_attention=False)


# The LM head and MoE routers are small and precision-critical (logits, top-k expert choice) in every
# preset; attention projections are sensitive in long-context use; Mamba in/out projections feed the
# SSM recurrence, where errors accumulate over time.
_ALWAYS_SKIP = frozenset({"lm_head", "gate", "router"})
_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
_MAMBA = frozenset({"in_proj", "out_proj"})

QUANT_PRESETS: dict[str, QuantPreset] = {
    "default": QuantPreset("default", _ALWAYS_SKIP | _ATTENTION, "quantize MLP/expert and Mamba projections"),
    "conservative": QuantPreset(
        "conservative", _ALWAYS_SKIP | _ATTENTION | _MAMBA, "quantize MLP/expert projections only"
    ),
    "all": QuantPreset("all", _ALWAYS_SKIP, "quantize everything except the LM head and routers"),
    # NVIDIA's published Nemotron 3 Nano NVFP4 checkpoint (its hf_quant_config.json and technical report):
    # routed and shared experts and the other Mamba projections quantized; attention projections, the Mamba
    # layers feeding attention, lm_head and routers in bf16; FP8 KV cache.
    "nemotron-nano": QuantPreset(
        "nemotron-nano",
        _ALWAYS_SKIP | _ATTENTION,
        "NVIDIA's Nemotron 3 Nano NVFP4 recipe: attention and the Mamba layers feeding it kept, FP8 KV cache",
        keep_mamba_before_attention=True,
        kv_cache="FP8",
    ),
}


def quantize_module(
    model: nn.Module,
    fmt: QuantFormat,
    preset: str | QuantPreset = "default",
    cache_dequantized: bool = False,
) -> list[str]:
    """Replace ``nn.Linear`` submodules of ``model`` by :class:`QuantLinear`, in place.

    Args:
        model: any module tree (the root itself is never replaced).
        fmt: ``"fp8"`` or ``"nvfp4"``.
        preset: a name in :data:`QUANT_PRESETS` or a :class:`QuantPreset`.
        cache_dequantized: passed to every new :class:`QuantLinear`.

    Returns:
        Sorted qualified names of the replaced layers.

    Raises:
        ValueError: unknown format/preset, or (nvfp4) a selected layer whose ``in_features`` is not a
            multiple of 16 -- named, so it can be excluded with a custom preset.
    """
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quantize_module: unknown format {fmt!r}; expected one of {QUANT_FORMATS}")
    if isinstance(preset, str):
        if preset not in QUANT_PRESETS:
            raise ValueError(f"quantize_module: unknown preset {preset!r}; expected one of {sorted(QUANT_PRESETS)}")
        preset = QUANT_PRESETS[preset]

    # Collect first, replace after: mutating children while iterating named_modules is unsafe.
    targets: list[tuple[nn.Module, str, str, nn.Linear]] = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and preset.should_quantize(qualified):
                if fmt == "nvfp4" and child.in_features % NVFP4_BLOCK_SIZE != 0:
                    raise ValueError(
                        f"quantize_module: layer {qualified!r} has in_features={child.in_features}; "
                        f"the input dimension must be a multiple of {NVFP4_BLOCK_SIZE} (NVFP4 block size)"
                    )
                targets.append((parent, child_name, qualified, child))

    # A Linear shared between several parents (weight tying by module reuse) is quantized once.
    converted: dict[int, QuantLinear] = {}
    for parent, child_name, _, child in targets:
        if id(child) not in converted:
            converted[id(child)] = QuantLinear.from_linear(child, fmt, cache_dequantized=cache_dequantized)
        setattr(parent, child_name, converted[id(child)])
    return sorted(qualified for _, _, qualified, _ in targets)


def bound_dequantized_caches(models: Sequence[nn.Module], max_bytes: int, dtype: torch.dtype) -> int:
    """Let the dense copies of quantized weights (``cache_dequantized``) take at most ``max_bytes``.

    The :class:`QuantLinear` modules of ``models`` (routed experts' included), model after model and each in
    module order (layer order), keep a dense copy in ``dtype`` (the activations' dtype, which the copy is
    made in at the first call) while the bound lasts; every other one is switched to dequantizing at every
    call and its copy, if any, dropped. A module shared by several models counts once. Returns the bytes
    the copies may take (what they take once every module has run)."""
    used, seen = 0, set()
    size = torch.empty((), dtype=dtype).element_size()
    for model in models:
        for module in model.modules():
            if not isinstance(module, QuantLinear) or id(module) in seen:
                continue
            seen.add(id(module))
            nbytes = module.out_features * module.in_features * size
            keep = used + nbytes <= max_bytes
            if module.cache_dequantized != keep:
                module.cache_dequantized = keep
                module.clear_cache()
            used += nbytes if keep else 0
    return used


def dense_copy_holders(models: Sequence[nn.Module]) -> list[QuantLinear]:
    """The :class:`QuantLinear` modules of ``models`` (routed experts' included) that keep a dense copy of their
    weight (``cache_dequantized``, as :func:`bound_dequantized_caches` leaves it), each once (a module shared by
    several models counts once), model after model in module order. A module makes its copy at its first call:
    :func:`held_dense_bytes` says what they hold at any time."""
    out, seen = [], set()
    for model in models:
        for module in model.modules():
            if isinstance(module, QuantLinear) and module.cache_dequantized and id(module) not in seen:
                seen.add(id(module))
                out.append(module)
    return out


def held_dense_bytes(modules: Sequence[QuantLinear]) -> int:
    """Bytes of the dense copies ``modules`` hold now (none before a module's first call, or after
    :meth:`QuantLinear.clear_cache`)."""
    return sum(cache.nbytes for m in modules if (cache := m._dequant_cache) is not None)
