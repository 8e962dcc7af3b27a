"""radixlm.router: cache-aware routing over data-parallel replicas.

`Router` picks a replica per request with a `Policy` (`cache_aware`, `round_robin`,
`power_of_two`, `shortest_queue`, `random`; `make_policy(name, **options)`), from each
replica's load and health. `DataParallelEngine` puts N engines behind one engine interface
(`radixlm serve --dp-size N`). `radixlm.router.proxy` (the `http` extra) is an HTTP router in
front of worker servers (`radixlm-router`), prefill/decode disaggregation included.
`radixlm.router.ray` (the `ray` extra) serves replicas on a Ray cluster with a Ray Serve
request router applying the same policies.
"""

from radixlm.router._version import __version__
from radixlm.router.dp import DataParallelEngine
from radixlm.router.keys import prompt_key, text_key
from radixlm.router.policies import (
    POLICIES,
    CacheAware,
    CacheAwareDecision,
    Policy,
    PowerOfTwo,
    RandomChoice,
    Replica,
    RoundRobin,
    ShortestQueue,
    make_policy,
)
from radixlm.router.router import NoReplicaAvailable, Router

__all__ = [
    "POLICIES",
    "CacheAware",
    "CacheAwareDecision",
    "DataParallelEngine",
    "NoReplicaAvailable",
    "Policy",
    "PowerOfTwo",
    "RandomChoice",
    "Replica",
    "RoundRobin",
    "Router",
    "ShortestQueue",
    "__version__",
    "make_policy",
    "prompt_key",
    "text_key",
]
