"""Many clients at once on the real engine: concurrent streams with disconnects, the queue limit
(503 only when requests really have to wait), and no KV slot leaked afterwards."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

MODEL = "tiny-llama"
STREAMS = 50
DISCONNECTING = 10
TOKENS = 24  # per completing stream
DISCONNECTING_TOKENS = 900  # would run for long if the disconnect did not abort it (the prompt and this fit the 1024-token context)


async def _chat_stream(client: openai.AsyncOpenAI, i: int, leave: bool) -> dict[str, Any]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"client {i}: tell a long story"}],
        max_tokens=DISCONNECTING_TOKENS if leave else TOKENS,
        temperature=1.0,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    finish = None
    usage = None
    async for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
        if leave and chunks == 3:
            await stream.close()  # the client goes away mid-stream
            return {"left": True}
    return {"left": False, "finish": finish, "tokens": usage.completion_tokens if usage else None}


async def _native_stream(http: httpx.AsyncClient, i: int, leave: bool) -> dict[str, Any]:
    body = {
        "text": f"native client {i} says",
        "sampling_params": {
            "temperature": 0.8,
            "max_new_tokens": DISCONNECTING_TOKENS if leave else TOKENS,
            "ignore_eos": True,
        },
        "stream": True,
    }
    last: dict[str, Any] = {}
    done = False
    async with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                done = True
                break
            last = json.loads(line[5:])
            chunks += 1
            if leave and chunks == 3:
                return {"left": True}  # leaving the block closes the connection
    meta = last.get("meta_info", {})
    return {
        "left": False,
        "finish": (meta.get("finish_reason") or {}).get("type") if done else None,
        "tokens": meta.get("completion_tokens"),
    }


def test_fifty_streams_ten_disconnecting_leave_no_leak(serve: Callable[..., Any]) -> None:
    served = serve({"enable_metrics": True})
    before = served.engine.server_info()["generated_tokens"]

    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=STREAMS * 2, max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as http,
            openai.AsyncOpenAI(
                base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120
            ) as client,
        ):
            tasks = []
            for i in range(STREAMS):
                leave = i % (STREAMS // DISCONNECTING) == 0
                if i % 2:
                    tasks.append(_chat_stream(client, i, leave))
                else:
                    tasks.append(_native_stream(http, i, leave))
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    stayed = [r for r in results if not r["left"]]
    assert len(stayed) == STREAMS - DISCONNECTING
    assert all(r["finish"] == "length" and r["tokens"] == TOKENS for r in stayed), stayed
    served.assert_no_leaks()  # nothing running or queued; every KV slot free or cached
    info = served.engine.server_info()
    generated = info["generated_tokens"] - before
    # The ten that left were aborted early, far from their DISCONNECTING_TOKENS each.
    assert generated < len(stayed) * TOKENS + DISCONNECTING * 100, generated
    with httpx.Client(base_url=served.url) as http:
        assert http.get("/health_generate").status_code == 200
        metrics = http.get("/metrics").text
    assert 'finish_reason="disconnected"' in metrics


def _burst(url: str, count: int, max_new_tokens: int) -> list[int]:
    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {
            "text": f"burst {i}",
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        return (await http.post("/generate", json=body)).status_code

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            return list(await asyncio.gather(*(one(http, i) for i in range(count))))

    return asyncio.run(main())


def test_burst_within_free_running_slots_is_served_whatever_the_queue_limit(
    serve: Callable[..., Any],
) -> None:
    served = serve(max_queued_requests=2, max_running_requests=32)
    statuses = _burst(served.url, 12, 4)
    assert statuses == [200] * 12
    served.assert_no_leaks()


def test_over_max_queued_requests_is_503_and_the_server_recovers(
    serve: Callable[..., Any],
) -> None:
    served = serve(max_queued_requests=2, max_running_requests=2)
    long_body = {
        "text": "occupy a slot",
        "sampling_params": {"max_new_tokens": DISCONNECTING_TOKENS, "ignore_eos": True},
    }

    async def main() -> tuple[list[int], int, dict[str, Any]]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as http:
            # Two run, two wait: the engine is exactly full.
            holders = [
                asyncio.ensure_future(http.post("/generate", json={**long_body, "rid": f"hold{i}"}))
                for i in range(4)
            ]
            deadline = time.monotonic() + 20
            while True:
                info = served.engine.server_info()
                if info["num_running_reqs"] == 2 and info["num_queued_reqs"] == 2:
                    break
                assert time.monotonic() < deadline, info
                await asyncio.sleep(0.01)
            refused = await http.post("/generate", json={"text": "one more"})
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "and me"}]},
            )
            await http.post("/abort_request", json={"abort_all": True})
            done = await asyncio.gather(*holders)
            return (
                [r.status_code for r in done],
                refused.status_code,
                {
                    "body": refused.json(),
                    "chat": chat.status_code,
                },
            )

    statuses, refused, detail = asyncio.run(main())
    assert refused == 503 and detail["chat"] == 503
    assert detail["body"]["error"]["code"] == "overloaded"
    assert statuses == [200] * 4  # aborted requests answer with finish_reason abort
    served.assert_no_leaks()
    with httpx.Client(base_url=served.url) as http:
        assert http.get("/health_generate").status_code == 200
        # Full capacity again: two run and two wait, none refused.
        assert _burst(served.url, 4, 2) == [200] * 4


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _slow_steps(core: Any) -> None:
    """Make every step of this engine's core last at least 5 ms (on its thread)."""
    step = core.step

    def slowed() -> None:
        started = time.monotonic()
        step()
        time.sleep(max(0.0, 0.005 - (time.monotonic() - started)))

    core.step = slowed


