"""radixlm.runtime: the model runner — HF checkpoints, models, KV pool, attention, sampler."""

from radixlm.runtime._version import __version__
from radixlm.runtime.builtin import (
    BUILTIN_MODEL_NAME,
    BUILTIN_VISION_MODEL_NAME,
    SMOLLM2_MODEL_NAME,
    builtin_model_path,
    builtin_vision_model_path,
    smollm2_gguf_path,
)
from radixlm.runtime.config import (
    AttentionConfig,
    CacheConfig,
    DisaggregationConfig,
    EngineConfig,
    GrammarConfig,
    MediaConfig,
    MemoryConfig,
    ModelConfig,
    RunnerConfig,
    SamplerConfig,
    SchedulerConfig,
)
from radixlm.runtime.engine import Engine, Reply
from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch, InputLogprobRequest
from radixlm.runtime.loader import (
    ModelInfo,
    ModelLoadError,
    ModelNotFoundError,
    load_model,
    read_model_info,
)
from radixlm.runtime.logprobs import TokenLogprob
from radixlm.runtime.memory import KVPool, ReqToTokenPool
from radixlm.runtime.model_files import resolve_model_path
from radixlm.runtime.model_runner import LogitsOutput, ModelRunner, RunnerStats
from radixlm.runtime.models import supported_architectures
from radixlm.runtime.sampler import CustomProcessorsDisabled, SampleOutput, Sampler
from radixlm.runtime.sampling_batch import SamplingBatch, SamplingRequest
from radixlm.runtime.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

__all__ = [
    "BUILTIN_MODEL_NAME",
    "BUILTIN_VISION_MODEL_NAME",
    "SMOLLM2_MODEL_NAME",
    "AttentionConfig",
    "BatchEntry",
    "CacheConfig",
    "CustomProcessorsDisabled",
    "DisaggregationConfig",
    "Engine",
    "EngineConfig",
    "FlattenedTensorBucket",
    "FlattenedTensorMetadata",
    "ForwardBatch",
    "GrammarConfig",
    "InputLogprobRequest",
    "KVPool",
    "LogitsOutput",
    "MediaConfig",
    "MemoryConfig",
    "ModelConfig",
    "ModelInfo",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelRunner",
    "Reply",
    "ReqToTokenPool",
    "RunnerConfig",
    "RunnerStats",
    "SampleOutput",
    "Sampler",
    "SamplerConfig",
    "SamplingBatch",
    "SamplingRequest",
    "SchedulerConfig",
    "TokenLogprob",
    "__version__",
    "builtin_model_path",
    "builtin_vision_model_path",
    "load_model",
    "read_model_info",
    "resolve_model_path",
    "smollm2_gguf_path",
    "supported_architectures",
]
