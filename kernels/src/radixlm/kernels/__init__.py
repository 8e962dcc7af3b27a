"""Triton kernels for LLM serving, each beside a plain-torch reference of the same signature.

Every public function validates its arguments, then runs the Triton kernel on CUDA tensors
(when Triton is installed) and the torch reference otherwise; :func:`use_backend` forces
either, and :func:`available` tells whether Triton can run here at all. The references alone
live in :mod:`radixlm.kernels.reference`.
"""

from radixlm.kernels import cpu
from radixlm.kernels._backend import (
    BackendName,
    available,
    get_backend,
    interpreter_enabled,
    use_backend,
)
from radixlm.kernels._version import __version__
from radixlm.kernels.attention import decode_attention, extend_attention, store_kv
from radixlm.kernels.elementwise import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from radixlm.kernels.logits import (
    apply_token_bitmask_inplace,
    greedy_tokens,
    sample_from_probs,
    sample_tokens,
)
from radixlm.kernels.lora import LoraPlan, lora_expand, lora_plan, lora_shrink
from radixlm.kernels.moe import MoePlan, fused_moe, grouped_matmul, moe_align
from radixlm.kernels.quant import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    dequantize_int8_grouped,
    fp8_linear,
    int4_linear,
    int8_grouped_linear,
    int8_linear,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_int8_grouped,
    unpack_int4,
)

__all__ = [
    "BackendName",
    "LoraPlan",
    "MoePlan",
    "__version__",
    "apply_token_bitmask_inplace",
    "available",
    "cpu",
    "decode_attention",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int8",
    "dequantize_int8_grouped",
    "extend_attention",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "get_backend",
    "greedy_tokens",
    "grouped_matmul",
    "int4_linear",
    "int8_grouped_linear",
    "int8_linear",
    "interpreter_enabled",
    "lora_expand",
    "lora_plan",
    "lora_shrink",
    "moe_align",
    "pack_int4",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_int8_grouped",
    "rms_norm",
    "rotary_embedding",
    "sample_from_probs",
    "sample_tokens",
    "silu_and_mul",
    "store_kv",
    "unpack_int4",
    "use_backend",
]
