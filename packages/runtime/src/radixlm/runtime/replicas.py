"""Data-parallel replicas on one machine: the engine options of replica i of n.

`radixlm serve --dp-size N` builds N engines (each in its own engine process) from the same
options; this gives each its share of the machine: with at least N GPUs replica i runs on
`cuda:i` (with tensor parallelism, on GPUs `i * tp_size` and up), on a CPU each takes an
equal share of the cores (one left to the front process).
"""

from __future__ import annotations

import os
from typing import Any


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
