"""Configuration of the model runner: small frozen dataclasses, composed, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DtypeName = Literal["auto", "bfloat16", "float16", "float32"]
LoadFormat = Literal["auto", "safetensors", "dummy"]
AttentionBackendName = Literal["auto", "torch_native", "triton"]
LogprobsMode = Literal["raw", "processed"]

_DTYPES = ("auto", "bfloat16", "float16", "float32")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
#: The KV pool's dtypes: the compute dtype ("auto"), a float dtype, or float8 (SGLang's names).
KV_CACHE_DTYPES = (*_DTYPES, "fp8_e4m3", "fp8_e5m2")
_KV_DTYPE_ALIASES = {**_DTYPE_ALIASES, "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
#: `quantization`: the runtime's `radixlm.runtime.quant.QUANTIZATION_METHODS` (kept here so the
#: config stays free of torch imports; a test keeps the two equal).
QUANTIZATION_METHODS = ("int8", "w8a8_int8", "int4", "fp8", "gptq", "awq")
_GROUP_SIZES = ("32", "64", "128")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_BACKENDS = ("auto", "torch_native", "triton")


def _choice(field_name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field_name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and where.

    `model_path` is a local Hugging Face model directory (or a hub id that is already in the
    local Hugging Face cache; nothing is ever downloaded). `dtype="auto"` keeps the checkpoint's
    dtype on GPUs and on CPUs that multiply it fast; on other CPUs a half-precision checkpoint
    computes in float32 (see `loader.choose_dtype`). `device="auto"` picks CUDA when available.
    `load_format="dummy"` builds random weights with the real shapes (benchmarks).
    `cpu_weight_packing` lets models on CPU keep their linear weights in oneDNN's packed layout
    (packed at the first forward; 1.3-2x faster GEMV/GEMM than F.linear there).
    `quantization` quantizes a full-precision checkpoint's linear layers as it loads (int8,
    w8a8_int8, int4 in groups of `quantization_group_size`, fp8) or names the method of a
    pre-quantized one (gptq, awq, fp8; read from its config.json when not given). See
    `radixlm.runtime.quant`.
    """

    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    context_length: int | None = None
    seed: int = 0
    show_progress: bool = True
    cpu_weight_packing: bool = True
    quantization: str | None = None
    quantization_group_size: int = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        _choice("dtype", self.dtype, _DTYPES)
        if self.quantization in ("none", ""):
            object.__setattr__(self, "quantization", None)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        _choice("quantization_group_size", str(self.quantization_group_size), _GROUP_SIZES)
        _choice("load_format", self.load_format, _LOAD_FORMATS)
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be positive; got {self.context_length}")


@dataclass(frozen=True)
class MemoryConfig:
    """How big the KV pool and the request table are.

    On CUDA the pool takes `kv_cache_fraction` of the memory left free after the weights are
    loaded; on CPU it takes `kv_cache_bytes` (default 1 GiB). `max_total_tokens` caps the pool
    on either device. `page_size` is the number of token slots per allocation unit.
    """

    kv_cache_fraction: float = 0.85
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None
    page_size: int = 1
    max_running_requests: int = 256
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "kv_cache_dtype",
            _KV_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype),
        )
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1]; got {self.kv_cache_fraction}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive; got {self.kv_cache_bytes}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be positive; got {self.max_total_tokens}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1; got {self.max_running_requests}")
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention backend runs, and whether decode steps replay CUDA graphs.

    `backend="auto"` is `triton` on CUDA (when radixlm-kernels can run there) and `torch_native`
    elsewhere. CUDA graphs are captured for the decode batch sizes in `cuda_graph_batch_sizes`
    (default 1, 2, 4, 8, then steps of 8 up to `cuda_graph_max_batch_size`); they are never used
    on CPU.
    """

    backend: str = "auto"
    cuda_graph: bool = True
    cuda_graph_max_batch_size: int = 64
    cuda_graph_batch_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _choice("attention backend", self.backend, _BACKENDS)
        if self.cuda_graph_max_batch_size < 1:
            raise ValueError(
                f"cuda_graph_max_batch_size must be >= 1; got {self.cuda_graph_max_batch_size}"
            )

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture, ascending."""
        if self.cuda_graph_batch_sizes is not None:
            return tuple(sorted(set(self.cuda_graph_batch_sizes)))
        limit = self.cuda_graph_max_batch_size
        sizes = [s for s in (1, 2, 4, 8) if s <= limit]
        sizes += list(range(16, limit + 1, 8))
        if sizes[-1] != limit:
            sizes.append(limit)
        return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class SamplerConfig:
    """Sampler options that are the operator's choice, not the request's.

    `logprobs_mode="raw"` reports log-probabilities of the model's own distribution (before
    penalties, bias, masks and temperature); `"processed"` reports those of the distribution
    actually sampled from (after everything but top-k/top-p/min-p).
    `enable_custom_logit_processor` must be set for requests' custom logit processors to run.
    """

    logprobs_mode: str = "raw"
    enable_custom_logit_processor: bool = False

    def __post_init__(self) -> None:
        _choice("logprobs_mode", self.logprobs_mode, ("raw", "processed"))


@dataclass(frozen=True)
class RunnerConfig:
    """Everything the model runner needs, composed by feature."""

    model: ModelConfig
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
