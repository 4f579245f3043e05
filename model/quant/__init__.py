"""Low-precision weight formats: FP8 E4M3 (per-tensor scale) and NVFP4 (E2M1 + fp8 block scales).

Pure-PyTorch reference implementations of the formats' definitions, a quantized ``nn.Linear``
replacement, quantized stacked experts, helpers that slice quantized tensors so nested sub-networks
survive quantization, and quantized checkpoints (write once, extract any budget).
"""

from .checkpoint import (
    QUANT_ALGOS,
    build_quantized_model,
    calibrate_input_amax,
    dequantize_model,
    load_quantized_model,
    quantization_config,
    quantize_model,
    quantized_format,
)
from .experts import DEFAULT_CACHE_DEQUANTIZED, QuantExpert, QuantExperts
from .fp8 import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    AmaxObserver,
    calibrate_input_scale,
    dequantize_fp8,
    fake_quantize_fp8_activation,
    quantize_fp8,
)
from .nesting import check_nvfp4_alignment, extract_quantized_budget, load_quantized_budget
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
from .qlinear import (
    QUANT_FORMATS,
    QUANT_PRESETS,
    QuantFormat,
    QuantLinear,
    QuantPreset,
    bound_dequantized_caches,
    dense_copy_holders,
    held_dense_bytes,
    quantize_module,
)
from .quantize import quantize_checkpoint

__all__ = [
    "DEFAULT_CACHE_DEQUANTIZED",
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "NVFP4_BLOCK_SIZE",
    "QUANT_ALGOS",
    "QUANT_FORMATS",
    "QUANT_PRESETS",
    "AmaxObserver",
    "QuantExpert",
    "QuantExperts",
    "QuantFormat",
    "QuantLinear",
    "bound_dequantized_caches",
    "dense_copy_holders",
    "held_dense_bytes",
    "QuantPreset",
    "build_quantized_model",
    "calibrate_input_amax",
    "calibrate_input_scale",
    "check_nvfp4_alignment",
    "compute_nvfp4_block_scales",
    "decode_e2m1",
    "dequantize_fp8",
    "dequantize_model",
    "dequantize_nvfp4",
    "encode_e2m1",
    "extract_quantized_budget",
    "load_quantized_budget",
    "load_quantized_model",
    "fake_quantize_fp8_activation",
    "nvfp4_error_bound",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantization_config",
    "quantize_checkpoint",
    "quantize_fp8",
    "quantize_model",
    "quantize_module",
    "quantize_nvfp4",
    "quantized_format",
    "slice_nvfp4",
    "unpack_e2m1",
]
