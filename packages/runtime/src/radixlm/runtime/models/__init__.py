"""Model families, registered by their Hugging Face `architectures` name."""

from radixlm.runtime.models import llama, mistral, qwen2, qwen3  # noqa: F401  (registration)
from radixlm.runtime.models import llava  # noqa: F401, I001  (registration, after its text families)
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
