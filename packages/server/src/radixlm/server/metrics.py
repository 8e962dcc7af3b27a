"""Prometheus metrics of one app, in the app's own registry (no process-wide globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class _EngineStats(Collector):
    """Gauges read from `engine.server_info()` at scrape time."""

    _GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "num_running_reqs": ("radixlm_num_running_requests", "Requests running in the engine"),
        "num_queued_reqs": ("radixlm_num_queued_requests", "Requests waiting in the engine"),
        "cache_hit_rate": ("radixlm_cache_hit_rate", "Prefix cache hit rate (0..1)"),
        "token_usage": ("radixlm_token_usage", "Fraction of KV cache slots in use (0..1)"),
        # The hierarchical cache (present when it is on).
        "host_cached_tokens": (
            "radixlm_hicache_host_cached_tokens",
            "Prompt tokens brought back from the host-memory tier instead of computed (cumulative)",
        ),
        "storage_cached_tokens": (
            "radixlm_hicache_storage_cached_tokens",
            "Prompt tokens brought back from the storage tier instead of computed (cumulative)",
        ),
        "hicache_host_pages": (
            "radixlm_hicache_host_pages",
            "Pages the host-memory tier holds",
        ),
    }

    def __init__(self, server_info: Callable[[], dict[str, Any]], inflight: Callable[[], int]):
        self._server_info = server_info
        self._inflight = inflight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            info = self._server_info()
        except Exception:
            info = {}
        for key, (name, doc) in self._GAUGES.items():
            value = _find_number(info, key)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "radixlm_http_requests_in_flight",
            "HTTP generation requests open",
            value=self._inflight(),
        )


def _find_number(info: dict[str, Any], key: str) -> float | None:
    """`info[key]` or the same key one level down (engines nest their stats)."""
    value = info.get(key)
    if value is None:
        for nested in info.values():
            if isinstance(nested, dict) and isinstance(nested.get(key), int | float):
                value = nested[key]
                break
    return float(value) if isinstance(value, int | float) else None


class ServerMetrics:
    """Counters and histograms the server records per request, and the `/metrics` text."""

    def __init__(
        self, server_info: Callable[[], dict[str, Any]], inflight: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "radixlm_requests",
            "Finished generation requests by route and finish reason",
            ["route", "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "radixlm_prompt_tokens", "Prompt tokens processed", registry=self.registry
        )
        self.cached_tokens = Counter(
            "radixlm_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "radixlm_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.ttft = Histogram(
            "radixlm_time_to_first_token_seconds",
            "Time to the first output token (streamed requests)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "radixlm_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "radixlm_request_errors", "Requests refused, by HTTP status", ["status"],
            registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineStats(server_info, inflight))

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
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.latency.observe(latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
