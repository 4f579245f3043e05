"""Low-precision weight formats: FP8 E4M3 (per-tensor scale) and NVFP4 (E2M1 + fp8 block scales).

Pure-PyTorch reference implementations of the formats' definitions, a quantized ``nn.Linear``
replacement, and helpers that slice quantized tensors so nested sub-networks survive quantization.
"""

from .fp8 import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    AmaxObserver,
    calibrate_input_scale,
    dequantize_fp8,
    fake_quantize_fp8_activation,
    quantize_fp8,
)
from .nvfp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    NVFP4_BLOCK_SIZE,
    compute_nvfp4_block_scales,
    decode_e2m1,
    dequantize_nvfp4,
    encode_e2m1,
    nvfp4_error_bound,
    nvfp4_global_scale,
    pack_e2m1,
    quantize_nvfp4,
    slice_nvfp4,
    unpack_e2m1,
)
from .qlinear import QUANT_FORMATS, QUANT_PRESETS, QuantFormat, QuantLinear, QuantPreset, quantize_module

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "NVFP4_BLOCK_SIZE",
    "QUANT_FORMATS",
    "QUANT_PRESETS",
    "AmaxObserver",
    "QuantFormat",
    "QuantLinear",
    "QuantPreset",
    "calibrate_input_scale",
    "compute_nvfp4_block_scales",
    "decode_e2m1",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "encode_e2m1",
    "fake_quantize_fp8_activation",
    "nvfp4_error_bound",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantize_fp8",
    "quantize_module",
    "quantize_nvfp4",
    "slice_nvfp4",
    "unpack_e2m1",
]
