"""The worker servers behind the HTTP router: their addresses and roles, its configuration, and
each pool's policy and health (no HTTP here: `radixlm.router.proxy` does the talking).

    config = RouterConfig.regular(["http://10.0.0.1:30000", "http://10.0.0.2:30000"])
    config = RouterConfig.pd(prefill=[("http://10.0.0.1:30000", 8998)], decode=["http://10.0.0.2:30000"])
    pools = config.pools()          # {"regular": WorkerPool} or {"prefill": ..., "decode": ...}

A pool is a `Router` whose replica ids are the workers' URLs. Workers start out of routing
until a health check (`GET /health`) answers 200; then `failure_threshold` failed checks in a
row take one out, and `success_threshold` good ones bring it back. A request that cannot
connect to a worker takes it out at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from radixlm.router.policies import POLICIES
from radixlm.router.router import NoReplicaAvailable, Router

#: The port a prefill server listens on for decode servers when none is given (SGLang's).
DEFAULT_BOOTSTRAP_PORT = 8998
#: Seconds between health checks of a worker out of routing (it may be starting).
DOWN_CHECK_INTERVAL_S = 1.0
ROLES = ("regular", "prefill", "decode")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker server: its base URL, its role, and (a prefill worker's) bootstrap port."""

    url: str
    role: str = "regular"
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", worker_url(self.url))
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap port of {self.url} must be 1-65535")

    @property
    def host(self) -> str:
        """The host name of the URL (what a decode server connects to for a prefill's KV)."""
        return urlsplit(self.url).hostname or ""


def worker_url(text: str) -> str:
    """`text` as a worker's base URL (`http://host:port`, no trailing slash); a ValueError
    says what is wrong."""
    url = text.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a worker URL looks like http://HOST:PORT; got {text!r}")
    return url


@dataclass(frozen=True)
class HealthConfig:
    """How workers are checked: `GET endpoint` every `interval_s` (every second while one is
    out of routing), failing past `timeout_s`."""

    interval_s: float = 10.0
    timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("health check interval and timeout must be > 0 seconds")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("health check failure and success thresholds must be >= 1")


