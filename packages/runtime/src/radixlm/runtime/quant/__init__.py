"""Quantized weights: int8 / int4 / fp8 linear layers, quantized at load time or read from
GPTQ, AWQ and FP8 checkpoints (see `config.py` for the methods, `compute.py` for the kernels
each device runs)."""

from radixlm.runtime.quant.config import (
    GROUP_SIZES,
    QUANTIZATION_METHODS,
    QuantConfig,
    QuantizationError,
    checkpoint_quantization,
    gguf_file_quantization,
    resolve_quantization,
)
from radixlm.runtime.quant.linear import QuantizedLinear, QuantizedLinears, finalize_quantized

__all__ = [
    "GROUP_SIZES",
    "QUANTIZATION_METHODS",
    "QuantConfig",
    "QuantizationError",
    "QuantizedLinear",
    "QuantizedLinears",
    "checkpoint_quantization",
    "finalize_quantized",
    "gguf_file_quantization",
    "resolve_quantization",
]
