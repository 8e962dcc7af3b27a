"""Plain-torch references of every kernel, with the same signatures as the public functions.

They are the CPU path of the runtime and the ground truth the Triton kernels are tested
against. Every computation runs in fp32 and the result is cast back to the input dtype.
"""

from radixlm.kernels.reference.attention import decode_attention, extend_attention, store_kv
from radixlm.kernels.reference.elementwise import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from radixlm.kernels.reference.logits import (
    apply_token_bitmask_inplace,
    inverse_cdf,
    sample_from_probs,
    sample_tokens,
    sampling_thresholds,
    unpack_bitmask,
)
from radixlm.kernels.reference.lora import LoraPlan, lora_expand, lora_plan, lora_shrink
from radixlm.kernels.reference.moe import (
    MoePlan,
    fused_moe,
    grouped_matmul,
    moe_align,
    moe_per_expert_loop,
)
from radixlm.kernels.reference.quant import (
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
    "LoraPlan",
    "MoePlan",
    "apply_token_bitmask_inplace",
    "decode_attention",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int8",
    "dequantize_int8_grouped",
    "extend_attention",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "grouped_matmul",
    "int4_linear",
    "int8_grouped_linear",
    "int8_linear",
    "inverse_cdf",
    "lora_expand",
    "lora_plan",
    "lora_shrink",
    "moe_align",
    "moe_per_expert_loop",
    "pack_int4",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_int8_grouped",
    "rms_norm",
    "rotary_embedding",
    "sample_from_probs",
    "sample_tokens",
    "sampling_thresholds",
    "silu_and_mul",
    "store_kv",
    "unpack_bitmask",
    "unpack_int4",
]
