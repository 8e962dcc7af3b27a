"""Where the engine core runs: a thread of the caller's process, or a process of its own.

Both connections take the same typed commands (`post`) and hand the core's outputs to the same
callback, so the front end (`Engine`) does not know which one it talks to.

The engine process is started with `spawn`; commands and outputs cross two ZeroMQ sockets
(`ipc://` in a private temporary directory) as pickles (protocol 5). A thread of the front
process receives the outputs and watches the process: when it dies (killed, out of memory, a
CUDA error), `on_down` ends every open request with an error, and the process is started again
while restarts are left.

Under tensor parallelism the engine process is rank 0 and the front process also starts this
machine's other ranks (`radixlm.runtime.tensor_parallel`) and watches them with it: one rank
down takes the whole group down (and up again, while restarts are left).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.distributed import RankFailure
from radixlm.runtime.engine_core import EngineCore, create_core
from radixlm.runtime.messages import (
    Command,
    EngineDown,
    EngineInfo,
    Output,
    Ready,
    Shutdown,
    StartupFailed,
    Stats,
)
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.tensor_parallel import (
    init_method,
    share_cpu_cores,
    spawn_workers,
    stop_processes,
)

logger = logging.getLogger("radixlm.runtime.engine")

OnOutputs = Callable[[list[Output]], None]
OnDown = Callable[[str], None]

#: Seconds between checks that the engine process (or, in it, the parent) is still alive.
_WATCH_S = 0.1

_STARTUP_ERRORS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "OSError": OSError,
    "FileNotFoundError": FileNotFoundError,
    "NotImplementedError": NotImplementedError,
}


class ThreadConnection:
    """The core on a daemon thread of this process (tests, notebooks, `runner=`)."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: OnOutputs,
        runner: ModelRunner | None = None,
        tokenizer: Any = None,
    ) -> None:
        if config.cpu_threads is not None:
            # Asked for: this process's torch threads (the core computes on them here).
            torch.set_num_threads(config.cpu_threads)
        self.core: EngineCore
        self.core, self.info = create_core(config, on_outputs, runner=runner, tokenizer=tokenizer)
        self._thread = threading.Thread(target=self.core.serve, name="radixlm-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive()

    failed = False

    def post(self, command: Command) -> None:
        self.core.post(command)

    def close(self) -> None:
        self.core.post(Shutdown())
        self._thread.join()
        self.core.grammar.shutdown()


class ProcessConnection:
    """The core in a child process, restarted up to `config.engine_restarts` times."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: OnOutputs,
        on_down: OnDown,
        tokenizer: Any = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self.config = config
        self._on_outputs = on_outputs
        self._on_down = on_down
        self._tokenizer = tokenizer
        self._restarts_left = config.engine_restarts
        self._dir = tempfile.mkdtemp(prefix="radixlm-engine-")
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        self._send_lock = threading.Lock()
        self._closing = False
        self._healthy = False
        #: Why the engine process said it is going down (it exits next), or None.
        self._going_down: str | None = None
        self.failed = False
        self.restarts = 0
        self.stats: dict[str, Any] = {}  # the live statistics the process sent with Ready
        #: This machine's other tensor-parallel ranks (none without tensor parallelism).
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._process = self._spawn()
        try:
            self.info = self._wait_ready(startup_timeout)
        except BaseException:
            self._terminate()
            self._release()
            raise
        self._healthy = True
        self._watcher = threading.Thread(
            target=self._receive, name="radixlm-engine-outputs", daemon=True
        )
        self._watcher.start()

    # ------------------------------------------------------------------------ lifecycle

    @property
    def healthy(self) -> bool:
        """True while an engine process serves (False while it restarts or after it died, or
        once it said it is going down)."""
        return self._healthy and self._going_down is None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def rank_pids(self) -> list[int | None]:
        """The process of each tensor-parallel rank on this machine (rank 0: the engine)."""
        return [self._process.pid, *(worker.pid for worker in self._workers)]

    def _spawn(self) -> multiprocessing.process.BaseProcess:
        context = multiprocessing.get_context("spawn")
        parallel = self.config.runner.parallel
        method = None
        if parallel.tp_size > 1:
            method = init_method(self.config, self._dir, self.restarts)
        process = context.Process(
            target=_engine_main,
            args=(self.config, self._tokenizer, self._dir, os.getpid(), method),
            name="radixlm-engine",
            daemon=True,
        )
        process.start()
        if method is not None:
            self._workers = spawn_workers(self.config, parallel.node_ranks, method)
        return process

    def _dead_rank(self) -> str | None:
        """Why the group cannot serve: the engine process or a rank of it exited (or None)."""
        if not self._process.is_alive():
            return f"the engine process died (exit code {self._process.exitcode})"
        for rank, worker in enumerate(self._workers, start=1):
            if not worker.is_alive():
                return f"tensor-parallel rank {rank} died (exit code {worker.exitcode})"
        return None

    def _wait_ready(self, timeout: float) -> EngineInfo:
        """Block until the new process says Ready; raise what kept it from starting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._outputs.poll(int(_WATCH_S * 1000)):
                message = pickle.loads(self._outputs.recv())
                if isinstance(message, Ready):
                    self.stats = message.stats
                    return message.info
                if isinstance(message, StartupFailed):
                    raise _STARTUP_ERRORS.get(message.kind, RuntimeError)(message.message)
                continue  # outputs of a process that died: their requests already failed
            dead = self._dead_rank()
            if dead is not None:
                raise RuntimeError(f"{dead} while starting; its log above says why")
        raise TimeoutError(f"the engine process did not start within {timeout:.0f} s")

    def close(self) -> None:
        """Stop the engine process (open requests end with an error first) and wait for it."""
        if self._closing:
            return
        self._closing = True  # before the process ends: the watcher must not restart it
        if self._process.is_alive():
            self.post(Shutdown())
        self._process.join(timeout=30)
        stop_processes(self._workers, wait=5)  # rank 0 told them to exit
        self._terminate()
        # The watcher returns within one poll once the process is gone; only then may the
        # sockets it reads be closed.
        self._watcher.join()
        self._release()

    def _terminate(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        stop_processes(self._workers, wait=0)

    def _release(self) -> None:
        self._commands.close(0)
        self._outputs.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------------- messages

    def post(self, command: Command) -> None:
        """Send a command (thread-safe). Dropped while no engine process serves."""
        if (self._closing or not self._healthy) and not isinstance(command, Shutdown):
            return
        data = pickle.dumps(command, protocol=5)
        with self._send_lock:
            self._commands.send(data, copy=False)

    def _receive(self) -> None:
        """Hand the outputs over; notice a dead process and start a new one."""
        while True:
            if self._outputs.poll(int(_WATCH_S * 1000)):
                message = pickle.loads(self._outputs.recv())
                if isinstance(message, list):
                    for item in message:
                        if isinstance(item, EngineDown):
                            self._going_down = item.reason
                    self._on_outputs([m for m in message if not isinstance(m, EngineDown)])
                elif isinstance(message, Ready):
                    self.info = message.info
                    self._going_down = None
                    self._on_outputs([Stats(message.stats)])
                    self._healthy = True
                    logger.warning("the engine process serves again (restart %d)", self.restarts)
                elif isinstance(message, StartupFailed):
                    logger.error("the engine process failed to restart: %s", message.message)
                continue
            dead = self._dead_rank()
            if dead is None:
                continue
            if self._closing:
                return
            if self._healthy or not self.failed:
                self._down(dead)

    def _down(self, dead: str) -> None:
        # One rank down leaves the others waiting on collectives: stop them all.
        self._terminate()
        was_healthy = self._healthy
        self._healthy = False
        if was_healthy:
            reason = (
                f"{dead}; "
                + ("it is being restarted, retry shortly" if self._restarts_left else "")
            ).rstrip("; ")
            logger.error("%s", reason)
            self._on_down(reason)
        if self._restarts_left > 0:
            self._restarts_left -= 1
            self.restarts += 1
            self._process = self._spawn()
        else:
            self.failed = True


def _engine_main(
    config: EngineConfig, tokenizer: Any, directory: str, parent: int, method: str | None
) -> None:
    """The engine process: build the core (rank 0 of the tensor-parallel group when `method`
    says where the ranks meet), say Ready, serve commands until Shutdown (or until the parent
    process is gone)."""
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s",
    )
    share_cpu_cores(config, reserve_front=True)
    ctx = zmq.Context()
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(f"ipc://{directory}/outputs")
    commands = ctx.socket(zmq.PULL)
    commands.connect(f"ipc://{directory}/commands")

    def emit(items: list[Output]) -> None:
        outputs.send(pickle.dumps(items, protocol=5), copy=False)

    tp = None
    try:
        if method is not None:
            from radixlm.runtime.distributed import init_tensor_parallel
            from radixlm.runtime.loader import resolve_device

            device = resolve_device(config.runner.model.device)
            tp = init_tensor_parallel(config.runner.parallel, 0, method, device)
        core, info = create_core(config, emit, tokenizer=tokenizer, publish_stats=True, tp=tp)
    except Exception as error:
        logger.error("the engine could not start: %s", error)
        outputs.send(pickle.dumps(StartupFailed(type(error).__name__, str(error))))
        outputs.close(linger=5000)
        ctx.term()
        raise SystemExit(1) from None
    outputs.send(pickle.dumps(Ready(info, core.live_stats()), protocol=5))
    # What startup made lives as long as the process: the collector stops walking it in each
    # full collection (see radixlm.server.launcher).
    gc.freeze()

    def read_commands() -> None:
        while True:
            if commands.poll(int(_WATCH_S * 1000) * 10):
                command = pickle.loads(commands.recv())
                core.post(command)
                if isinstance(command, Shutdown):
                    return
            elif os.getppid() != parent:  # the front process is gone: nobody reads
                core.post(Shutdown())
                return

    threading.Thread(target=read_commands, name="radixlm-commands", daemon=True).start()
    try:
        core.serve()
    except RankFailure:  # logged by the core; its open requests got the error
        raise SystemExit(1) from None
    finally:
        outputs.close(linger=5000)  # the errors of the open requests reach the front end
    sender = core.executor.sender
    if sender is not None:
        from radixlm.runtime.distributed import destroy_tensor_parallel

        sender.stop()  # the workers exit
        destroy_tensor_parallel()
    core.grammar.shutdown()
    commands.close(0)
    ctx.term()
