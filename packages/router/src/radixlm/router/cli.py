"""`radixlm-router` (and `python -m radixlm.router`): the HTTP router in front of worker servers,
with SGLang's router flags.

    radixlm-router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 --port 30000
    radixlm-router --pd-disaggregation --prefill http://127.0.0.1:30001 8998 \\
        --decode http://127.0.0.1:30002 --port 30000

Serving needs the `http` extra (`pip install "radixlm-router[http]"`); parsing does not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from radixlm.router._version import __version__
from radixlm.router.policies import POLICIES
from radixlm.router.workers import (
    DEFAULT_BOOTSTRAP_PORT,
    CacheAwareOptions,
    HealthConfig,
    RouterConfig,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser(prog: str = "radixlm-router") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Route requests over radixlm (or SGLang) servers: to one worker per request "
        "(--worker-urls), or to a prefill and a decode worker per request "
        "(--pd-disaggregation).",
    )
    parser.add_argument("--version", action="version", version=f"radixlm-router {__version__}")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on")
    workers = parser.add_argument_group("workers")
    workers.add_argument(
        "--worker-urls", nargs="+", default=[], metavar="URL",
        help="the workers of regular mode (each a `radixlm serve`, itself possibly --dp-size N)",
    )  # fmt: skip
    workers.add_argument(
        "--pd-disaggregation", action="store_true",
        help="prefill/decode disaggregation: each request goes to a --prefill and a --decode "
        "worker at once, the client gets the decode worker's answer",
    )  # fmt: skip
    workers.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker (`radixlm serve --disaggregation-mode prefill`) and the port it "
        f"listens on for decode workers (default {DEFAULT_BOOTSTRAP_PORT}); repeat for more",
    )  # fmt: skip
    workers.add_argument(
        "--decode", action="append", default=[], metavar="URL",
        help="a decode worker (`radixlm serve --disaggregation-mode decode`); repeat for more",
    )  # fmt: skip
    policy = parser.add_argument_group("policies")
    names = list(POLICIES)
    policy.add_argument(
        "--policy", choices=names, default="cache_aware",
        help="how a worker is picked (regular mode, and the prefill side of PD mode): "
        "cache_aware (default: the worker that was sent the longest prefix of the prompt, "
        "unless the load is out of balance), round_robin, random, shortest_queue (fewest "
        "in flight), power_of_two",
    )  # fmt: skip
    policy.add_argument(
        "--prefill-policy", choices=names, default=None, help="PD mode: the prefill side's "
        "policy (default: --policy)",
    )  # fmt: skip
    policy.add_argument(
        "--decode-policy", choices=names, default="shortest_queue", help="PD mode: the decode "
        "side's policy (default: shortest_queue, the worker with the fewest requests in flight)",
    )  # fmt: skip
    defaults = CacheAwareOptions()
    policy.add_argument(
        "--cache-threshold", type=float, default=defaults.cache_threshold,
        help="cache_aware: the shortest match, as a share of the prompt, that attracts a "
        f"request to a worker (default {defaults.cache_threshold})",
    )  # fmt: skip
    policy.add_argument(
        "--balance-abs-threshold", type=int, default=defaults.balance_abs_threshold,
        help="cache_aware: the load is out of balance when the busiest worker has this many "
        f"requests more than the idlest (default {defaults.balance_abs_threshold}) ...",
    )  # fmt: skip
    policy.add_argument(
        "--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
        help=f"... and this many times as many (default {defaults.balance_rel_threshold})",
    )  # fmt: skip
    policy.add_argument(
        "--max-tree-size", type=int, default=defaults.max_tree_size,
        help="cache_aware: the most prompt bytes remembered per worker, least recently used "
        f"dropped first (default {defaults.max_tree_size})",
    )  # fmt: skip
    health = parser.add_argument_group("health checks and timeouts")
    checks = HealthConfig()
    health.add_argument(
        "--health-check-interval-secs", type=float, default=checks.interval_s,
        help=f"seconds between checks of a worker in routing (default {checks.interval_s:g}; "
        "one out of routing is checked every second)",
    )  # fmt: skip
    health.add_argument(
        "--health-check-timeout-secs", type=float, default=checks.timeout_s,
        help=f"a check fails past this (default {checks.timeout_s:g})",
    )  # fmt: skip
    health.add_argument(
        "--health-failure-threshold", type=int, default=checks.failure_threshold,
        help=f"failed checks in a row that take a worker out (default {checks.failure_threshold})",
    )  # fmt: skip
    health.add_argument(
        "--health-success-threshold", type=int, default=checks.success_threshold,
        help="good checks in a row that bring it back (default "
        f"{checks.success_threshold}; a new worker comes in at its first)",
    )  # fmt: skip
    health.add_argument(
        "--health-check-endpoint", default=checks.endpoint,
        help=f"the path checked (default {checks.endpoint})",
    )  # fmt: skip
    health.add_argument(
        "--request-timeout-secs", type=float, default=1800.0,
        help="most seconds a worker may stay silent during a request (default 1800)",
    )  # fmt: skip
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's configuration from parsed flags; ValueError says what to change."""
    options: dict[str, Any] = {
        "policy": args.policy,
        "prefill_policy": args.prefill_policy,
        "decode_policy": args.decode_policy,
        "cache_aware": CacheAwareOptions(
            args.cache_threshold,
            args.balance_abs_threshold,
            args.balance_rel_threshold,
            args.max_tree_size,
        ),
        "health": HealthConfig(
            args.health_check_interval_secs,
            args.health_check_timeout_secs,
            args.health_failure_threshold,
            args.health_success_threshold,
            args.health_check_endpoint,
        ),
        "request_timeout_s": args.request_timeout_secs,
    }
    if args.pd_disaggregation:
        if args.worker_urls:
            raise ValueError("--pd-disaggregation takes --prefill and --decode, not --worker-urls")
        prefill = [parse_prefill(values) for values in args.prefill]
        return RouterConfig.pd(prefill, args.decode, **options)
    if args.prefill or args.decode:
        raise ValueError("--prefill and --decode need --pd-disaggregation")
    if not args.worker_urls:
        raise ValueError("give --worker-urls URL [URL ...] (or --pd-disaggregation with workers)")
    return RouterConfig.regular(args.worker_urls, **options)


def parse_prefill(values: Sequence[str]) -> tuple[str, int | None]:
    """`--prefill URL [BOOTSTRAP_PORT]` as (url, port or None)."""
    if len(values) > 2:
        raise ValueError(f"--prefill takes a URL and an optional bootstrap port; got {values}")
    if len(values) == 1:
        return values[0], None
    try:
        return values[0], int(values[1])
    except ValueError:
        raise ValueError(
            f"--prefill {values[0]} {values[1]}: the bootstrap port must be a number"
        ) from None


def main(argv: Sequence[str] | None = None, prog: str = "radixlm-router") -> int:
    """Parse the flags and serve until interrupted; the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        import uvicorn

        from radixlm.router.proxy import create_router_app
    except ImportError as error:
        print(
            f"radixlm-router: serving needs the http extra ({error}); "
            'pip install "radixlm-router[http]"',
            file=sys.stderr,
        )
        return 1
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    uvicorn.run(create_router_app(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0
