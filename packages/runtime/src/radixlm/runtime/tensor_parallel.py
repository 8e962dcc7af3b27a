"""Tensor-parallel ranks: the processes that hold the other shards of the model.

Rank 0 is the engine process (it schedules, samples and talks to the front end); ranks 1 to
N-1 are worker processes started here (`spawn`). Each worker joins the torch.distributed group
(`radixlm.runtime.distributed`), builds its `ModelRunner` on its shard, and then runs whatever
rank 0 broadcasts: a `ForwardStep` (the same forward on its shard; the collectives inside pair
the ranks' layers up), its part of a weight update (`radixlm.runtime.weight_sync`), a
`Heartbeat` (rank 0 is idle but alive) or `StopWorkers`. The radix cache, the slot allocator
and the request table's bookkeeping exist on rank 0 alone: slot indices are the same on every
rank, so a step carries them.

On one machine the front process starts every rank and watches them all: a rank that dies
takes the group down (the engine process is killed too, every open request ends with an
error). With several machines (`nnodes > 1`) the other nodes run `serve_node`, which starts
their ranks and waits for them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixlm.runtime.config import EngineConfig

logger = logging.getLogger("radixlm.runtime.tp")

#: Seconds between a worker's checks that its parent process is still alive.
_PARENT_WATCH_S = 0.5


def heartbeat_interval(timeout: float) -> float:
    """Seconds of idleness after which rank 0 sends a heartbeat (well within the timeout)."""
    return min(5.0, timeout / 4)


@dataclass(frozen=True)
class StopWorkers:
    """Rank 0 to the workers: leave the group and exit."""


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0 to the workers while it has no step for them: it is alive."""


class StepSender:
    """Rank 0's side of the step messages: `send` broadcasts one (the caller then runs the
    forward under `lock`), and a thread sends a `Heartbeat` whenever nothing was sent for
    `interval` seconds, so the workers' waits (bounded by the collective timeout) never run out
    while the engine is idle. A heartbeat that fails means a rank is gone: the engine process
    exits, and the front end answers its open requests with errors."""

    def __init__(self, tp: Any, interval: float) -> None:
        self.tp = tp
        self.interval = interval
        self.lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="radixlm-tp-heartbeat", daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        """Broadcast `message` to every rank (hold `lock` around it and the forward after)."""
        self.tp.broadcast(message)
        self._last = time.monotonic()

    def stop(self) -> None:
        """End the heartbeats and tell the workers to exit."""
        self._stopped.set()
        self._thread.join()
        with self.lock:
            self.send(StopWorkers())

    def _beat(self) -> None:
        while not self._stopped.wait(self.interval / 4):
            with self.lock:
                if self._stopped.is_set() or time.monotonic() - self._last < self.interval:
                    continue
                try:
                    self.send(Heartbeat())
                except Exception as error:
                    logger.error("a tensor-parallel rank is gone (%s); the engine stops", error)
                    os._exit(1)


def init_method(config: EngineConfig, directory: str, generation: int = 0) -> str:
    """Where the ranks meet: `dist_init_addr` (TCP) across machines, else a file in the
    engine's private directory (a fresh one for each start of the group)."""
    parallel = config.runner.parallel
    if parallel.dist_init_addr is not None:
        return f"tcp://{parallel.dist_init_addr}"
    return Path(directory, f"tp-rendezvous-{generation}").as_uri()


def spawn_workers(
    config: EngineConfig, ranks: Iterable[int], method: str
) -> list[multiprocessing.process.BaseProcess]:
    """Start a worker process for each of `ranks` (never rank 0)."""
    context = multiprocessing.get_context("spawn")
    workers: list[multiprocessing.process.BaseProcess] = []
    for rank in ranks:
        if rank == 0:
            continue
        process = context.Process(
            target=worker_main,
            args=(config, rank, method, os.getpid()),
            name=f"radixlm-tp{rank}",
            daemon=True,
        )
        process.start()
        workers.append(process)
    return workers