@dataclass(frozen=True)
class CacheAwareOptions:
    """The `cache_aware` policy's options (SGLang's router flags); the tree's unit is a byte
    of the prompt's text (or a token id of a prompt given as ids)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 24

    def policy_options(self) -> dict[str, Any]:
        options = asdict(self)
        options["max_tree_tokens"] = options.pop("max_tree_size")
        return options


@dataclass(frozen=True)
class RouterConfig:
    """What `radixlm-router` serves: its workers, policies, health checks and timeouts.

    Regular mode (workers of role `regular`) sends each request to one worker chosen by
    `policy`; PD mode (workers of roles `prefill` and `decode`) to a prefill worker chosen by
    `prefill_policy` (default: `policy`) and a decode worker chosen by `decode_policy`."""

    workers: tuple[WorkerSpec, ...]
    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str = "shortest_queue"
    cache_aware: CacheAwareOptions = field(default_factory=CacheAwareOptions)
    health: HealthConfig = field(default_factory=HealthConfig)
    request_timeout_s: float = 1800.0
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        roles = {w.role for w in self.workers}
        if not self.workers:
            raise ValueError("give at least one worker (--worker-urls, or --prefill and --decode)")
        if "regular" in roles and roles != {"regular"}:
            raise ValueError("give either --worker-urls or --prefill/--decode workers, not both")
        if self.disaggregated and roles != {"prefill", "decode"}:
            missing = "--decode" if "decode" not in roles else "--prefill"
            raise ValueError(f"PD disaggregation needs prefill and decode workers; give {missing}")
        urls = [w.url for w in self.workers]
        if len(set(urls)) != len(urls):
            twice = sorted({u for u in urls if urls.count(u) > 1})
            raise ValueError(f"each worker may be given once; {', '.join(twice)} came twice")
        for name, value in (("policy", self.policy), ("decode policy", self.decode_policy)):
            if value not in POLICIES:
                raise ValueError(f"{name} must be one of {', '.join(POLICIES)}; got {value!r}")
        if self.prefill_policy is not None and self.prefill_policy not in POLICIES:
            raise ValueError(
                f"prefill policy must be one of {', '.join(POLICIES)}; got {self.prefill_policy!r}"
            )
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("request and connect timeouts must be > 0 seconds")

    @classmethod
    def regular(cls, urls: Iterable[str], **options: Any) -> RouterConfig:
        return cls(tuple(WorkerSpec(url) for url in urls), **options)

    @classmethod
    def pd(
        cls,
        prefill: Iterable[tuple[str, int | None]],
        decode: Iterable[str],
        **options: Any,
    ) -> RouterConfig:
        """PD mode over (url, bootstrap port or None: 8998) prefill workers and decode
        workers."""
        workers = [
            WorkerSpec(url, "prefill", DEFAULT_BOOTSTRAP_PORT if port is None else port)
            for url, port in prefill
        ]
        workers += [WorkerSpec(url, "decode") for url in decode]
        return cls(tuple(workers), **options)

    @property
    def disaggregated(self) -> bool:
        return any(w.role != "regular" for w in self.workers)

    def pools(self) -> dict[str, WorkerPool]:
        """A new pool per role: `regular`, or `prefill` and `decode`."""
        prefill_policy = self.prefill_policy or self.policy
        policies = {"regular": self.policy, "prefill": prefill_policy, "decode": self.decode_policy}
        pools: dict[str, WorkerPool] = {}
        for role in ROLES:
            members = [w for w in self.workers if w.role == role]
            if members:
                options = self.cache_aware.policy_options()
                if policies[role] != "cache_aware":
                    options = {}
                pools[role] = WorkerPool(role, members, policies[role], self.health, **options)
        return pools


class NoWorkerAvailable(RuntimeError):
    """No worker of a pool is in routing (all failed their health checks, or none has
    answered one yet)."""


@dataclass
class _Health:
    successes: int = 0
    failures: int = 0
    checked_at: float = float("-inf")
    ever_up: bool = False


class WorkerPool:
    """The workers of one role: a `Router` over their URLs and their health."""

    def __init__(
        self,
        role: str,
        workers: Sequence[WorkerSpec],
        policy: str,
        health: HealthConfig,
        **policy_options: Any,
    ) -> None:
        self.role = role
        self.workers = {w.url: w for w in workers}
        self.health = health
        self.router = Router(policy, self.workers, **policy_options)
        self._health = {url: _Health() for url in self.workers}
        self._lock = threading.Lock()
        for url in self.workers:
            self.router.mark_down(url)  # out of routing until a check answers

    @property
    def policy(self) -> str:
        return self.router.policy.name

    def choose(self, key: Sequence[int], namespace: Hashable | None = None) -> WorkerSpec:
        """The worker for a request keyed `key`, by the pool's policy, among those in
        routing; NoWorkerAvailable when none is."""
        try:
            return self.workers[self.router.choose(key, namespace).id]
        except NoReplicaAvailable:
            count = len(self.workers)
            raise NoWorkerAvailable(
                f"no {self.role} worker is serving (none of {count} passes its health check "
                f"{self.health.endpoint}); retry shortly"
            ) from None

    def begin(self, url: str) -> None:
        self.router.begin(url)

    def end(self, url: str) -> None:
        self.router.end(url)

    def healthy(self, url: str) -> bool:
        return self.router.replica(url).healthy

    @property
    def serving(self) -> bool:
        """At least one worker is in routing."""
        return any(r.healthy for r in self.router.replicas)

    def due(self, now: float | None = None) -> list[str]:
        """The workers to check now: those out of routing every second, the others every
        `interval_s`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [
                url
                for url, state in self._health.items()
                if now - state.checked_at
                >= (self.health.interval_s if self.healthy(url) else DOWN_CHECK_INTERVAL_S)
            ]

    def never_checked(self, url: str) -> bool:
        with self._lock:
            return self._health[url].checked_at == float("-inf")

    def record_check(self, url: str, ok: bool, now: float | None = None) -> None:
        """A health check's outcome. The first success brings a new worker in; after that it
        takes `success_threshold` in a row to come back, `failure_threshold` to go."""
        with self._lock:
            state = self._health[url]
            state.checked_at = time.monotonic() if now is None else now
            if ok:
                state.successes, state.failures = state.successes + 1, 0
                back = not state.ever_up or state.successes >= self.health.success_threshold
                if back and not self.healthy(url):
                    self.router.mark_up(url)
                state.ever_up = True
            else:
                state.successes, state.failures = 0, state.failures + 1
                if state.failures >= self.health.failure_threshold:
                    self.router.mark_down(url)

    def mark_unreachable(self, url: str) -> None:
        """A request could not connect to the worker: out of routing at once (its health
        checks bring it back)."""
        with self._lock:
            state = self._health[url]
            state.successes, state.failures = 0, self.health.failure_threshold
        self.router.mark_down(url)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each worker: URL, role, in routing or not, requests in flight (and its bootstrap
        port in PD mode)."""
        states = {s["id"]: s for s in self.router.snapshot()}
        out = []
        for url, worker in self.workers.items():
            entry: dict[str, Any] = {
                "url": url,
                "role": self.role,
                "healthy": states[url]["healthy"],
                "in_flight": states[url]["in_flight"],
            }
            if worker.bootstrap_port is not None:
                entry["bootstrap_port"] = worker.bootstrap_port
            out.append(entry)
        return out
