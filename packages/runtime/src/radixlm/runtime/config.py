"""The runtime's configuration: small frozen dataclasses composed by feature, passed explicitly.

`RunnerConfig` (model, memory, attention, sampler) is what the model runner needs;
`EngineConfig` adds the scheduler, the radix cache, structured output and the engine's own
options. `EngineConfig.from_kwargs(model_path, **kwargs)` maps SGLang-style keyword arguments
(`mem_fraction_static`, `schedule_policy`, `disable_radix_cache`, ...) onto them; unknown names
raise TypeError with the closest known one. Every choice is a `Literal` type written once
here; `ENGINE_CHOICES` gives the CLI the allowed values of each keyword. Invalid values are
errors, never rewritten.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

DtypeName = Literal["auto", "bfloat16", "float16", "float32"]
#: The KV pool's dtypes: the compute dtype ("auto"), a float dtype, or float8 (SGLang's names).
KvCacheDtype = Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"]
LoadFormat = Literal["auto", "safetensors", "dummy"]
#: `quantization`: computed at load time (int8, w8a8_int8, int4, fp8) or a pre-quantized
#: checkpoint's method (gptq, awq, fp8); `radixlm.runtime.quant` takes the names from here.
QuantizationMethod = Literal["int8", "w8a8_int8", "int4", "fp8", "gptq", "awq", "gguf", "none"]
AttentionBackendName = Literal["auto", "torch_native", "triton"]
LogprobsMode = Literal["raw", "processed"]
SchedulePolicy = Literal["lpm", "dfs-weight", "fcfs", "random"]
EvictionPolicy = Literal["lru", "lfu"]
HiCacheWritePolicy = Literal["write_through", "write_back", "write_through_selective"]
HiCacheStorageBackend = Literal["file"]
HiCacheHostDtype = Literal["auto", "bfloat16", "float8_e4m3fn"]
#: The structured-output backends an engine can be started with (`auto` picks per constraint
#: among the installed ones; `none` refuses constraints).
GrammarBackendName = Literal["auto", "xgrammar", "llguidance", "outlines", "none"]
JsonWhitespace = Literal["compact", "flexible"]
SamplingDefaultsMode = Literal["model", "openai"]
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
#: The torch.distributed backend of tensor parallelism (`auto`: nccl on CUDA, gloo on CPU).
DistBackend = Literal["auto", "gloo", "nccl"]
#: `speculative_algorithm` (SGLang's names): drafts from n-grams of the request's own tokens
#: and of the radix cache, a standalone draft model, or EAGLE heads.
SpeculativeAlgorithm = Literal["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"]
#: `disaggregation_mode` (SGLang's names): `null` runs prefill and decode in this engine; a
#: `prefill` engine computes prompts and sends their K/V to the decode engine of each request;
#: a `decode` engine takes prompts' K/V from prefill engines and decodes.
DisaggregationMode = Literal["null", "prefill", "decode"]
#: How K/V crosses from a prefill engine to a decode engine: ZeroMQ over TCP, shared memory on
#: one host (metadata over ZeroMQ), or the RDMA libraries SGLang drives (named, not driven).
TransferBackendName = Literal["tcp", "shm", "nixl", "mooncake"]

DTYPES: tuple[str, ...] = get_args(DtypeName)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
QUANTIZATION_METHODS: tuple[str, ...] = get_args(QuantizationMethod)
GRAMMAR_BACKENDS: tuple[str, ...] = get_args(GrammarBackendName)
SPECULATIVE_ALGORITHMS: tuple[str, ...] = get_args(SpeculativeAlgorithm)
#: The ones this version runs (the CLI offers only these).
SPECULATIVE_AVAILABLE: tuple[str, ...] = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
_KV_DTYPE_ALIASES = {**_DTYPE_ALIASES, "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}


def _choice(field_name: str, value: object, allowed: Any) -> None:
    """Refuse a value outside a Literal type's choices (or a tuple of them)."""
    choices = get_args(allowed) or tuple(allowed)
    if value not in choices:
        names = ", ".join(str(c) for c in choices)
        raise ValueError(f"{field_name} must be one of {names}; got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and where.

    `model_path` is a Hugging Face model directory, a GGUF file (or a directory holding one),
    a hub id (downloaded through `huggingface_hub` at `revision` into `download_dir`, or the
    Hugging Face cache; with `HF_HUB_OFFLINE=1` only a copy already there is used), or the
    name of a built-in model (see `radixlm.runtime.model_files`). `dtype="auto"` keeps the checkpoint's
    dtype on GPUs and on CPUs that multiply it fast; on other CPUs a half-precision checkpoint
    computes in float32 (see `loader.choose_dtype`). `device="auto"` picks CUDA when available.
    `load_format="dummy"` builds random weights with the real shapes (benchmarks).
    `cpu_weight_packing` lets models on CPU keep their linear weights in oneDNN's packed layout
    (packed at the first forward; 1.3-2x faster GEMV/GEMM than F.linear there).
    `quantization` quantizes a full-precision checkpoint's linear layers as it loads (int8,
    w8a8_int8, int4 in groups of `quantization_group_size`, 32 by default as llama.cpp's blocks, fp8) or names the method of a
    pre-quantized one (gptq, awq, fp8; read from its config.json when not given; gguf: a GGUF
    file's own 4-bit weights, its default). `none` runs every layer in the compute dtype (a
    GGUF file's weights dequantized). See `radixlm.runtime.quant`. `ep_size`: expert parallelism for a mixture-of-experts model
    (its experts placed on `ep_size` groups of the tensor-parallel ranks; must divide
    `tp_size` and the number of experts).
    """

    model_path: str
    dtype: DtypeName = "auto"
    device: str = "auto"
    load_format: LoadFormat = "auto"
    context_length: int | None = None
    seed: int = 0
    show_progress: bool = True
    cpu_weight_packing: bool = True
    quantization: QuantizationMethod | None = None
    quantization_group_size: int = 32
    ep_size: int = 1
    revision: str | None = None
    download_dir: str | None = None
    #: SGLang's `--is-embedding`: serve a causal LM as an embedder (last-token pooling).
    #: Embedding, classification and reward checkpoints are pooling models without it.
    is_embedding: bool = False
    #: A pooling model's rows pooled: "last", "mean" or "cls" (None: the checkpoint's
    #: sentence-transformers config, else the architecture's default).
    pooling_method: str | None = None
    #: Whether embeddings are L2-normalised (None: the checkpoint's sentence-transformers
    #: config, else yes).
    normalize_embeddings: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_method not in (None, "last", "mean", "cls"):
            raise ValueError(
                f"pooling_method must be last, mean or cls; got {self.pooling_method!r}"
            )
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1; got {self.ep_size}")
        # Spellings of the same dtype (bf16, fp16, half, fp32) are taken as their full names.
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        _choice("dtype", self.dtype, DtypeName)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QuantizationMethod)
        _choice("quantization_group_size", self.quantization_group_size, QUANTIZATION_GROUP_SIZES)
        _choice("load_format", self.load_format, LoadFormat)
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be positive; got {self.context_length}")


@dataclass(frozen=True)
class MemoryConfig:
    """How big the KV pool and the request table are.

    On CUDA the pool takes `kv_cache_fraction` of the memory left free after the weights are
    loaded; on CPU it takes `kv_cache_bytes` (default 1 GiB). `max_total_tokens` caps the pool
    on either device. `page_size` is the number of token slots per allocation unit.
    `max_running_requests` sizes the request-to-token table: the most requests that run (are
    decoded) at once; the scheduler admits no more.
    """

    kv_cache_fraction: float = 0.85
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None
    page_size: int = 1
    max_running_requests: int = 256
    kv_cache_dtype: KvCacheDtype = "auto"

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
        _choice("kv_cache_dtype", self.kv_cache_dtype, KvCacheDtype)


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention backend runs, and whether decode steps replay CUDA graphs.

    `backend="auto"` is `triton` on CUDA (when radixlm-kernels can run there) and `torch_native`
    elsewhere. CUDA graphs are captured for the decode batch sizes in `cuda_graph_batch_sizes`
    (default 1, 2, 4, 8, then steps of 8 up to `cuda_graph_max_batch_size`); they are never used
    on CPU.
    """

    backend: AttentionBackendName = "auto"
    cuda_graph: bool = True
    cuda_graph_max_batch_size: int = 64
    cuda_graph_batch_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _choice("attention_backend", self.backend, AttentionBackendName)
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

    logprobs_mode: LogprobsMode = "raw"
    enable_custom_logit_processor: bool = False

    def __post_init__(self) -> None:
        _choice("logprobs_mode", self.logprobs_mode, LogprobsMode)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism on torch.distributed (SGLang's flags).

    - `tp_size`: ranks the model is split across (attention heads, MLP columns, vocabulary);
      each rank is a process with its own shard of the weights and of the KV pool. Rank 0
      runs the scheduler and sends every step to the others.
    - `backend`: `auto` (nccl on CUDA, gloo on CPU), `gloo` or `nccl`.
    - `nnodes`, `node_rank`, `dist_init_addr` (HOST:PORT of node 0, where every rank meets):
      the ranks spread over several machines, `tp_size / nnodes` on each; node 0 serves.
    - `timeout`: seconds a collective may wait for the other ranks before the engine gives up
      (a rank that died or hangs takes the engine down after at most this long).
    """

    tp_size: int = 1
    backend: DistBackend = "auto"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    timeout: float = 300.0

    def __post_init__(self) -> None:
        _choice("dist_backend", self.backend, DistBackend)
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1; got {self.tp_size}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1; got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes - 1] = [0, {self.nnodes - 1}]; "
                f"got {self.node_rank}"
            )
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): "
                "every node runs the same number of ranks"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(
                "nnodes > 1 needs dist_init_addr (HOST:PORT of node 0, reachable from every "
                "node), e.g. --dist-init-addr 10.0.0.1:5000"
            )
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"dist_init_addr must be HOST:PORT (e.g. 10.0.0.1:5000); "
                    f"got {self.dist_init_addr!r}"
                )
        if self.timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0 seconds; got {self.timeout}")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served over the base model (SGLang's flags).

    - `enabled`: build the adapter pool (implied by `paths`), so adapters can be loaded at
      run time too.
    - `paths`: (name, PEFT adapter directory) loaded at start.
    - `max_loras_per_batch`: adapter slots of the pool, the most distinct adapters in one
      batch (requests without an adapter take none).
    - `max_rank`: the largest rank the pool holds (None: the largest of `paths`, or 16).
    - `target_modules`: the projections the pool adapts (None: those `paths` target, or all
      of q/k/v/o/gate/up/down when there are none).
    """

    enabled: bool = False
    paths: tuple[tuple[str, str], ...] = ()
    max_loras_per_batch: int = 8
    max_rank: int | None = None
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1; got {self.max_loras_per_batch}")
        if self.max_rank is not None and self.max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1; got {self.max_rank}")
        names = [name for name, _ in self.paths]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"lora_paths: adapter name(s) given twice: {', '.join(twice)}")

    @property
    def active(self) -> bool:
        return self.enabled or bool(self.paths)


#: The decoder projections a LoRA adapter may target (Hugging Face names).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_paths(value: Any) -> tuple[tuple[str, str], ...]:
    """SGLang's `lora_paths`: a {name: path} mapping, or a list of `name=path` strings,
    bare paths (named after themselves) and {"lora_name", "lora_path"} objects."""
    if not value:
        return ()
    if isinstance(value, Mapping):
        return tuple((str(name), str(path)) for name, path in value.items())
    if isinstance(value, str):
        value = [value]
    pairs: list[tuple[str, str]] = []
    for item in value:
        if isinstance(item, Mapping):
            if "lora_name" not in item or "lora_path" not in item:
                raise ValueError(f"lora_paths: {item!r} needs lora_name and lora_path")
            pairs.append((str(item["lora_name"]), str(item["lora_path"])))
        elif isinstance(item, tuple | list) and len(item) == 2:
            pairs.append((str(item[0]), str(item[1])))
        else:
            name, sep, path = str(item).partition("=")
            pairs.append((name, path) if sep else (str(item), str(item)))
    return tuple(pairs)


def _target_modules(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    if items == ["all"]:
        return LORA_TARGET_MODULES
    return tuple(str(item) for item in items)


@dataclass(frozen=True)
class RunnerConfig:
    """Everything the model runner needs, composed by feature.

    `deterministic` (SGLang's `--enable-deterministic-inference`): batch-invariant inference.
    Every forward runs through radixlm's C kernels (`radixlm.runtime.cpu_decode`), whose
    products, attention and norms give a token's row the same bits whatever else is in the
    step, and every request samples from its own seed (the engine's `random_seed` when it
    gives none): a request's tokens and logprobs do not depend on what it was batched with, on
    chunk sizes or on cache hits, nor on speculative decoding's drafts (a draft is accepted
    when it is the token the request draws at its position). CPU only, float32 models with
    float32, int8 or int4 projections, no tensor parallelism or LoRA (refused with a message).
    """

    model: ModelConfig
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    deterministic: bool = False

    def __post_init__(self) -> None:
        if not self.deterministic:
            return
        if self.parallel.tp_size > 1:
            raise ValueError(
                "enable_deterministic_inference runs every step through the CPU kernels, "
                "which do not split the model: drop tp_size or the deterministic mode"
            )
        if self.lora.active:
            raise ValueError(
                "enable_deterministic_inference does not cover LoRA adapters yet: serve "
                "without adapters or drop the deterministic mode"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler picks work.

    - `schedule_policy`: `lpm` (longest cached prefix first), `dfs-weight` (depth-first over
      the prefix tree of the queue), `fcfs`, `random`. The prefix-aware ones fall back to
      fcfs with more than `policy_fallback_queue_len` requests waiting.
    - `chunked_prefill_size`: prefill tokens per step; a longer prompt is prefilled in chunks
      (None, or SGLang's -1 through `from_kwargs`: no chunking, the budget is
      `max_prefill_tokens` but one prompt may exceed it).
    - `enable_mixed_chunk`: prefill chunks ride in the same forward as decode steps.
    - `max_queued_requests` (None: unbounded; beyond it new requests are refused with
      `EngineOverloaded`). How many run at once is the memory's `max_running_requests`.
    - `init_new_token_ratio` .. `new_token_ratio_decay`: the share of each running request's
      remaining `max_new_tokens` kept free for its decode when admitting new requests; it
      decays step by step and resets when requests had to be retracted.
    - `in_batch_prefix_min`: a queued request that shares at least this many uncached tokens
      with a request admitted before it and still in prefill (or all its uncached tokens but
      the last, however few) waits a step, so it reuses them from the cache. 0: never waits.
    - `enable_priority_scheduling` (SGLang's flag): requests carry a `priority`; the queue is
      ordered by it first (the policy orders requests of equal priority), a waiting request
      whose priority beats a running one's by at least
      `priority_scheduling_preemption_threshold` preempts it (it goes back to the queue, its
      computed tokens to the cache) when it could not run otherwise, and a full queue makes
      room for a request by refusing its lowest-priority waiting one. A larger value is a
      higher priority unless `schedule_low_priority_values_first`.
    """

    schedule_policy: SchedulePolicy = "lpm"
    policy_fallback_queue_len: int = 128
    chunked_prefill_size: int | None = 2048
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = True
    max_queued_requests: int | None = None
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    clip_max_new_tokens: int = 4096
    in_batch_prefix_min: int = 32
    random_seed: int = 0
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10

    def __post_init__(self) -> None:
        _choice("schedule_policy", self.schedule_policy, SchedulePolicy)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(
                "chunked_prefill_size must be >= 1 tokens (or -1: no chunking); got "
                f"{self.chunked_prefill_size}"
            )
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1; got {self.max_prefill_tokens}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0; got {self.max_queued_requests}")
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError(
                "priority_scheduling_preemption_threshold must be >= 0; got "
                f"{self.priority_scheduling_preemption_threshold}"
            )

    @property
    def prefill_budget(self) -> int:
        """Prefill tokens one step may compute."""
        if self.chunked_prefill_size is None:
            return self.max_prefill_tokens
        return min(self.chunked_prefill_size, self.max_prefill_tokens)


@dataclass(frozen=True)
class CacheConfig:
    """The radix (prefix) cache: `disable_radix_cache` turns reuse off (for comparisons);
    `eviction_policy` is `lru` or `lfu`.

    The hierarchical cache (SGLang's HiCache flags): with `hierarchical`, what the KV pool
    evicts moves to a host-memory pool (L2) instead of being dropped, and comes back when a
    prompt's prefix is found there, instead of being computed again.

    - `hicache_ratio`: the host pool's size as a multiple of the KV pool's tokens (default
      2); `hicache_size`: its size in GB instead (0: use the ratio).
    - `hicache_write_policy`: `write_through` (pages are copied down as soon as they are
      cached), `write_back` (on eviction), `write_through_selective` (down at once once a
      prefix is hit again, else on eviction).
    - `hicache_storage_backend`: None, or `file`: a storage tier (L3) under the host pool,
      one file per page named by its prefix hash in `hicache_storage_dir`, kept across
      restarts and shareable by replicas of the same model.
    - `hicache_page_size`: tokens per page of the lower tiers (a multiple of the KV pool's
      page size; default 64).
    - `hicache_host_dtype`: `auto` (the KV pool's dtype: exact), or `bfloat16` /
      `float8_e4m3fn` to hold more tokens per byte (the K/V read back are rounded).
    """

    disable_radix_cache: bool = False
    eviction_policy: EvictionPolicy = "lru"
    hierarchical: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: HiCacheWritePolicy = "write_through"
    hicache_storage_backend: HiCacheStorageBackend | None = None
    hicache_storage_dir: str | None = None
    hicache_page_size: int = 64
    hicache_host_dtype: HiCacheHostDtype = "auto"

    def __post_init__(self) -> None:
        _choice("radix_eviction_policy", self.eviction_policy, EvictionPolicy)
        _choice("hicache_write_policy", self.hicache_write_policy, HiCacheWritePolicy)
        _choice("hicache_host_dtype", self.hicache_host_dtype, HiCacheHostDtype)
        if self.hicache_storage_backend is not None:
            _choice("hicache_storage_backend", self.hicache_storage_backend, HiCacheStorageBackend)
        if self.hicache_ratio <= 0:
            raise ValueError(f"hicache_ratio must be > 0; got {self.hicache_ratio}")
        if self.hicache_size < 0:
            raise ValueError(f"hicache_size must be >= 0 GB; got {self.hicache_size}")
        if self.hicache_page_size < 1:
            raise ValueError(f"hicache_page_size must be >= 1 tokens; got {self.hicache_page_size}")
        if self.hicache_storage_backend == "file" and not self.hicache_storage_dir:
            raise ValueError(
                "hicache_storage_backend='file' needs hicache_storage_dir (the directory its "
                "page files go to)"
            )
        if self.hierarchical and self.disable_radix_cache:
            raise ValueError(
                "enable_hierarchical_cache needs the radix cache: drop disable_radix_cache"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (SGLang's `--speculative-*` flags).

    - `algorithm`: None (off), `NGRAM` — drafts are the tokens that followed the latest
      earlier occurrence of the sequence's last n-gram in its own tokens, or what the radix
      cache holds after the whole sequence — or `STANDALONE`: a draft model
      (`draft_model_path`, any model this engine loads that shares the target's tokenizer,
      e.g. the target itself quantized with `draft_model_quantization="int4"`) proposes its
      greedy continuation — or `EAGLE` / `EAGLE3`: a draft head trained over the target's
      features (`draft_model_path`, the published checkpoint layouts).
    - `draft_model_quantization`: how the draft model's weights load (as `quantization`).
    - `num_draft_tokens`: tokens one verify step computes per request: its last token and up
      to `num_draft_tokens - 1` drafts (default `num_steps + 1`).
    - `num_steps`: draft tokens proposed per step (default 4).
    - `eagle_topk`: branches per draft position; 1 (a chain) is what is verified so far.
    - `ngram_min_match_window_size` / `ngram_max_match_window_size`: the n-gram lengths
      looked up, longest first.
    - `disable_by_batch_size`: no drafts in a step with more decoding requests than this (a
      full batch gains nothing from them); None: always draft.
    """

    algorithm: SpeculativeAlgorithm | None = None
    draft_model_path: str | None = None
    draft_model_quantization: QuantizationMethod | None = None
    num_steps: int | None = None
    eagle_topk: int = 1
    num_draft_tokens: int | None = None
    ngram_min_match_window_size: int = 1
    ngram_max_match_window_size: int = 12
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm is None:
            return
        _choice("speculative_algorithm", self.algorithm, SpeculativeAlgorithm)
        if self.algorithm not in SPECULATIVE_AVAILABLE:
            raise ValueError(
                f"speculative_algorithm {self.algorithm} is not available in this version of "
                "radixlm; use NGRAM (drafts from the request's own tokens and the radix cache)"
            )
        if self.algorithm == "NGRAM" and self.draft_model_path is not None:
            raise ValueError(
                "speculative_draft_model_path is for STANDALONE / EAGLE drafts; NGRAM drafts "
                "need no model: drop it"
            )
        if self.algorithm == "STANDALONE" and self.draft_model_path is None:
            raise ValueError(
                "speculative_algorithm STANDALONE needs speculative_draft_model_path: a model "
                "with the target's tokenizer (the target's own path with "
                "speculative_draft_model_quantization='int4' makes a quantized copy)"
            )
        if self.algorithm in ("EAGLE", "EAGLE3") and self.draft_model_path is None:
            raise ValueError(
                f"speculative_algorithm {self.algorithm} needs speculative_draft_model_path: "
                "the directory of an EAGLE head trained for the target model"
            )
        if self.draft_model_quantization is not None:
            _choice(
                "speculative_draft_model_quantization",
                self.draft_model_quantization,
                QuantizationMethod,
            )
        if self.eagle_topk != 1:
            raise ValueError(
                f"speculative_eagle_topk must be 1 (chain drafts); got {self.eagle_topk}: tree "
                "drafts are not verified by this version"
            )
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1; got {self.num_steps}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 2:
            raise ValueError(
                "speculative_num_draft_tokens must be >= 2 (the last token and at least one "
                f"draft); got {self.num_draft_tokens}"
            )
        low, high = self.ngram_min_match_window_size, self.ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "need 1 <= speculative_ngram_min_match_window_size <= "
                f"speculative_ngram_max_match_window_size; got {low} and {high}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_disable_by_batch_size must be >= 1; got {self.disable_by_batch_size}"
            )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def max_draft(self) -> int:
        """Draft tokens one request may have verified in a step."""
        if self.num_draft_tokens is not None:
            drafts = self.num_draft_tokens - 1
            return drafts if self.num_steps is None else min(drafts, self.num_steps)
        return self.num_steps if self.num_steps is not None else 4


@dataclass(frozen=True)
class GrammarConfig:
    """Structured output.

    - `backend`: `auto` (per constraint, the installed backend that enforces all of it,
      validating completed JSON values for keywords no grammar can enforce), `xgrammar`,
      `llguidance`, `outlines`, or `none` (constraints are refused).
    - `strict`: the default of a request's `strict_constraint`: refuse a constraint unless the
      grammar alone enforces all of it (no validation and rollback).
    - `max_constraint_bytes`: size above which a constraint is refused (a 400).
    - `jump_forward` appends the tokens a grammar forces and computes them in one extend step;
      `json_whitespace` compact | flexible; `compile_timeout` in seconds (past it, a 400);
      `cache_size` compiled grammars kept.
    - `schema_dir`: a directory of JSON schemas that a JSON-schema constraint may refer to
      (`$ref`): every `*.json` file under it, found by its path relative to the directory
      (`{"$ref": "address.json"}`) and by its `$id`. Read when the engine starts; nothing is
      ever fetched over the network (`radixlm serve --json-schema-dir DIR`).
    """

    backend: GrammarBackendName = "auto"
    strict: bool = False
    max_constraint_bytes: int = 8 * 1024 * 1024
    jump_forward: bool = True
    json_whitespace: JsonWhitespace = "compact"
    compile_timeout: float = 30.0
    compile_workers: int = 2
    cache_size: int = 256
    schema_dir: str | None = None

    def __post_init__(self) -> None:
        _choice("grammar_backend", self.backend, GrammarBackendName)
        _choice("json_whitespace", self.json_whitespace, JsonWhitespace)
        if self.schema_dir is not None and not os.path.isdir(self.schema_dir):
            raise ValueError(f"json_schema_dir {self.schema_dir!r} is not a directory")
        if self.max_constraint_bytes < 1:
            raise ValueError(
                f"max_constraint_bytes must be at least 1; got {self.max_constraint_bytes}"
            )
        if self.compile_timeout <= 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 seconds; got {self.compile_timeout}"
            )


@dataclass(frozen=True)
class MediaConfig:
    """Images and videos in requests (vision models).

    - `allow_urls`: fetch `http(s)` image/video URLs on a request's behalf (off by default:
      a server-side request for a user); never to loopback, link-local or private addresses
      unless `url_allowlist` names the host (a host name, an IP address or a CIDR block).
    - `max_bytes`, `fetch_timeout` (seconds), `max_redirects`: limits of one fetch.
    - `allowed_local_path`: file paths are read only under this directory (None: no paths).
    - `max_image_pixels`: larger images are refused (decompression bombs).
    - `encoder_cache_size`: vision-encoder outputs kept by image hash (LRU), so a repeated
      image is not encoded again even when its KV was evicted; 0 turns it off.
    """

    allow_urls: bool = False
    url_allowlist: tuple[str, ...] = ()
    max_bytes: int = 20 * 1024 * 1024
    fetch_timeout: float = 10.0
    max_redirects: int = 3
    allowed_local_path: str | None = None
    max_image_pixels: int = 40_000_000
    encoder_cache_size: int = 128

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.fetch_timeout <= 0:
            raise ValueError(f"media_fetch_timeout must be > 0 seconds; got {self.fetch_timeout}")
        if self.max_redirects < 0:
            raise ValueError(f"max_media_redirects must be >= 0; got {self.max_redirects}")
        if self.encoder_cache_size < 0:
            raise ValueError(f"mm_encoder_cache_size must be >= 0; got {self.encoder_cache_size}")


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation (SGLang's `--disaggregation-*` flags; see
    `radixlm.runtime.disaggregation`).

    - `mode`: `null` (off: this engine prefills and decodes), `prefill` or `decode`.
    - `bootstrap_host` / `bootstrap_port`: where a prefill engine listens for the decode
      engines' registrations (0: any free port, reported in the server info); a decode engine
      reaches each request's prefill engine at the request's own `bootstrap_host:port`.
    - `bootstrap_ports`: a prefill engine that is a replica of a data-parallel server
      (`radixlm serve --dp-size N`): every replica's bootstrap port, in replica order, its own
      (`bootstrap_port`) among them; replica i prefills the rooms with `room % N == i` and
      sends decode engines that register another replica's room there. Empty: it is alone.
    - `transfer_backend`: `tcp` (ZeroMQ over TCP, between machines), `shm` (one host: the K/V
      in a shared-memory file, only metadata over ZeroMQ); `nixl` and `mooncake` are named
      for SGLang's command lines and refused at startup (their GPU libraries are not driven).
    - `transfer_timeout`: seconds each side waits for the other (a registration, the K/V, the
      decode engine's receipt) before the request ends with finish reason abort.
    """

    mode: DisaggregationMode = "null"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    bootstrap_ports: tuple[int, ...] = ()
    transfer_backend: TransferBackendName = "tcp"
    transfer_timeout: float = 60.0

    def __post_init__(self) -> None:
        _choice("disaggregation_mode", self.mode, DisaggregationMode)
        _choice("disaggregation_transfer_backend", self.transfer_backend, TransferBackendName)
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(
                "disaggregation_bootstrap_port must be a TCP port in [0, 65535] (0: any free "
                f"one); got {self.bootstrap_port}"
            )
        if not self.transfer_timeout > 0:
            raise ValueError(
                f"disaggregation_transfer_timeout must be > 0 seconds; got {self.transfer_timeout}"
            )
        object.__setattr__(self, "bootstrap_ports", tuple(self.bootstrap_ports))
        if self.bootstrap_ports:
            self._check_replica_ports()

    def _check_replica_ports(self) -> None:
        ports = self.bootstrap_ports
        if self.mode != "prefill":
            raise ValueError(
                "disaggregation_bootstrap_ports are the ports of a data-parallel prefill "
                f"server's replicas; drop them for disaggregation_mode {self.mode}"
            )
        if not all(0 < port < 65536 for port in ports) or len(set(ports)) != len(ports):
            raise ValueError(
                f"disaggregation_bootstrap_ports must be distinct TCP ports; got {list(ports)}"
            )
        if self.bootstrap_port not in ports:
            raise ValueError(
                f"disaggregation_bootstrap_port {self.bootstrap_port} must be one of "
                f"disaggregation_bootstrap_ports {list(ports)} (this replica's)"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "null"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, composed by feature.

    - `runner`: the model runner's configuration (model, memory, attention, sampler).
    - `sampling_defaults`: `model` (the model's generation_config.json under the request's
      values) or `openai` (SamplingParams' own defaults only).
    - `incremental_streaming_output`: streamed chunks carry only the new text and ids instead
      of the cumulative ones (SGLang's default is cumulative).
    - `clamp_max_tokens`: a max_new_tokens that the context cannot hold after the prompt is
      cut to what it holds; by default such a request is refused (OpenAI's and vLLM's 400).
    - `max_logprobs`: the most logprobs per token that vLLM-style `logprobs` /
      `prompt_logprobs` may ask for (-1 for the whole vocabulary is counted as its size);
      -1: no limit.
    - `stream_interval`: output tokens per streamed chunk (the first and the last chunk go at
      once); a request's `stream_interval` overrides it (vLLM's `--stream-interval`).
    - `tokenizer_path`: where the tokenizer is, if not beside the model.
    - `engine_process`: run the engine core in its own process (messages over ZeroMQ), so
      that tokenization, HTTP and streaming in the front process do not compete with
      scheduling for the GIL; False runs it on a thread of the caller's process. None (the
      default): a thread, unless `tp_size > 1` (tensor parallelism always runs the core in a
      process of its own, rank 0 of the group; see `in_process`).
    - `engine_restarts`: how many times a dead engine process is started again (its open
      requests end with an error either way); beyond that the engine stays down.
    - `enable_return_routed_experts`: keep the experts a mixture-of-experts model routed each
      token to, so that requests may ask for them (`return_routed_experts`; SGLang's flag).
    - `cpu_threads`: torch threads of the engine process (and of each tensor-parallel rank)
      on CPU; None: the machine's cores less one for the front process, shared among this
      machine's ranks (several replicas on one machine each take their share). With the
      core on a thread, a number given sets this process's torch threads; None leaves them.
    """

    runner: RunnerConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    sampling_defaults: SamplingDefaultsMode = "model"
    incremental_streaming_output: bool = False
    clamp_max_tokens: bool = False
    max_logprobs: int = 20
    stream_interval: int = 1
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    log_level: LogLevel = "warning"
    engine_process: bool | None = None
    engine_restarts: int = 0
    cpu_threads: int | None = None
    enable_return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.engine_process is False and self.runner.parallel.tp_size > 1:
            raise ValueError(
                "tensor parallelism (tp_size > 1) runs the engine core in its own process "
                "(rank 0 of the group): drop engine_process=False (or --engine-mode thread)"
            )
        if self.engine_restarts < 0:
            raise ValueError(f"engine_restarts must be >= 0; got {self.engine_restarts}")
        if self.disaggregation.enabled:
            self._check_disaggregation()
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1; got {self.cpu_threads}")
        _choice("sampling_defaults", self.sampling_defaults, SamplingDefaultsMode)
        _choice("log_level", self.log_level, LogLevel)
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 tokens; got {self.stream_interval}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0; got {self.max_logprobs}")

    def _check_disaggregation(self) -> None:
        """Refuse what a disaggregated engine does not cover yet, naming the setting."""
        mode = self.disaggregation.mode
        if self.runner.parallel.tp_size > 1:
            raise ValueError(
                f"disaggregation_mode {mode} is not available under tensor parallelism yet "
                "(each rank holds a shard of the K/V to send): drop tp_size"
            )
        if self.speculative.enabled:
            raise ValueError(
                f"disaggregation_mode {mode} does not cover speculative decoding yet: drop "
                "speculative_algorithm"
            )
        if self.runner.model.is_embedding:
            raise ValueError(
                f"disaggregation_mode {mode} is for generation; an embedding model computes "
                "its prompts only: drop is_embedding or the disaggregation mode"
            )

    @property
    def model_path(self) -> str:
        return self.runner.model.model_path

    @property
    def in_process(self) -> bool:
        """Whether the engine core runs in a process of its own."""
        if self.engine_process is None:
            return self.runner.parallel.tp_size > 1
        return self.engine_process

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> EngineConfig:
        """Build from SGLang-style keyword arguments (see `ENGINE_KWARGS`)."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            target = ENGINE_KWARGS.get(key)
            if target is None:
                close = difflib.get_close_matches(key, list(ENGINE_KWARGS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine argument {key!r}{hint}")
            section, name, convert = target
            value = convert(value) if convert is not None else value
            if section == "engine":
                top[name] = value
            else:
                sections[section][name] = value
        scheduler = SchedulerConfig(**sections["scheduler"])
        runner = RunnerConfig(
            model=ModelConfig(model_path, **sections["model"]),
            memory=MemoryConfig(**sections["memory"]),
            attention=AttentionConfig(**sections["attention"]),
            sampler=SamplerConfig(**sections["sampler"]),
            parallel=ParallelConfig(**sections["parallel"]),
            lora=LoraConfig(**sections["lora"]),
            **sections["runner"],
        )
        return cls(
            runner=runner,
            scheduler=scheduler,
            cache=CacheConfig(**sections["cache"]),
            grammar=GrammarConfig(**sections["grammar"]),
            media=MediaConfig(**sections["media"]),
            speculative=SpeculativeConfig(**sections["speculative"]),
            disaggregation=DisaggregationConfig(**sections["disaggregation"]),
            **top,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (for get_server_info)."""
        return dataclasses.asdict(self)


def _negate(value: Any) -> bool:
    return not bool(value)


def _cuda_graph_max_bs(value: Any) -> int:
    return int(value)


def _chunked_prefill(value: Any) -> int | None:
    """SGLang's `chunked_prefill_size`: -1 (or None) turns chunking off."""
    return None if value is None or int(value) == -1 else int(value)


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


_SECTIONS = (
    "runner",
    "model",
    "memory",
    "attention",
    "sampler",
    "parallel",
    "scheduler",
    "cache",
    "grammar",
    "media",
    "lora",
    "speculative",
    "disaggregation",
)

#: SGLang-style keyword -> (section, field, conversion).
ENGINE_KWARGS: dict[str, tuple[str, str, Any]] = {
    # model
    "dtype": ("model", "dtype", None),
    "device": ("model", "device", None),
    "load_format": ("model", "load_format", None),
    "context_length": ("model", "context_length", None),
    "seed": ("model", "seed", None),
    "show_progress": ("model", "show_progress", None),
    "quantization": ("model", "quantization", None),
    "quantization_group_size": ("model", "quantization_group_size", int),
    "ep_size": ("model", "ep_size", int),
    "expert_parallel_size": ("model", "ep_size", int),
    "revision": ("model", "revision", None),
    "download_dir": ("model", "download_dir", None),
    "is_embedding": ("model", "is_embedding", bool),
    "pooling_method": ("model", "pooling_method", None),
    "normalize_embeddings": ("model", "normalize_embeddings", _optional_bool),
    # memory
    "mem_fraction_static": ("memory", "kv_cache_fraction", None),
    "kv_cache_fraction": ("memory", "kv_cache_fraction", None),
    "kv_cache_bytes": ("memory", "kv_cache_bytes", None),
    "max_total_tokens": ("memory", "max_total_tokens", None),
    "page_size": ("memory", "page_size", None),
    "kv_cache_dtype": ("memory", "kv_cache_dtype", None),
    # attention
    "attention_backend": ("attention", "backend", None),
    "disable_cuda_graph": ("attention", "cuda_graph", _negate),
    "cuda_graph_max_bs": ("attention", "cuda_graph_max_batch_size", _cuda_graph_max_bs),
    # sampler
    "enable_custom_logit_processor": ("sampler", "enable_custom_logit_processor", None),
    "logprobs_mode": ("sampler", "logprobs_mode", None),
    # runner
    "enable_deterministic_inference": ("runner", "deterministic", bool),
    # parallel
    "tp_size": ("parallel", "tp_size", int),
    "tensor_parallel_size": ("parallel", "tp_size", int),
    "dist_backend": ("parallel", "backend", None),
    "nnodes": ("parallel", "nnodes", int),
    "node_rank": ("parallel", "node_rank", int),
    "dist_init_addr": ("parallel", "dist_init_addr", None),
    "dist_timeout": ("parallel", "timeout", float),
    # scheduler
    "schedule_policy": ("scheduler", "schedule_policy", None),
    "chunked_prefill_size": ("scheduler", "chunked_prefill_size", _chunked_prefill),
    "max_prefill_tokens": ("scheduler", "max_prefill_tokens", None),
    "enable_mixed_chunk": ("scheduler", "enable_mixed_chunk", None),
    "max_running_requests": ("memory", "max_running_requests", None),
    "max_queued_requests": ("scheduler", "max_queued_requests", None),
    "enable_priority_scheduling": ("scheduler", "enable_priority_scheduling", None),
    "schedule_low_priority_values_first": (
        "scheduler",
        "schedule_low_priority_values_first",
        None,
    ),
    "priority_scheduling_preemption_threshold": (
        "scheduler",
        "priority_scheduling_preemption_threshold",
        None,
    ),
    "random_seed": ("scheduler", "random_seed", None),
    # cache
    "disable_radix_cache": ("cache", "disable_radix_cache", None),
    "radix_eviction_policy": ("cache", "eviction_policy", None),
    "enable_hierarchical_cache": ("cache", "hierarchical", bool),
    "hicache_ratio": ("cache", "hicache_ratio", float),
    "hicache_size": ("cache", "hicache_size", float),
    "hicache_write_policy": ("cache", "hicache_write_policy", None),
    "hicache_storage_backend": ("cache", "hicache_storage_backend", None),
    "hicache_storage_dir": ("cache", "hicache_storage_dir", None),
    "hicache_page_size": ("cache", "hicache_page_size", int),
    "hicache_host_dtype": ("cache", "hicache_host_dtype", None),
    # grammar
    "grammar_backend": ("grammar", "backend", lambda v: "none" if v is None else v),
    "disable_jump_forward": ("grammar", "jump_forward", _negate),
    # SGLang's `any` is this engine's `flexible`.
    "json_whitespace": ("grammar", "json_whitespace", lambda v: "flexible" if v == "any" else v),
    "grammar_compile_timeout": ("grammar", "compile_timeout", None),
    "strict_constraints": ("grammar", "strict", bool),
    "max_constraint_bytes": ("grammar", "max_constraint_bytes", int),
    "json_schema_dir": ("grammar", "schema_dir", lambda v: None if v is None else os.fspath(v)),
    # media (vision models)
    "allow_media_urls": ("media", "allow_urls", bool),
    "media_url_allowlist": ("media", "url_allowlist", lambda v: tuple(v or ())),
    "max_media_bytes": ("media", "max_bytes", int),
    "media_fetch_timeout": ("media", "fetch_timeout", float),
    "max_media_redirects": ("media", "max_redirects", int),
    "allowed_local_media_path": ("media", "allowed_local_path", None),
    "max_image_pixels": ("media", "max_image_pixels", int),
    "mm_encoder_cache_size": ("media", "encoder_cache_size", int),
    # LoRA adapters
    "enable_lora": ("lora", "enabled", bool),
    "lora_paths": ("lora", "paths", _lora_paths),
    "max_loras_per_batch": ("lora", "max_loras_per_batch", int),
    "max_lora_rank": ("lora", "max_rank", lambda v: None if v is None else int(v)),
    "lora_target_modules": ("lora", "target_modules", _target_modules),
    # speculative decoding
    "speculative_algorithm": (
        "speculative",
        "algorithm",
        lambda v: None if v is None else str(v).upper(),
    ),
    "speculative_draft_model_path": ("speculative", "draft_model_path", None),
    "speculative_draft_model_quantization": ("speculative", "draft_model_quantization", None),
    "speculative_num_steps": ("speculative", "num_steps", lambda v: None if v is None else int(v)),
    "speculative_eagle_topk": ("speculative", "eagle_topk", int),
    "speculative_num_draft_tokens": (
        "speculative",
        "num_draft_tokens",
        lambda v: None if v is None else int(v),
    ),
    "speculative_ngram_min_match_window_size": (
        "speculative",
        "ngram_min_match_window_size",
        int,
    ),
    "speculative_ngram_max_match_window_size": (
        "speculative",
        "ngram_max_match_window_size",
        int,
    ),
    "speculative_disable_by_batch_size": (
        "speculative",
        "disable_by_batch_size",
        lambda v: None if v is None else int(v),
    ),
    # prefill/decode disaggregation
    "disaggregation_mode": ("disaggregation", "mode", None),
    "disaggregation_bootstrap_host": ("disaggregation", "bootstrap_host", None),
    "disaggregation_bootstrap_port": ("disaggregation", "bootstrap_port", int),
    "disaggregation_bootstrap_ports": (
        "disaggregation",
        "bootstrap_ports",
        lambda v: tuple(int(p) for p in v),
    ),
    "disaggregation_transfer_backend": ("disaggregation", "transfer_backend", None),
    "disaggregation_transfer_timeout": ("disaggregation", "transfer_timeout", float),
    # engine
    "sampling_defaults": ("engine", "sampling_defaults", None),
    "incremental_streaming_output": ("engine", "incremental_streaming_output", None),
    "clamp_max_tokens": ("engine", "clamp_max_tokens", bool),
    "max_logprobs": ("engine", "max_logprobs", int),
    "stream_interval": ("engine", "stream_interval", int),
    "tokenizer_path": ("engine", "tokenizer_path", None),
    "served_model_name": ("engine", "served_model_name", None),
    "log_level": ("engine", "log_level", None),
    "engine_process": ("engine", "engine_process", _optional_bool),
    "engine_restarts": ("engine", "engine_restarts", int),
    "cpu_threads": ("engine", "cpu_threads", int),
    "enable_return_routed_experts": ("engine", "enable_return_routed_experts", bool),
}

#: The allowed values of each keyword with a fixed set of them (the CLI's `choices`).
ENGINE_CHOICES: dict[str, tuple[Any, ...]] = {
    "dtype": DTYPES,
    "load_format": get_args(LoadFormat),
    "quantization": QUANTIZATION_METHODS,
    "quantization_group_size": QUANTIZATION_GROUP_SIZES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "attention_backend": get_args(AttentionBackendName),
    "logprobs_mode": get_args(LogprobsMode),
    "schedule_policy": get_args(SchedulePolicy),
    "radix_eviction_policy": get_args(EvictionPolicy),
    "hicache_write_policy": get_args(HiCacheWritePolicy),
    "hicache_storage_backend": get_args(HiCacheStorageBackend),
    "hicache_host_dtype": get_args(HiCacheHostDtype),
    "grammar_backend": GRAMMAR_BACKENDS,
    "json_whitespace": (*get_args(JsonWhitespace), "any"),
    "sampling_defaults": get_args(SamplingDefaultsMode),
    "log_level": get_args(LogLevel),
    "dist_backend": get_args(DistBackend),
    "speculative_algorithm": SPECULATIVE_AVAILABLE,
    "speculative_draft_model_quantization": QUANTIZATION_METHODS,
    "disaggregation_mode": get_args(DisaggregationMode),
    "disaggregation_transfer_backend": get_args(TransferBackendName),
}
