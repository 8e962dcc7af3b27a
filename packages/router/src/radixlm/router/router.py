"""Router: the replicas, their load and health, and the policy that picks among them.

    router = Router("cache_aware", ["0", "1"])
    replica = router.choose(prompt_ids)    # a healthy replica, by the policy
    router.begin(replica.id)               # a request went there ...
    router.end(replica.id)                 # ... and finished (or failed)
    router.report("1", running=3, queued=0, token_usage=0.4)   # what /get_server_info said
    router.mark_down("1"); router.mark_up("1")                 # health checks

Thread-safe: every method takes the router's lock (the policies' trees are not shared).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from radixlm.router.policies import Policy, Replica, make_policy


class NoReplicaAvailable(RuntimeError):
    """Every replica is down (or there are none): retry once one is healthy again."""


class Router:
    """Picks replicas for requests with a policy, over the healthy replicas it knows."""

    def __init__(
        self, policy: Policy | str, replica_ids: Iterable[str] = (), **options: Any
    ) -> None:
        self.policy: Policy = make_policy(policy, **options) if isinstance(policy, str) else policy
        self._replicas: dict[str, Replica] = {}
        self._lock = threading.Lock()
        for replica_id in replica_ids:
            self.add(replica_id)

    @property
    def replicas(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas.values())

    def replica(self, replica_id: str) -> Replica:
        with self._lock:
            return self._replicas[replica_id]

    def add(self, replica_id: str) -> None:
        """A new replica (healthy, empty)."""
        with self._lock:
            if replica_id in self._replicas:
                raise ValueError(f"replica {replica_id!r} is already routed to")
            self._replicas[replica_id] = Replica(replica_id)

    def remove(self, replica_id: str) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)
            self.policy.forget(replica_id)

    def forget(self, replica_id: str) -> None:
        """The replica's cache was emptied (flushed): the policy forgets what it sent there."""
        with self._lock:
            self.policy.forget(replica_id)

    def mark_down(self, replica_id: str) -> None:
        """Take a replica out of routing; what it cached is lost (it restarts empty)."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None and replica.healthy:
                replica.healthy = False
                self.policy.forget(replica_id)

    def mark_up(self, replica_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None:
                replica.healthy = True

    def report(
        self, replica_id: str, running: int = 0, queued: int = 0, token_usage: float = 0.0
    ) -> None:
        """What a replica said of its load (its `/get_server_info`)."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None:
                replica.running, replica.queued = running, queued
                replica.token_usage = token_usage

    def choose(
        self,
        key: Sequence[int],
        namespace: Hashable | None = None,
        among: Iterable[str] | None = None,
    ) -> Replica:
        """The replica for a request whose prompt is `key` (see `radixlm.router.keys`), among
        the healthy ones (of `among` when given); raises NoReplicaAvailable when none is."""
        with self._lock:
            allowed = None if among is None else set(among)
            healthy = [
                r
                for r in self._replicas.values()
                if r.healthy and (allowed is None or r.id in allowed)
            ]
            if not healthy:
                raise NoReplicaAvailable(
                    "no replica is serving (all are down or restarting); retry shortly"
                )
            return self.policy.choose(key, healthy, namespace)

    def rank(
        self,
        candidates: Sequence[str],
        key: Sequence[int],
        queue_lens: dict[str, int | None] | None = None,
        namespace: Hashable | None = None,
    ) -> list[list[str]]:
        """Ranks of the `candidates` (replica ids) for one request, best first: the policy's
        choice, then the others, least loaded first — the form of a Ray Serve request
        router's answer (the next rank is tried when a replica refuses). Candidates the
        router does not know are added; `queue_lens` (None: unknown) become their load."""
        if not candidates:
            return []
        with self._lock:
            for replica_id in candidates:
                if replica_id not in self._replicas:
                    self._replicas[replica_id] = Replica(replica_id)
                length = (queue_lens or {}).get(replica_id)
                if length is not None:
                    self._replicas[replica_id].running = length
                    self._replicas[replica_id].queued = 0
        try:
            chosen = self.choose(key, namespace, among=candidates).id
        except NoReplicaAvailable:
            return []
        with self._lock:
            load = {r.id: r.load for r in self._replicas.values()}
        rest = sorted((c for c in candidates if c != chosen), key=lambda c: (load.get(c, 0), c))
        return [[chosen], rest] if rest else [[chosen]]

    def begin(self, replica_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None:
                replica.in_flight += 1

    def end(self, replica_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None and replica.in_flight > 0:
                replica.in_flight -= 1

    def snapshot(self) -> list[dict[str, Any]]:
        """Each replica's state (for /get_server_info)."""
        with self._lock:
            return [
                {
                    "id": r.id,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "running": r.running,
                    "queued": r.queued,
                    "token_usage": r.token_usage,
                }
                for r in self._replicas.values()
            ]
