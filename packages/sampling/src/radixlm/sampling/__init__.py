"""radixlm.sampling: the sampling-parameter and /generate request schema, validated."""

from radixlm.sampling._version import __version__
from radixlm.sampling.defaults import GENERATION_CONFIG_FIELDS, DefaultsMode, SamplingDefaults
from radixlm.sampling.embedding import EmbeddingOutput, EmbeddingRequest
from radixlm.sampling.errors import EngineOverloaded, EngineUnavailable, FieldError, InvalidRequest
from radixlm.sampling.limits import check_text_fits, max_token_chars
from radixlm.sampling.logit_processor import CustomLogitProcessor
from radixlm.sampling.outputs import FinishReason, GenerateChunk, LogprobEntry
from radixlm.sampling.params import CONSTRAINT_FIELDS, RepetitionDetection, SamplingParams
from radixlm.sampling.request import GenerateRequest

__all__ = [
    "CONSTRAINT_FIELDS",
    "GENERATION_CONFIG_FIELDS",
    "CustomLogitProcessor",
    "DefaultsMode",
    "EmbeddingOutput",
    "EmbeddingRequest",
    "EngineOverloaded",
    "EngineUnavailable",
    "FieldError",
    "FinishReason",
    "GenerateChunk",
    "GenerateRequest",
    "InvalidRequest",
    "LogprobEntry",
    "RepetitionDetection",
    "SamplingDefaults",
    "SamplingParams",
    "__version__",
    "check_text_fits",
    "max_token_chars",
]
