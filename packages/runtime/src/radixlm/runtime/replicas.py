"""Data-parallel replicas on one machine: the engine options of replica i of n.

`radixlm serve --dp-size N` builds N engines (each in its own engine process) from the same
options; this gives each its share of the machine: with at least N GPUs replica i runs on
`cuda:i` (with tensor parallelism, on GPUs `i * tp_size` and up), on a CPU each takes an
equal share of the cores (one left to the front process). The replicas of a prefill server
(`disaggregation_mode="prefill"`) listen on consecutive bootstrap ports, replica i on
`disaggregation_bootstrap_port + i`, and each knows them all (a decode engine that registers
a room at the wrong one is sent to the right one).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

#: Tries at finding N consecutive free ports (`replica_options` with bootstrap port 0).
_PORT_TRIES = 50


def replica_options(kwargs: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """`Engine(**options)` of every replica of `size` (`replica_kwargs` of each), with what
    they share resolved once: a prefill server's bootstrap port 0 (any free one) becomes the
    first of `size` consecutive free ports. A ValueError says why the machine cannot hold
    them."""
    shared = dict(kwargs)
    port = int(shared.get("disaggregation_bootstrap_port", _default_bootstrap_port()))
    if size > 1 and shared.get("disaggregation_mode") == "prefill" and port == 0:
        host = str(shared.get("disaggregation_bootstrap_host", "127.0.0.1"))
        shared["disaggregation_bootstrap_port"] = free_port_range(host, size)
    return [replica_kwargs(shared, index, size) for index in range(size)]


def free_port_range(host: str, count: int) -> int:
    """The first of `count` consecutive TCP ports free on `host` now (another program may
    take one before they are bound: the replica then fails to start, saying so)."""
    for _ in range(_PORT_TRIES):
        with contextlib.ExitStack() as held:
            first = _bind(held, host, 0)
            if first + count > 65536:
                continue
            try:
                for port in range(first + 1, first + count):
                    _bind(held, host, port)
            except OSError:
                continue
            return first
    raise ValueError(
        f"found no {count} consecutive free ports on {host} for the replicas' bootstrap "
        "ports: give --disaggregation-bootstrap-port"
    )


def _bind(held: contextlib.ExitStack, host: str, port: int) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
    sock.bind((host, port))
    return int(sock.getsockname()[1])


def _default_bootstrap_port() -> int:
    from radixlm.runtime.config import DisaggregationConfig

    return DisaggregationConfig.bootstrap_port


def replica_kwargs(kwargs: dict[str, Any], index: int, size: int) -> dict[str, Any]:
    """`Engine(**kwargs)` options for replica `index` of `size`; a ValueError says why the
    machine cannot hold them."""
    import torch

    if not 0 <= index < size:
        raise ValueError(f"replica index {index} is outside 0..{size - 1}")
    if kwargs.get("engine_process") is False:
        raise ValueError(
            "--dp-size runs each replica's engine in a process of its own: drop "
            "--engine-mode thread (engine_process=False)"
        )
    out = dict(kwargs)
    out["engine_process"] = True
    if size > 1 and kwargs.get("disaggregation_mode") == "prefill":
        base = int(kwargs.get("disaggregation_bootstrap_port", _default_bootstrap_port()))
        if base == 0:
            raise ValueError(
                "the replicas of a prefill server need known bootstrap ports: give "
                "--disaggregation-bootstrap-port, or build the options with replica_options"
            )
        if base + size > 65536:
            raise ValueError(
                f"--dp-size {size} prefill replicas listen on bootstrap ports {base} to "
                f"{base + size - 1}, past 65535: lower --disaggregation-bootstrap-port"
            )
        out["disaggregation_bootstrap_port"] = base + index
        out["disaggregation_bootstrap_ports"] = [base + i for i in range(size)]
    tp_size = int(kwargs.get("tp_size", 1))
    if tp_size > 1:
        raise ValueError(
            "--dp-size with --tp-size > 1 is not supported yet: run one server per "
            "tensor-parallel group"
        )
    device = str(kwargs.get("device", "auto"))
    if device in ("auto", "cuda") and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if gpus >= size:
            out["device"] = f"cuda:{index}"
        elif device == "cuda" or gpus:
            raise ValueError(
                f"--dp-size {size} needs a GPU per replica; this machine has {gpus} "
                "(lower --dp-size, or use --device cpu)"
            )
        return out
    if device.startswith("cuda"):
        raise ValueError(f"--dp-size {size} on the one device {device!r}: drop --device")
    if "cpu_threads" not in kwargs and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        out["cpu_threads"] = max(1, ((cores or 1) - 1) // size)
    return out
