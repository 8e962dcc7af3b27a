"""Prometheus metrics of one app, in the app's own registry (no process-wide globals), under
SGLang's names (`sglang:*`, the default) or vLLM's (`vllm:*`), so that dashboards and
autoscalers written for either read radixlm unchanged."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixlm.sampling import GenerateChunk, GenerateRequest
from radixlm.server.config import METRICS_FORMATS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# SGLang's default buckets (python/sglang/srt/metrics/collector.py).
SGLANG_TTFT_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
)  # fmt: skip
SGLANG_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
SGLANG_TPOT_BUCKETS = (
    0.002, 0.005, 0.010, 0.015, 0.020, 0.025, 0.030, 0.040, 0.050, 0.060, 0.070, 0.080, 0.090,
    0.100, 0.150, 0.200, 0.300, 0.400, 0.600, 0.800, 1.000, 2.000,
)  # fmt: skip
SGLANG_E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
    2400,
)  # fmt: skip
# vLLM's (vllm/v1/metrics/loggers.py).
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: `sglang:gen_throughput` is the rate of the engine's generated tokens over at least this
#: many seconds between scrapes (a scrape sooner repeats the last figure).
THROUGHPUT_WINDOW = 1.0
#: Finish reasons vLLM counts in `vllm:request_success` (anything else ended as an abort).
_VLLM_FINISHED = ("stop", "length", "abort")


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


class _SGLang:
    """SGLang's metric names and labels: `model_name` on every series; the scheduler's gauges
    also carry `engine_type`, `tp_rank` and `pp_rank`, as SGLang's rank 0 exports them."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.engine_labels = {**self.labels, "engine_type": "unified", "tp_rank": "0",
                              "pp_rank": "0"}  # fmt: skip
        names = ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, registry=registry, buckets=buckets).labels(
                **self.labels
            )

        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed."
        )
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests", "Number of requests processed.")
        self.so_requests = counter(
            "sglang:num_so_requests", "Number of structured output requests processed."
        )
        self.aborted = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (streamed requests).",
            SGLANG_TTFT_BUCKETS,
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (streamed requests).",
            SGLANG_ITL_BUCKETS,
        )
        self.tpot = histogram(
            "sglang:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (streamed requests).",
            SGLANG_TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            SGLANG_E2E_BUCKETS,
        )
        self.queue = histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            SGLANG_E2E_BUCKETS,
        )

    def sequence(
        self, reason: str, prompt: int, cached: int, completion: int, latency: float
    ) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        self.requests.inc()
        if reason not in ("stop", "length"):
            self.aborted.inc()
        self.e2e.observe(latency)

    def unfinished(self) -> None:
        self.aborted.inc()

    def phases(self, queue: float, prefill: float | None, decode: float | None) -> None:
        self.queue.observe(queue)

    def started(self, request: GenerateRequest) -> None:
        pass

    def structured(self) -> None:
        self.so_requests.inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, interval: float, count: int) -> None:
        # SGLang spreads a chunk's interval over its tokens: one observation per token.
        for _ in range(count):
            self.itl.observe(interval / count)

    def per_output_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def engine(self, info: dict[str, Any], throughput: float | None) -> Iterator[Metric]:
        labels = self.engine_labels
        gauges = {
            "sglang:num_running_reqs": ("The number of running requests.", "num_running_reqs"),
            "sglang:num_queue_reqs": (
                "The number of requests in the waiting queue.",
                "num_queued_reqs",
            ),
            "sglang:token_usage": ("The token usage.", "token_usage"),
            "sglang:cache_hit_rate": (
                "The prefix cache hit rate (cumulative since start).",
                "cache_hit_rate",
            ),
            "sglang:max_total_num_tokens": (
                "Maximum total number of tokens in the KV cache pool.",
                "max_total_num_tokens",
            ),
            "sglang:spec_accept_length": (
                "The average acceptance length of speculative decoding.",
                "avg_spec_accept_length",
            ),
            # Prefill/decode disaggregation's queues (a disaggregated server reports them).
            "sglang:num_prefill_prealloc_queue_reqs": (
                "The number of requests in the prefill prealloc queue (prefilled, waiting "
                "for their decode server's registration).",
                "num_prefill_prealloc_queue_reqs",
            ),
            "sglang:num_prefill_inflight_queue_reqs": (
                "The number of requests in the prefill inflight queue (K/V sent, waiting for "
                "the decode server's receipt).",
                "num_prefill_inflight_queue_reqs",
            ),
            "sglang:num_decode_prealloc_queue_reqs": (
                "The number of requests in the decode prealloc queue (K/V arrived, waiting "
                "for KV slots).",
                "num_decode_prealloc_queue_reqs",
            ),
            "sglang:num_decode_transfer_queue_reqs": (
                "The number of requests in the decode transfer queue (waiting for their K/V).",
                "num_decode_transfer_queue_reqs",
            ),
        }
        for name, (doc, key) in gauges.items():
            value = _find_number(info, key)
            if value is not None:
                yield _gauge(name, doc, labels, value)
        usage = _find_number(info, "token_usage")
        total = _find_number(info, "max_total_num_tokens")
        if usage is not None and total is not None:
            yield _gauge(
                "sglang:num_used_tokens", "The number of used tokens.", labels, round(usage * total)
            )
        drafted = _find_number(info, "spec_draft_tokens")
        accepted = _find_number(info, "spec_accepted_tokens")
        if drafted is not None and accepted is not None:
            rate = accepted / drafted if drafted else 0.0
            yield _gauge(
                "sglang:spec_accept_rate",
                "The average acceptance rate of speculative decoding.",
                labels,
                rate,
            )
        if throughput is not None:
            yield _gauge(
                "sglang:gen_throughput", "The generation throughput (token/s).", labels, throughput
            )
        retracted = _find_number(info, "num_retractions")
        if retracted is not None:
            yield _counter(
                "sglang:num_retracted_requests",
                "Total number of retracted requests.",
                labels,
                retracted,
            )


