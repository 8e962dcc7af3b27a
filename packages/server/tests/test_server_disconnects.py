"""Clients that go away abort their requests in the engine; everyone else is served."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from radixlm.server import ServerConfig

TOKENS = 40


def wait_until_idle(engine: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)


async def chat_stream(client: httpx.AsyncClient, rid: str, leave_after: int | None) -> str | None:
    """Stream a chat completion; with `leave_after`, hang up after that many chunks."""
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "rid": rid,
    }
    text = ""
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return text
            choice = json.loads(data)["choices"][0]
            text += choice["delta"].get("content") or ""
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


def test_fifty_streams_with_ten_leaving_early(make_server: Any) -> None:
    live, engine = make_server(ServerConfig(), token_delay=0.01)

    async def run_all() -> list[str | None]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
            jobs = [
                chat_stream(client, f"client-{i}", leave_after=3 if i % 5 == 0 else None)
                for i in range(50)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    wait_until_idle(engine)
    leavers = {f"client-{i}" for i in range(0, 50, 5)}
    finished = [r for r in results if r is not None]
    assert len(finished) == 40
    assert len(set(finished)) == 1 and len(engine.tokenizer.encode(finished[0])) >= TOKENS - 2
    assert set(engine.closed_early) == leavers  # each disconnect closed its engine stream
    assert set(engine.completed) == {f"client-{i}" for i in range(50)} - leavers
    assert engine.active == {}  # no leaked requests
    assert httpx.get(f"{live.url}/get_server_info").json()["num_running_reqs"] == 0
    assert httpx.get(f"{live.url}/get_server_info").json()["http_requests_in_flight"] == 0


def test_non_streamed_request_is_aborted_when_the_client_times_out(make_server: Any) -> None:
    live, engine = make_server(ServerConfig(), token_delay=0.01)
    body = {"text": "x", "rid": "impatient", "sampling_params": {"max_new_tokens": 10_000,
                                                                 "ignore_eos": True}}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/generate", json=body, timeout=0.3)
    wait_until_idle(engine)
    assert engine.closed_early == ["impatient"]


def test_native_stream_disconnect_aborts_the_batch(make_server: Any) -> None:
    live, engine = make_server(ServerConfig(), token_delay=0.01)
    body = {
        "text": ["a", "b", "c"],
        "rid": ["b-0", "b-1", "b-2"],
        "stream": True,
        "sampling_params": {"max_new_tokens": 10_000, "ignore_eos": True},
    }
    with httpx.stream("POST", f"{live.url}/generate", json=body) as response:
        next(line for line in response.iter_lines() if line.startswith("data:"))
    wait_until_idle(engine)
    assert sorted(engine.closed_early) == ["b-0", "b-1", "b-2"]