def test_clients_that_leave_before_their_answer_abort_running_and_queued_requests(
    serve: Callable[..., Any],
) -> None:
    served = serve(max_running_requests=1)
    engine = served.engine
    # Each step takes at least 5 ms: the running answer needs 4.5 s, far past the clients'
    # half second, however fast the machine decodes the tiny model.
    engine.run_in_loop(_slow_steps)
    body = {
        "text": "an answer nobody waits for",
        "sampling_params": {"max_new_tokens": DISCONNECTING_TOKENS, "ignore_eos": True},
    }
    before = engine.server_info()["generated_tokens"]
    # One runs, one waits behind it; both clients give up (a read timeout closes the socket).
    timeout = httpx.Timeout(30, read=0.5)

    async def leave_both() -> list[BaseException | httpx.Response]:
        async with httpx.AsyncClient(base_url=served.url, timeout=timeout) as http:
            completion = {
                "prompt": "queued",
                "max_tokens": DISCONNECTING_TOKENS,
                "ignore_eos": True,
            }
            calls = [
                http.post("/generate", json=body),
                http.post("/v1/completions", json=completion),
            ]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    outcomes = asyncio.run(leave_both())
    assert all(isinstance(o, httpx.ReadTimeout) for o in outcomes), outcomes
    served.assert_no_leaks()
    assert engine.server_info()["generated_tokens"] - before < DISCONNECTING_TOKENS
    with httpx.Client(base_url=served.url) as http:
        assert http.get("/health_generate").status_code == 200


def test_requests_beyond_the_kv_pool_are_retracted_and_all_complete(
    serve: Callable[..., Any],
) -> None:
    served = serve(max_total_tokens=700)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}

    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as http:
            calls = []
            for i in range(24):
                if i % 3 == 0:
                    body: dict[str, Any] = {"text": f"pressure {i} " * 5, "sampling_params": {
                        "max_new_tokens": 100, "ignore_eos": True, "n": 2}}  # fmt: skip
                    calls.append(http.post("/generate", json=body))
                elif i % 3 == 1:
                    chat = {"model": MODEL, "messages": [{"role": "user", "content": f"x{i}"}],
                            "max_tokens": 100, "ignore_eos": True, "logprobs": True}  # fmt: skip
                    calls.append(http.post("/v1/chat/completions", json=chat))
                else:
                    constrained = {"text": f"json {i}", "sampling_params": {
                        "max_new_tokens": 100, "json_schema": json.dumps(schema)}}  # fmt: skip
                    calls.append(http.post("/generate", json=constrained))
            return list(await asyncio.gather(*calls))

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200] * 24
    for i, reply in enumerate(replies):
        body = reply.json()
        if i % 3 == 0:
            assert [o["meta_info"]["completion_tokens"] for o in body] == [100, 100]
        elif i % 3 == 1:
            assert body["usage"]["completion_tokens"] == 100
            assert len(body["choices"][0]["logprobs"]["content"]) == 100
        else:
            assert isinstance(json.loads(body["text"])["a"], bool)
    assert served.engine.server_info()["num_retractions"] > 0
    served.assert_no_leaks()
