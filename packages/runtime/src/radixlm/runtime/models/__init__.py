"""Model families, registered by their Hugging Face `architectures` name."""

from radixlm.runtime.models import (  # noqa: F401  (registration)
    llama,
    llava,
    mistral,
    mixtral,
    qwen2,
    qwen2_vl,
    qwen3,
    qwen_moe,
)
from radixlm.runtime.models.arch import ArchConfig, RopeConfig
from radixlm.runtime.models.decoder import DecoderForCausalLM
from radixlm.runtime.models.decoder_pooling import register_pooling_families
from radixlm.runtime.models.linear import Linear, LinearFactory, ReplicatedLinears
from radixlm.runtime.models.registry import (
    ModelFamily,
    UnsupportedArchitecture,
    register,
    resolve,
    supported_architectures,
)

# The pooling variants (`Qwen3Model`, `LlamaForSequenceClassification`, ...) of the causal
# families registered above.
register_pooling_families()

__all__ = [
    "ArchConfig",
    "DecoderForCausalLM",
    "Linear",
    "LinearFactory",
    "ModelFamily",
    "ReplicatedLinears",
    "RopeConfig",
    "UnsupportedArchitecture",
    "register",
    "resolve",
    "supported_architectures",
]
