"""Configuration of the engine: frozen dataclasses composed by feature, around the RunnerConfig.

`EngineConfig.from_kwargs(model_path, **kwargs)` maps SGLang-style keyword arguments
(`mem_fraction_static`, `schedule_policy`, `disable_radix_cache`, ...) onto them; unknown
names raise TypeError with the closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.config import (
    AttentionConfig,
    MemoryConfig,
    ModelConfig,
    RunnerConfig,
    SamplerConfig,
)

_POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
#: The structured-output backends an engine can be started with (`auto` picks per constraint
#: among the installed ones; `none` refuses constraints). The CLI's choices come from here.
GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance", "outlines", "none")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler picks work.

    - `schedule_policy`: `lpm` (longest cached prefix first), `dfs-weight` (depth-first over
      the prefix tree of the queue), `fcfs`, `random`. The prefix-aware ones fall back to
      fcfs with more than `policy_fallback_queue_len` requests waiting.
    - `chunked_prefill_size`: prefill tokens per step; a longer prompt is prefilled in chunks
      (None: no chunking, the budget is `max_prefill_tokens` but one prompt may exceed it).
    - `enable_mixed_chunk`: prefill chunks ride in the same forward as decode steps.
    - `max_running_requests`, `max_queued_requests` (None: unbounded; beyond it new requests
      are refused with `EngineOverloaded`).
    - `init_new_token_ratio` .. `new_token_ratio_decay`: the share of each running request's
      remaining `max_new_tokens` kept free for its decode when admitting new requests; it
      decays step by step and resets when requests had to be retracted.
    - `in_batch_prefix_min`: a queued request that shares at least this many uncached tokens
      with a request admitted in the same step waits one step, so it reuses them from the cache.
    """

    schedule_policy: str = "lpm"
    policy_fallback_queue_len: int = 128
    chunked_prefill_size: int | None = 2048
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = True
    max_running_requests: int = 256
    max_queued_requests: int | None = None
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    clip_max_new_tokens: int = 4096
    in_batch_prefix_min: int = 32
    random_seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule_policy not in _POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(_POLICIES)}; got "
                f"{self.schedule_policy!r}"
            )
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            object.__setattr__(self, "chunked_prefill_size", None)  # SGLang's -1: disabled
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1; got {self.max_prefill_tokens}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1; got {self.max_running_requests}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0; got {self.max_queued_requests}")
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")

    @property
    def prefill_budget(self) -> int:
        """Prefill tokens one step may compute."""
        if self.chunked_prefill_size is None:
            return self.max_prefill_tokens
        return min(self.chunked_prefill_size, self.max_prefill_tokens)


@dataclass(frozen=True)
class CacheConfig:
    """The radix (prefix) cache: `disable_radix_cache` turns reuse off (for comparisons);
    `eviction_policy` is `lru` or `lfu`."""

    disable_radix_cache: bool = False
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        if self.eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"eviction_policy must be lru or lfu; got {self.eviction_policy!r}")


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
    """

    backend: str = "auto"
    strict: bool = False
    max_constraint_bytes: int = 8 * 1024 * 1024
    jump_forward: bool = True
    json_whitespace: str = "compact"
    compile_timeout: float = 30.0
    compile_workers: int = 2
    cache_size: int = 256

    def __post_init__(self) -> None:
        if self.backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}; got "
                f"{self.backend!r}"
            )
        if self.json_whitespace not in ("compact", "flexible"):
            raise ValueError(
                f"json_whitespace must be compact or flexible; got {self.json_whitespace!r}"
            )
        if self.max_constraint_bytes < 1:
            raise ValueError(
                f"max_constraint_bytes must be at least 1; got {self.max_constraint_bytes}"
            )
        if self.compile_timeout <= 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 seconds; got {self.compile_timeout}"
            )


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
      scheduling for the GIL; False runs it on a thread of the caller's process.
    - `engine_restarts`: how many times a dead engine process is started again (its open
      requests end with an error either way); beyond that the engine stays down.
    """

    runner: RunnerConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    sampling_defaults: str = "model"
    incremental_streaming_output: bool = False
    clamp_max_tokens: bool = False
    max_logprobs: int = 20
    stream_interval: int = 1
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    log_level: str = "warning"
    engine_process: bool = False
    engine_restarts: int = 0

    def __post_init__(self) -> None:
        if self.engine_restarts < 0:
            raise ValueError(f"engine_restarts must be >= 0; got {self.engine_restarts}")
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError(
                f"sampling_defaults must be model or openai; got {self.sampling_defaults!r}"
            )
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 tokens; got {self.stream_interval}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0; got {self.max_logprobs}")

    @property
    def model_path(self) -> str:
        return self.runner.model.model_path

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
        memory = sections["memory"]
        memory.setdefault("max_running_requests", scheduler.max_running_requests)
        runner = RunnerConfig(
            model=ModelConfig(model_path, **sections["model"]),
            memory=MemoryConfig(**memory),
            attention=AttentionConfig(**sections["attention"]),
            sampler=SamplerConfig(**sections["sampler"]),
        )
        return cls(
            runner=runner,
            scheduler=scheduler,
            cache=CacheConfig(**sections["cache"]),
            grammar=GrammarConfig(**sections["grammar"]),
            **top,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (for get_server_info)."""
        return dataclasses.asdict(self)


def _negate(value: Any) -> bool:
    return not bool(value)


def _cuda_graph_max_bs(value: Any) -> int:
    return int(value)


_SECTIONS = ("model", "memory", "attention", "sampler", "scheduler", "cache", "grammar")

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
    # scheduler
    "schedule_policy": ("scheduler", "schedule_policy", None),
    "chunked_prefill_size": ("scheduler", "chunked_prefill_size", None),
    "max_prefill_tokens": ("scheduler", "max_prefill_tokens", None),
    "enable_mixed_chunk": ("scheduler", "enable_mixed_chunk", None),
    "max_running_requests": ("scheduler", "max_running_requests", None),
    "max_queued_requests": ("scheduler", "max_queued_requests", None),
    "random_seed": ("scheduler", "random_seed", None),
    # cache
    "disable_radix_cache": ("cache", "disable_radix_cache", None),
    "radix_eviction_policy": ("cache", "eviction_policy", None),
    # grammar
    "grammar_backend": ("grammar", "backend", lambda v: "none" if v is None else v),
    "disable_jump_forward": ("grammar", "jump_forward", _negate),
    "json_whitespace": ("grammar", "json_whitespace", lambda v: "flexible" if v == "any" else v),
    "grammar_compile_timeout": ("grammar", "compile_timeout", None),
    "strict_constraints": ("grammar", "strict", bool),
    "max_constraint_bytes": ("grammar", "max_constraint_bytes", int),
    # engine
    "sampling_defaults": ("engine", "sampling_defaults", None),
    "incremental_streaming_output": ("engine", "incremental_streaming_output", None),
    "clamp_max_tokens": ("engine", "clamp_max_tokens", bool),
    "max_logprobs": ("engine", "max_logprobs", int),
    "stream_interval": ("engine", "stream_interval", int),
    "tokenizer_path": ("engine", "tokenizer_path", None),
    "served_model_name": ("engine", "served_model_name", None),
    "log_level": ("engine", "log_level", None),
    "engine_process": ("engine", "engine_process", bool),
    "engine_restarts": ("engine", "engine_restarts", int),
}
