"""The Triton kernels, with the same signatures as the public functions.

Importing this module defines the kernels, so Triton's mode is fixed here: compiled for the
GPU, or interpreted on the CPU when ``TRITON_INTERPRET=1`` was set before the import
(``INTERPRETED`` records which). Call the public functions in :mod:`radixlm.kernels` rather
than these; they validate arguments and pick the backend.
"""

from radixlm.kernels.triton_ops._common import INTERPRETED
from radixlm.kernels.triton_ops.decode import decode_attention, default_num_kv_splits
from radixlm.kernels.triton_ops.elementwise import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    store_kv,
)
from radixlm.kernels.triton_ops.extend import extend_attention
from radixlm.kernels.triton_ops.logits import apply_token_bitmask_inplace, sample_from_probs
from radixlm.kernels.triton_ops.lora import lora_expand, lora_shrink
from radixlm.kernels.triton_ops.moe import fused_moe, grouped_matmul
from radixlm.kernels.triton_ops.quant import (
    fp8_linear,
    int4_linear,
    int8_grouped_linear,
    int8_linear,
)

__all__ = [
    "INTERPRETED",
    "apply_token_bitmask_inplace",
    "decode_attention",
    "default_num_kv_splits",
    "extend_attention",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "grouped_matmul",
    "int4_linear",
    "int8_grouped_linear",
    "int8_linear",
    "lora_expand",
    "lora_shrink",
    "rms_norm",
    "rotary_embedding",
    "sample_from_probs",
    "silu_and_mul",
    "store_kv",
]
