"""ServerConfig: what the HTTP layer needs to know, as one frozen dataclass (engine knobs live in
the engine's own config; the launcher maps command-line flags onto both)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

TOOL_CALL_PARSERS = ("hermes", "qwen", "qwen25", "llama3")
REASONING_PARSERS = ("qwen3", "deepseek-r1")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
#: `metrics_format`: whose metric names `/metrics` exports.
METRICS_FORMATS = ("sglang", "vllm", "both")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the HTTP server; pass it to `create_app(engine, config)`.

    - `served_model_name`: the model name clients send (`model`) and `/v1/models` lists; None
      means the engine's `model_info()["model_path"]`.
    - `api_key`: when set, every route except `/health` and `/health_generate` requires
      `Authorization: Bearer <key>` (401 otherwise).
    - `chat_template`: a Jinja chat template (the text, not a path) used instead of the
      tokenizer's own.
    - `tool_call_parser`: how tool calls are recognised in the output of `tool_choice: "auto"`:
      `hermes` / `qwen` / `qwen25` (`<tool_call>{json}</tool_call>`) or `llama3` (a bare JSON
      object `{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`).
    - `reasoning_parser`: how the reasoning of a reasoning model is found in chat output
      (`qwen3`, `deepseek-r1`: `<think>...</think>`); it is returned as `reasoning_content`.
      None: the output is all content.
    - `enable_metrics`: serve Prometheus metrics on `/metrics`.
    - `metrics_format`: whose metric names `/metrics` exports: `sglang` (SGLang's
      `sglang:*`, the default), `vllm` (vLLM's `vllm:*`) or `both`.
    - `enable_cache_report`: OpenAI usage objects (chat, completions, the streamed usage
      chunk) carry `prompt_tokens_details.cached_tokens`, the prompt tokens served from the
      prefix cache (SGLang's `--enable-cache-report`); without it they carry no details.
    - `health_generate_timeout`: seconds `/health_generate` waits for its one-token generation.
    - `host`, `port`, `log_level`: used by the launcher (`radixlm serve`) only.
    - `log_requests`: log one info line per finished request (tokens, cache hits, latency).
    - `response_store_size`: how many Responses API responses (`store: true`) are kept in
      memory for `previous_response_id` and `GET /v1/responses/{id}`; the least recently used
      go first; 0 keeps none.
    - `max_request_bytes`: the largest request body accepted, in bytes (413 beyond it, before
      the body is read when its `Content-Length` says so, else once that much has arrived).
    - `graceful_shutdown_timeout`: on SIGTERM the server drains: new work gets 503 and
      `/health` turns unhealthy while the requests in flight finish, for at most this many
      seconds; then it exits with status 0 (0: stop at once, as on SIGINT).
    - `otlp_traces_endpoint`: when set, OpenTelemetry traces of the requests are exported over
      OTLP/HTTP to this URL (`http://host:4318/v1/traces`; a URL without a path gets
      `/v1/traces`, one without a scheme `http://`). Needs `radixlm-server[tracing]`.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    enable_metrics: bool = False
    metrics_format: str = "sglang"
    enable_cache_report: bool = False
    health_generate_timeout: float = 20.0
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    log_requests: bool = True
    response_store_size: int = 1024
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    graceful_shutdown_timeout: float = 30.0
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(
                "graceful_shutdown_timeout must be >= 0 seconds (0: exit at once on SIGTERM); "
                f"got {self.graceful_shutdown_timeout}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}; "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                f"got {self.reasoning_parser!r}"
            )
        if self.metrics_format not in METRICS_FORMATS:
            raise ValueError(
                f"metrics_format must be one of {', '.join(METRICS_FORMATS)}; "
                f"got {self.metrics_format!r}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535; got {self.port}")
        if self.health_generate_timeout <= 0:
            raise ValueError("health_generate_timeout must be positive")
        if self.response_store_size < 0:
            raise ValueError(f"response_store_size must be >= 0; got {self.response_store_size}")
        if self.max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be positive; got {self.max_request_bytes}")
        if self.otlp_traces_endpoint is not None and (
            not self.otlp_traces_endpoint.strip() or " " in self.otlp_traces_endpoint.strip()
        ):
            raise ValueError(
                "otlp_traces_endpoint must be a URL such as http://localhost:4318/v1/traces; "
                f"got {self.otlp_traces_endpoint!r} (omit it to disable tracing)"
            )
        if self.api_key == "":
            raise ValueError("api_key must not be empty; omit it to disable authentication")

    def public_dict(self) -> dict[str, object]:
        """The settings as a dict for `/get_server_info`, with the API key masked."""
        values = asdict(self)
        if values["api_key"] is not None:
            values["api_key"] = "***"
        if values["chat_template"] is not None:
            values["chat_template"] = f"<{len(values['chat_template'])} characters>"
        return values
