"""Data parallelism on one machine: two engine replicas of the tiny model (each in its own
engine process, as `radixlm serve --dp-size 2` starts them) behind one server. With
`cache_aware` routing, requests that share a prefix reuse it nearly as much as on one replica;
with `round_robin` measurably less; a replica killed mid-run leaves the other serving every
request sent after."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dp_workload import shared_prefix_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def replicas(tiny_llama: Path) -> Iterator[Any]:
    """Two replicas started the way `radixlm serve --dp-size 2` starts them."""
    from radixlm.server.launcher import build_replicas

    engine = build_replicas(
        str(tiny_llama),
        {"show_progress": False, "max_total_tokens": 8192, "device": "cpu", "engine_restarts": 0},
        dp_size=2,
        router_policy="cache_aware",
    )
    yield engine
    engine.shutdown()


def _serve(engine: Any) -> Any:
    from uvicorn_thread import ThreadedServer

    from radixlm.server import ServerConfig, create_app

    app = create_app(engine, ServerConfig(served_model_name="tiny", log_requests=False))
    return ThreadedServer(app, lifespan="off").start()


def _cached_tokens(engine: Any) -> int:
    """The workload sent one request after another; the sum of their cached tokens."""
    asyncio.run(engine.flush_cache())
    live = _serve(engine)
    try:
        total = 0
        with httpx.Client(base_url=live.url, timeout=60) as http:
            for text in shared_prefix_prompts():
                body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
                answer = http.post("/generate", json=body)
                assert answer.status_code == 200, answer.text
                total += answer.json()["meta_info"]["cached_tokens"]
        return total
    finally:
        live.stop()


def test_cache_aware_reuses_nearly_what_one_replica_would(replicas: Any) -> None:
    from radixlm.router import DataParallelEngine

    single = _cached_tokens(DataParallelEngine(replicas.replicas[:1], "round_robin"))
    cache_aware = _cached_tokens(replicas)
    round_robin = _cached_tokens(DataParallelEngine(replicas.replicas, "round_robin"))
    assert single > 0
    assert cache_aware >= 0.9 * single, (cache_aware, single)
    assert round_robin < 0.95 * cache_aware, (round_robin, cache_aware)
    info = replicas.server_info()
    assert info["dp_size"] == 2 and info["router_policy"] == "cache_aware"
    assert [r["healthy"] for r in info["replicas"]] == [True, True]
    pids = [r["engine_pid"] for r in info["replicas"]]
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_prefixes_are_matched_on_tokens_and_on_text(replicas: Any) -> None:
    from radixlm.router import DataParallelEngine

    by_text = DataParallelEngine(replicas.replicas, "cache_aware", match_on="text")
    assert _cached_tokens(by_text) >= 0.9 * _cached_tokens(
        DataParallelEngine(replicas.replicas[:1], "round_robin")
    )


async def _stream(http: httpx.AsyncClient, i: int, started: set[int] | None = None) -> Any:
    """One long greedy stream; `started` gets `i` at its first chunk. Returns None when it
    ends normally, else its error."""
    body = {
        "text": f"stream {i}",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0.0},
    }
    try:
        async with http.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                return response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return event["error"]
                    if started is not None:
                        started.add(i)
    except httpx.HTTPError as error:
        return repr(error)
    return None


def test_a_killed_replica_leaves_the_other_serving(replicas: Any) -> None:
    from radixlm.router import DataParallelEngine

    engine = DataParallelEngine(replicas.replicas, "round_robin")
    live = _serve(engine)
    try:

        async def main() -> list[Any]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                started: set[int] = set()
                streams = [asyncio.ensure_future(_stream(http, i, started)) for i in range(4)]
                # Two streams on each replica, under way: kill as soon as all four have sent
                # a chunk (a fixed wait raced the CPU decode path, which can finish one).
                deadline = time.monotonic() + 30
                while len(started) < 4 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert len(started) == 4, started
                victim = replicas.replicas[0].engine_pid
                os.kill(victim, signal.SIGKILL)
                return list(await asyncio.wait_for(asyncio.gather(*streams), 60))

        outcomes = asyncio.run(main())
        failed = [o for o in outcomes if o is not None]
        assert len(failed) == 2, outcomes  # the two on the killed replica end with an error
        deadline = time.monotonic() + 10
        while replicas.replicas[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(base_url=live.url, timeout=60) as http:
            for i in range(8):
                body = {"text": f"after {i}", "sampling_params": {"max_new_tokens": 3}}
                answer = http.post("/generate", json=body)
                assert answer.status_code == 200, answer.text
            assert http.get("/health").status_code == 200  # one replica still serves
            info = http.get("/get_server_info").json()
            assert [r["healthy"] for r in info["replicas"]] == [False, True]
    finally:
        live.stop()


def test_no_replica_left_is_a_retryable_503(replicas: Any) -> None:
    from radixlm.router import DataParallelEngine

    survivor = replicas.replicas[1]
    os.kill(survivor.engine_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while survivor.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    live = _serve(DataParallelEngine(replicas.replicas, "cache_aware"))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            answer = http.post("/generate", json={"text": "anyone", "sampling_params": {}})
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "1"
            assert http.get("/health").status_code == 503
    finally:
        live.stop()
