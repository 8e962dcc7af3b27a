"""GrammarCompiler: futures, the LRU cache of results and errors, time limits, shutdown."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from radixlm.constrained import CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec


class FakeBackend:
    """Compiles by sleeping `delays[source]` seconds; sources starting with "bad" fail."""

    name = "fake"
    supported_kinds = frozenset({"regex"})
    tokenizer_info: Any = None

    def __init__(self, delays: dict[str, float] | None = None) -> None:
        self.delays = delays or {}
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self.lock:
            self.calls.append(str(spec.source))
        time.sleep(self.delays.get(str(spec.source), 0.0))
        if str(spec.source).startswith("bad"):
            raise GrammarError("bad regex", kind=spec.kind)
        return CompiledGrammar(spec=spec, backend=self.name, handle=object())

    def matcher(self, compiled: CompiledGrammar) -> Any:
        return compiled


def regex(source: str) -> GrammarSpec:
    return GrammarSpec("regex", source)


def test_submit_returns_a_future_of_the_compiled_grammar() -> None:
    with GrammarCompiler(FakeBackend()) as compiler:
        compiled = compiler.submit(regex("a")).result(timeout=5)
    assert compiled.spec == regex("a") and compiled.backend == "fake"


def test_a_second_request_is_a_cache_hit() -> None:
    backend = FakeBackend()
    with GrammarCompiler(backend) as compiler:
        first = compiler.compile(regex("a"))
        assert compiler.compile(regex("a")) is first
        info = compiler.cache_info()
    assert backend.calls == ["a"]
    assert (info.hits, info.misses, info.size) == (1, 1, 1)


def test_errors_are_cached_too() -> None:
    backend = FakeBackend()
    with GrammarCompiler(backend) as compiler:
        for _ in range(3):
            with pytest.raises(GrammarError, match="bad regex") as caught:
                compiler.compile(regex("bad("))
    assert backend.calls == ["bad("]
    assert caught.value.backend == "fake"


def test_concurrent_requests_share_one_compilation() -> None:
    backend = FakeBackend({"slow": 0.3})
    with GrammarCompiler(backend, max_workers=2) as compiler:
        futures = [compiler.submit(regex("slow")) for _ in range(5)]
        results = {id(f.result(timeout=5)) for f in futures}
    assert backend.calls == ["slow"] and len(results) == 1


def test_least_recently_used_entries_are_evicted() -> None:
    backend = FakeBackend()
    with GrammarCompiler(backend, cache_size=2) as compiler:
        for source in ("a", "b", "a", "c", "a", "b"):
            compiler.compile(regex(source))
    assert backend.calls == ["a", "b", "c", "b"]


def test_submit_never_waits_for_a_busy_worker() -> None:
    backend = FakeBackend({"slow": 1.0})
    with GrammarCompiler(backend, max_workers=1) as compiler:
        compiler.submit(regex("slow"))
        start = time.monotonic()
        future = compiler.submit(regex("a"))
        assert time.monotonic() - start < 0.2
        assert not future.done()
        future.result(timeout=5)


def test_a_compilation_past_the_time_limit_fails_at_the_deadline() -> None:
    backend = FakeBackend({"slow": 2.0})
    with GrammarCompiler(backend, max_workers=1, time_limit_s=0.2) as compiler:
        start = time.monotonic()
        with pytest.raises(GrammarError, match=r"longer than 0\.2 s"):
            compiler.compile(regex("slow"))
        assert time.monotonic() - start < 1.0
        # The stuck compilation does not hold up the pool.
        assert compiler.compile(regex("a")).spec == regex("a")
        assert compiler.cache_info().timeouts == 1


def test_timeouts_are_cached_like_other_errors() -> None:
    backend = FakeBackend({"slow": 0.6})
    with GrammarCompiler(backend, time_limit_s=0.1) as compiler:
        for _ in range(2):
            with pytest.raises(GrammarError, match="longer"):
                compiler.compile(regex("slow"))
    assert backend.calls == ["slow"]


def test_cache_keys_include_the_backend_name() -> None:
    one, other = FakeBackend(), FakeBackend()
    other.name = "other"
    with GrammarCompiler(one) as first, GrammarCompiler(other) as second:
        assert first.compile(regex("a")).backend == "fake"
        assert second.compile(regex("a")).backend == "other"


def test_shutdown_cancels_queued_work_and_refuses_more() -> None:
    backend = FakeBackend({"slow": 0.5})
    compiler = GrammarCompiler(backend, max_workers=1)
    compiler.submit(regex("slow"))
    time.sleep(0.05)
    queued = compiler.submit(regex("queued"))
    compiler.shutdown()
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        compiler.submit(regex("a"))


def test_clear_cache_forgets_finished_results() -> None:
    backend = FakeBackend()
    with GrammarCompiler(backend) as compiler:
        compiler.compile(regex("a"))
        compiler.clear_cache()
        compiler.compile(regex("a"))
    assert backend.calls == ["a", "a"]


def test_compiles_on_a_real_backend(backends: dict[str, Any]) -> None:
    with GrammarCompiler(backends["xgrammar"]) as compiler:
        grammar = compiler.matcher(GrammarSpec("choice", ["x", "y"]))
    assert not grammar.is_terminated()