def stop_processes(processes: Iterable[multiprocessing.process.BaseProcess], wait: float) -> None:
    """Wait up to `wait` seconds for the processes to exit, then kill what is left."""
    processes = list(processes)
    deadline = time.monotonic() + wait
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def share_cpu_cores(config: EngineConfig, reserve_front: bool) -> None:
    """On CPU, give each rank of this machine an equal share of its cores, leaving one to the
    front process when it runs here (`reserve_front`). torch's compute threads wait for each
    other at every operation, so one of them descheduled by other work (the HTTP server,
    another rank) stalls the whole forward. `cpu_threads` in the config wins, then an explicit
    OMP_NUM_THREADS."""
    if config.runner.model.device not in ("auto", "cpu"):
        return
    import torch

    if config.runner.model.device == "auto" and torch.cuda.is_available():
        return
    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
        return
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    ranks = config.runner.parallel.ranks_per_node
    free = cores - 1 if reserve_front else cores
    threads = max(1, free // ranks)
    torch.set_num_threads(threads)
    logger.info("this rank computes with %d of %d CPU cores (%d ranks here)", threads, cores, ranks)


def resident_bytes() -> int:
    """This process's resident set size (0 where the platform does not say)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rank_report(runner: Any) -> list[dict[str, Any]]:
    """Every rank's memory after loading (weights, KV pool, resident size), on every rank."""
    pool = runner.kv_pool
    mine = {
        "rank": runner.tp.rank,
        "weight_bytes": runner.weight_bytes,
        "kv_pool_bytes": pool.nbytes,
        "kv_heads": pool.num_kv_heads,
        "resident_bytes": resident_bytes(),
    }
    reports: list[dict[str, Any]] = runner.tp.gather_objects(mine)
    return reports


def _watch_parent(parent: int) -> None:
    """Exit when the process that started this one is gone (nobody would stop us)."""

    def watch() -> None:
        while True:
            time.sleep(_PARENT_WATCH_S)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="radixlm-tp-parent", daemon=True).start()


def worker_main(config: EngineConfig, rank: int, method: str, parent: int) -> None:
    """A worker rank: join the group, load this rank's shard, run rank 0's steps."""
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.WARNING),
        format=f"%(asctime)s %(levelname)s %(name)s [tp{rank}]: %(message)s",
    )
    _watch_parent(parent)
    parallel = config.runner.parallel
    share_cpu_cores(config, reserve_front=parallel.node_rank == 0)
    from radixlm.runtime.distributed import (
        RankFailure,
        destroy_tensor_parallel,
        init_tensor_parallel,
    )
    from radixlm.runtime.loader import resolve_device
    from radixlm.runtime.model_runner import ModelRunner

    try:
        device = resolve_device(config.runner.model.device)
        tp = init_tensor_parallel(parallel, rank, method, device)
        runner = ModelRunner(config.runner, tp=tp)
        rank_report(runner)
    except Exception as error:
        logger.error("tensor-parallel rank %d could not start: %s", rank, error)
        raise SystemExit(1) from None
    try:
        serve_steps(runner)
    except RankFailure as error:
        logger.error("tensor-parallel rank %d lost its group: %s", rank, error)
        raise SystemExit(1) from None
    destroy_tensor_parallel()


def serve_steps(runner: Any) -> None:
    """Run every step rank 0 broadcasts, and its part of every weight update
    (`radixlm.runtime.weight_sync`, answered with this rank's outcome), until `StopWorkers`."""
    from radixlm.runtime.executor import ForwardStep, run_forward
    from radixlm.runtime.weight_sync import WEIGHT_MESSAGES, RankWeights

    tp = runner.tp
    weights = RankWeights(runner)
    while True:
        message = tp.broadcast()
        if isinstance(message, ForwardStep):
            run_forward(runner, message)
        elif isinstance(message, Heartbeat):
            continue
        elif isinstance(message, WEIGHT_MESSAGES):
            tp.gather_objects(weights.carry_out(message))
        elif isinstance(message, StopWorkers):
            return
        else:
            raise TypeError(f"unexpected tensor-parallel message {type(message).__name__}")


def serve_node(config: EngineConfig) -> int:
    """A node other than node 0 of a multi-node group: start this node's ranks and wait for
    them; returns the exit status (non-zero when a rank failed)."""
    parallel = config.runner.parallel
    if parallel.node_rank == 0:
        raise ValueError("node 0 runs the engine itself (Engine / radixlm serve), not serve_node")
    method = init_method(config, "")
    workers = spawn_workers(config, parallel.node_ranks, method)
    logger.warning(
        "node %d of %d: ranks %s joining %s",
        parallel.node_rank,
        parallel.nnodes,
        list(parallel.node_ranks),
        parallel.dist_init_addr,
    )
    try:
        while True:
            codes = [w.exitcode for w in workers]
            if any(code not in (None, 0) for code in codes):
                logger.error("a rank of this node failed (exit codes %s)", codes)
                stop_processes(workers, wait=0)
                return 1
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_processes(workers, wait=0)
        return 130
