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
from radixlm.runtime.models.linear import Linear, LinearFactory, ReplicatedLinears
from radixlm.runtime.models.registry import (
    ModelFamily,
    UnsupportedArchitecture,
    register,
    resolve,
    supported_architectures,
)

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