class _VLLM:
    """vLLM's (v1) metric names and labels: `model_name` and `engine` on every series."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        names = ["model_name", "engine"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, registry=registry, buckets=buckets).labels(
                **self.labels
            )

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=registry,
        )
        self.success = {r: success.labels(**self.labels, finished_reason=r) for r in _VLLM_FINISHED}
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20)
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (streamed requests).",
            VLLM_TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (streamed requests).",
            VLLM_ITL_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request (streamed requests).",
            VLLM_ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            VLLM_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            VLLM_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            VLLM_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            VLLM_LATENCY_BUCKETS,
        )

    def sequence(
        self, reason: str, prompt: int, cached: int, completion: int, latency: float
    ) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cache_queries.inc(prompt)
        self.cache_hits.inc(cached)
        self.success[reason if reason in _VLLM_FINISHED else "abort"].inc()
        if prompt:  # (n > 1: the request's prompt is counted with its first sequence)
            self.request_prompt_tokens.observe(prompt)
        self.request_generation_tokens.observe(completion)
        self.e2e.observe(latency)

    def unfinished(self) -> None:
        self.success["abort"].inc()

    def phases(self, queue: float, prefill: float | None, decode: float | None) -> None:
        self.queue.observe(queue)
        if prefill is not None:
            self.prefill.observe(prefill)
            if decode is not None:
                self.decode.observe(decode)
                self.inference.observe(prefill + decode)

    def started(self, request: GenerateRequest) -> None:
        self.params_n.observe(request.params.n)
        if request.params.max_new_tokens is not None:
            self.params_max_tokens.observe(request.params.max_new_tokens)

    def structured(self) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, interval: float, count: int) -> None:
        # vLLM observes one interval per engine step that gave the request tokens.
        self.itl.observe(interval)

    def per_output_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def engine(self, info: dict[str, Any], throughput: float | None) -> Iterator[Metric]:
        labels = self.labels
        gauges = {
            "vllm:num_requests_running": (
                "Number of requests in model execution batches.",
                "num_running_reqs",
            ),
            "vllm:num_requests_waiting": (
                "Number of requests waiting to be processed.",
                "num_queued_reqs",
            ),
            "vllm:kv_cache_usage_perc": (
                "KV-cache usage. 1 means 100 percent usage.",
                "token_usage",
            ),
        }
        for name, (doc, key) in gauges.items():
            value = _find_number(info, key)
            if value is not None:
                yield _gauge(name, doc, labels, value)
        retracted = _find_number(info, "num_retractions")
        if retracted is not None:
            yield _counter(
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                labels,
                retracted,
            )


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _find_number(info: dict[str, Any], key: str) -> float | None:
    """`info[key]` or the same key one level down (engines nest their stats)."""
    value = info.get(key)
    if value is None:
        for nested in info.values():
            if isinstance(nested, dict) and isinstance(nested.get(key), int | float):
                value = nested[key]
                break
    if isinstance(value, bool):
        return None
    return float(value) if isinstance(value, int | float) else None


class _EngineStats(Collector):
    """Gauges read from `engine.server_info()` at scrape time."""

    #: radixlm's own, exported whatever the format: the hierarchical cache (when it is on).
    _RADIXLM_GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "host_cached_tokens": (
            "radixlm_hicache_host_cached_tokens",
            "Prompt tokens brought back from the host-memory tier instead of computed (cumulative)",
        ),
        "storage_cached_tokens": (
            "radixlm_hicache_storage_cached_tokens",
            "Prompt tokens brought back from the storage tier instead of computed (cumulative)",
        ),
        "hicache_host_pages": ("radixlm_hicache_host_pages", "Pages the host-memory tier holds"),
    }

    def __init__(
        self,
        server_info: Callable[[], dict[str, Any]],
        inflight: Callable[[], int],
        formats: list[_SGLang | _VLLM],
    ) -> None:
        self._server_info = server_info
        self._inflight = inflight
        self._formats = formats
        self._lock = threading.Lock()  # scrapes render in the server's thread pool
        self._sample: tuple[float, float] | None = None  # (time, generated tokens)
        self._throughput = 0.0

    def describe(self) -> list[Metric]:
        return []  # names vary with what the engine reports; do not call it to register

    def collect(self) -> Iterator[Metric]:
        try:
            info = self._server_info()
        except Exception:
            info = {}
        throughput = self._generation_rate(_find_number(info, "generated_tokens"))
        for names in self._formats:
            yield from names.engine(info, throughput)
        for key, (name, doc) in self._RADIXLM_GAUGES.items():
            value = _find_number(info, key)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "radixlm_http_requests_in_flight",
            "HTTP generation requests open",
            value=self._inflight(),
        )

    def _generation_rate(self, generated: float | None) -> float | None:
        """Tokens generated per second since the previous sample (taken at a scrape at least
        THROUGHPUT_WINDOW seconds earlier); None when the engine does not count them."""
        if generated is None:
            return None
        now = time.monotonic()
        with self._lock:
            if self._sample is None or generated < self._sample[1]:
                self._sample = (now, generated)  # the first scrape, or the engine restarted
            elif now - self._sample[0] >= THROUGHPUT_WINDOW:
                then, before = self._sample
                self._throughput = (generated - before) / (now - then)
                self._sample = (now, generated)
            return self._throughput


class RequestTimer:
    """The token timings of one single request, taken as its chunks reach the front end.

    Streamed requests only: a request that is not streamed arrives as its final chunks, and
    the engine reports no first-token or per-token times (only `e2e_latency`), so it adds to
    neither the first-token nor the inter-token histograms."""

    def __init__(self, metrics: ServerMetrics, request: GenerateRequest, arrival: float) -> None:
        self._formats = metrics.formats
        self._streamed = bool(request.stream)
        self._structured = request.params.constraint is not None
        self._arrival = arrival
        self._first: dict[int, float] = {}  # per sequence: when its first tokens came
        self._last: dict[int, tuple[float, int]] = {}  # per sequence: (when, tokens so far)
        for names in self._formats:
            names.started(request)

    def chunk(self, chunk: GenerateChunk, now: float | None = None) -> None:
        """Record a chunk that just arrived (before it is sent on)."""
        now = time.monotonic() if now is None else now
        if self._streamed:
            self._time(chunk, now)
        if chunk.finished and self._structured:
            for names in self._formats:
                names.structured()

    def _time(self, chunk: GenerateChunk, now: float) -> None:
        index, count = chunk.index, chunk.completion_tokens
        last = self._last.get(index)
        if count > (last[1] if last else 0):
            if not self._first:
                for names in self._formats:
                    names.first_token(now - self._arrival)
            if last is None:
                self._first[index] = now
            else:
                for names in self._formats:
                    names.tokens(now - last[0], count - last[1])
            self._last[index] = (now, count)
        first = self._first.get(index)
        if chunk.finished and first is not None and count > 1:
            for names in self._formats:
                names.per_output_token((now - first) / (count - 1))


class ServerMetrics:
    """Counters and histograms the server records per request, the engine's gauges read at
    scrape time, and the `/metrics` text.

    `metrics_format` picks the names: `sglang` (SGLang's `sglang:*`), `vllm` (vLLM's
    `vllm:*`) or `both`. radixlm's own series (`radixlm_requests_total` by route and finish
    reason, `radixlm_request_errors_total` by HTTP status, `radixlm_http_requests_in_flight`,
    the hierarchical cache's `radixlm_hicache_*`) are there in every format."""

    def __init__(
        self,
        server_info: Callable[[], dict[str, Any]],
        inflight: Callable[[], int],
        model_name: str = "default",
        metrics_format: str = "sglang",
        max_model_len: int | None = None,
    ) -> None:
        if metrics_format not in METRICS_FORMATS:
            raise ValueError(
                f"metrics_format must be one of {', '.join(METRICS_FORMATS)}; "
                f"got {metrics_format!r}"
            )
        self.registry = CollectorRegistry(auto_describe=True)
        self.formats: list[_SGLang | _VLLM] = []
        if metrics_format in ("sglang", "both"):
            self.formats.append(_SGLang(self.registry, model_name))
        if metrics_format in ("vllm", "both"):
            limit = max_model_len or 32768
            self.formats.append(_VLLM(self.registry, model_name, limit))
        self.requests = Counter(
            "radixlm_requests",
            "Finished generation requests by route and finish reason",
            ["route", "finish_reason"],
            registry=self.registry,
        )
        self.errors = Counter(
            "radixlm_request_errors", "Requests refused, by HTTP status", ["status"],
            registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineStats(server_info, inflight, self.formats))

    def track(self, request: GenerateRequest, arrival: float) -> RequestTimer:
        """The timer of a single request that arrived at `arrival` (`time.monotonic()`)."""
        return RequestTimer(self, request, arrival)

    def record_sequence(
        self,
        route: str,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        latency: float,
    ) -> None:
        """One finished sequence. Prompt counts are passed once per request (0 for siblings)."""
        self.requests.labels(route=route, finish_reason=finish_reason).inc()
        for names in self.formats:
            names.sequence(finish_reason, prompt_tokens, cached_tokens, completion_tokens, latency)

    def record_phases(self, timestamps: dict[str, Any] | None) -> None:
        """How long one request waited in the queue, then prefilled (to its first token) and
        decoded (to its last), from the engine's `meta_info["timestamps"]`; nothing when the
        engine reports none or the request never left the queue."""
        if not timestamps:
            return
        arrival, scheduled = timestamps.get("arrival"), timestamps.get("scheduled")
        if arrival is None or scheduled is None:
            return
        first, last = timestamps.get("first_token"), timestamps.get("last_token")
        prefill = None if first is None else max(first - scheduled, 0.0)
        decode = None if first is None or last is None else max(last - first, 0.0)
        for names in self.formats:
            names.phases(max(scheduled - arrival, 0.0), prefill, decode)

    def record_unfinished(self, route: str, outcome: str) -> None:
        """Sequences of a request that ended without their final chunk (the client went
        away): counted once, as aborted."""
        self.requests.labels(route=route, finish_reason=outcome).inc()
        for names in self.formats:
            names.unfinished()

    def render(self) -> bytes:
        return generate_latest(self.registry)
