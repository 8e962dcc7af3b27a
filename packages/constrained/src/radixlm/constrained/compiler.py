"""GrammarCompiler: asynchronous, time-limited, cached compilation for an engine loop."""

from __future__ import annotations

import atexit
import heapq
import itertools
import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from radixlm.constrained.errors import GrammarError
from radixlm.constrained.interfaces import CompiledGrammar, Grammar, GrammarBackend
from radixlm.constrained.spec import GrammarSpec

CacheKey = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class CacheInfo:
    hits: int
    misses: int
    size: int
    max_size: int
    timeouts: int


class GrammarCompiler:
    """Compiles specs on a backend in worker threads, so the caller never blocks.

    `submit(spec)` returns a Future of a `CompiledGrammar` (or of a `GrammarError`). Results
    and errors are cached in an LRU keyed by (backend, kind, source); concurrent requests for
    one spec share one compilation. A compilation that runs past `time_limit_s` resolves its
    future with a `GrammarError` at the deadline (and that error is cached). Native code cannot
    be interrupted: the compilation itself runs to its end on a spare daemon thread, and a
    replacement worker keeps the pool at `max_workers`. Workers are daemon threads; at
    interpreter exit, running compilations get up to `exit_grace_s` to finish (native code
    torn down mid-compilation can abort the process), then the process exits regardless.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        *,
        max_workers: int = 2,
        time_limit_s: float = 10.0,
        cache_size: int = 1024,
        exit_grace_s: float = 60.0,
    ) -> None:
        if max_workers < 1 or cache_size < 1 or time_limit_s <= 0:
            raise ValueError("max_workers and cache_size must be >= 1, time_limit_s > 0")
        self.backend = backend
        self.time_limit_s = time_limit_s
        self._max_size = cache_size
        self._cache: OrderedDict[CacheKey, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[GrammarSpec, Future[CompiledGrammar]] | None] = (
            queue.SimpleQueue()
        )
        self._hits = self._misses = self._timeouts = 0
        self._closed = False
        self._workers = 0
        self._deadlines: list[tuple[float, int, Future[CompiledGrammar], GrammarSpec]] = []
        self._tick = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._running: set[Future[CompiledGrammar]] = set()
        self._busy = 0  # compilations running, timed out or not
        self._idle = threading.Condition(self._lock)
        for _ in range(max_workers):
            self._start_worker()
        # Native code still compiling when the interpreter tears down can abort the process
        # (xgrammar's C++ threads): at exit, give running compilations time to finish.
        atexit.register(_wait_at_exit, weakref.ref(self), exit_grace_s)
        threading.Thread(target=self._watchdog, name="grammar-watchdog", daemon=True).start()

    # -- public -----------------------------------------------------------------------------

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """A Future of the compiled grammar; done at once when cached. Never blocks."""
        key = (self.backend.name, *spec.key)
        with self._lock:
            if self._closed:
                raise RuntimeError("GrammarCompiler is shut down")
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                self._hits += 1
                return future
            self._misses += 1
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self._max_size:
                self._cache.popitem(last=False)
        self._jobs.put((spec, future))
        return future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking convenience: `submit(spec).result()` (raises `GrammarError`)."""
        return self.submit(spec).result()

    def matcher(self, spec: GrammarSpec) -> Grammar:
        """Blocking convenience: a fresh matcher for `spec`."""
        return self.backend.matcher(self.compile(spec))

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                self._hits, self._misses, len(self._cache), self._max_size, self._timeouts
            )

    def clear_cache(self) -> None:
        """Forget finished results (compilations in flight keep their futures)."""
        with self._lock:
            for key in [k for k, f in self._cache.items() if f.done()]:
                del self._cache[key]

    def shutdown(self) -> None:
        """Stop taking work and cancel queued compilations. Does not wait for running ones."""
        with self._lock:
            self._closed = True
            workers = self._workers
            self._wake.notify_all()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[1].cancel()
        for _ in range(workers):
            self._jobs.put(None)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no compilation runs (including ones past their time limit); False when
        `timeout` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- workers ----------------------------------------------------------------------------

    def _start_worker(self) -> None:
        self._workers += 1
        threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            spec, future = job
            if self._closed:
                future.cancel()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                deadline = time.monotonic() + self.time_limit_s
                self._running.add(future)
                self._busy += 1
                heapq.heappush(self._deadlines, (deadline, next(self._tick), future, spec))
                self._wake.notify()
            result: CompiledGrammar | None = None
            error: BaseException | None = None
            try:
                result = self.backend.compile(spec)
            except GrammarError as caught:
                error = caught.with_context(kind=spec.kind, backend=self.backend.name)
            except RecursionError:
                error = GrammarError(
                    f"the {spec.kind} constraint is nested too deeply",
                    kind=spec.kind,
                    backend=self.backend.name,
                )
            except Exception as caught:  # a backend bug must not kill the worker
                error = GrammarError(
                    f"the {spec.kind} constraint failed to compile: {caught}",
                    kind=spec.kind,
                    backend=self.backend.name,
                )
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()
                timed_out = future not in self._running
                if timed_out:  # this thread was replaced at the deadline, so it retires
                    self._workers -= 1
                else:
                    self._running.discard(future)
            if timed_out:
                return
            _settle(future, result, error)

    def _watchdog(self) -> None:
        while True:
            expired: list[tuple[Future[CompiledGrammar], GrammarSpec]] = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and (
                    self._deadlines[0][2] not in self._running or self._deadlines[0][0] <= now
                ):
                    _, _, future, spec = heapq.heappop(self._deadlines)
                    if future in self._running:
                        self._running.discard(future)
                        expired.append((future, spec))
                        self._timeouts += 1
                        self._start_worker()  # the stuck worker retires when it finishes
                if not expired:
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    self._wake.wait(wait)
                    continue
            for future, spec in expired:
                _settle(
                    future,
                    None,
                    GrammarError(
                        f"the {spec.kind} constraint took longer than {self.time_limit_s:g} s "
                        "to compile; simplify it or raise the limit (GrammarCompiler's "
                        "time_limit_s, the server's --grammar-compile-timeout)",
                        kind=spec.kind,
                        backend=self.backend.name,
                        limit="time_limit",
                    ),
                )


def _wait_at_exit(ref: weakref.ref[GrammarCompiler], grace_s: float) -> None:
    compiler = ref()
    if compiler is not None:
        compiler.wait_idle(grace_s)


def _settle(
    future: Future[CompiledGrammar], result: CompiledGrammar | None, error: BaseException | None
) -> None:
    """Resolve a future once; whoever comes second (worker or watchdog) is ignored."""
    try:
        if error is None:
            future.set_result(result)  # type: ignore[arg-type]
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass
