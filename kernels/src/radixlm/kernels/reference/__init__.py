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
    sample_from_probs,
    sampling_thresholds,
    unpack_bitmask,
)

__all__ = [
    "apply_token_bitmask_inplace",
    "decode_attention",
    "extend_attention",
    "fused_add_rms_norm",
    "rms_norm",
    "rotary_embedding",
    "sample_from_probs",
    "sampling_thresholds",
    "silu_and_mul",
    "store_kv",
    "unpack_bitmask",
]
