"""Oversized input is refused before it costs anything: bodies over --max-request-bytes get a
413 (from Content-Length, or while a chunked body arrives), prompts whose length in characters
cannot fit in the context get a 400 before they are tokenized, and chat rendering and
tokenizing run in the server's thread pool, off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixlm.sampling import max_token_chars
from radixlm.server import ServerConfig
from radixlm.server.app import BodyLimitMiddleware

LIMIT = 4096
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def limited(make_server: Any) -> Iterator[httpx.Client]:
    """A server whose body limit is LIMIT bytes."""
    live, _ = make_server(ServerConfig(max_request_bytes=LIMIT, enable_metrics=True))
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def padded_generate(size: int) -> bytes:
    """A /generate body of exactly `size` bytes."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "rid": ""}
    head = len(json.dumps(body).encode())
    body["rid"] = "r" * (size - head)
    raw = json.dumps(body).encode()
    assert len(raw) == size
    return raw


def chunks(raw: bytes, size: int = 1000) -> Iterator[bytes]:
    for start in range(0, len(raw), size):
        yield raw[start : start + size]


def assert_too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert error["type"] == "invalid_request_error"
    assert f"{LIMIT:,} bytes" in error["message"] and "--max-request-bytes" in error["message"]


def test_a_body_over_the_limit_is_refused_413_from_its_content_length(
    limited: httpx.Client,
) -> None:
    response = limited.post("/generate", content=padded_generate(LIMIT + 1))
    assert_too_large(response)


def test_a_chunked_body_over_the_limit_is_refused_413(limited: httpx.Client) -> None:
    response = limited.post("/generate", content=chunks(padded_generate(3 * LIMIT)))
    assert_too_large(response)


def test_a_body_at_the_limit_is_served(limited: httpx.Client) -> None:
    assert limited.post("/generate", content=padded_generate(LIMIT)).status_code == 200
    assert limited.post("/generate", content=chunks(padded_generate(LIMIT))).status_code == 200


@pytest.mark.parametrize(
    "route",
    ["/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/abort_request"],
)
def test_the_body_limit_applies_to_every_route(limited: httpx.Client, route: str) -> None:
    assert_too_large(limited.post(route, content=b" " * (LIMIT + 1)))
    assert_too_large(limited.post(route, content=chunks(b" " * (LIMIT * 2))))


def test_refused_bodies_are_counted_as_413_errors(limited: httpx.Client) -> None:
    limited.post("/generate", content=b" " * (LIMIT + 1))
    limited.post("/generate", content=chunks(b" " * (LIMIT * 2)))
    assert 'radixlm_request_errors_total{status="413"} 2.0' in limited.get("/metrics").text


def test_the_server_serves_on_after_refusing_a_body(limited: httpx.Client) -> None:
    assert_too_large(limited.post("/generate", content=b" " * (LIMIT * 50)))
    assert limited.post("/generate", json={"text": "hi"}).status_code == 200


async def _call(
    middleware: BodyLimitMiddleware, headers: list[tuple[bytes, bytes]], body: Iterator[bytes]
) -> tuple[int, int]:
    """Run one request through `middleware` over an app that reads the whole body:
    (the status sent, how many receive() calls the app got through)."""
    received = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        chunk = next(body, None)
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": headers}
    await middleware(scope, receive, send)  # type: ignore[arg-type]
    return int(sent[0]["status"]), received


async def reading_app(scope: Any, receive: Any, send: Any) -> None:
    from starlette.requests import Request
    from starlette.responses import Response

    from radixlm.server.errors import BodyTooLarge, body_too_large

    try:
        await Request(scope, receive).body()
    except BodyTooLarge as error:
        await body_too_large(error.limit).response()(scope, receive, send)
        return
    await Response(status_code=200)(scope, receive, send)


def test_a_declared_length_over_the_limit_is_refused_without_reading_the_body() -> None:
    middleware = BodyLimitMiddleware(reading_app, limit=LIMIT)
    headers = [(b"content-length", str(10 * LIMIT).encode())]
    status, received = asyncio.run(_call(middleware, headers, iter([b"x" * LIMIT] * 10)))
    assert (status, received) == (413, 0)


def test_a_chunked_body_is_read_no_further_than_the_limit() -> None:
    middleware = BodyLimitMiddleware(reading_app, limit=LIMIT)
    endless = iter(lambda: b"x" * 1000, None)
    status, received = asyncio.run(_call(middleware, [], endless))
    assert (status, received) == (413, LIMIT // 1000 + 1)


# Prompts that cannot fit in the context (the toy engine's is 512 tokens).


def too_long(engine: Any) -> str:
    """A text one character longer than the most that can fit in the toy engine's context."""
    bound = engine.max_context_length * max_token_chars(engine.tokenizer)
    return "x" * (bound + 1)


def assert_cannot_fit(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "characters long" in error["message"] and "shorten it" in error["message"]


def test_a_chat_whose_contents_cannot_fit_is_refused_naming_messages(
    http: httpx.Client, engine: Any
) -> None:
    half = len(too_long(engine)) // 2 + 1
    messages = [{"role": "user", "content": "x" * half}, {"role": "user", "content": "y" * half}]
    response = http.post("/v1/chat/completions", json={"messages": messages})
    assert_cannot_fit(response, "messages")


def test_responses_input_that_cannot_fit_is_refused_naming_input(
    http: httpx.Client, engine: Any
) -> None:
    response = http.post("/v1/responses", json={"input": too_long(engine)})
    assert_cannot_fit(response, "input")


def test_a_completion_prompt_that_cannot_fit_is_refused_naming_prompt(
    http: httpx.Client, engine: Any
) -> None:
    response = http.post("/v1/completions", json={"prompt": ["hi", too_long(engine)]})
    assert_cannot_fit(response, "prompt")
    assert not engine.active


def test_a_generate_text_that_cannot_fit_is_refused_naming_text(
    http: httpx.Client, engine: Any
) -> None:
    assert_cannot_fit(http.post("/generate", json={"text": too_long(engine)}), "text")


def test_a_prompt_at_the_bound_reaches_the_engine(http: httpx.Client, engine: Any) -> None:
    at_bound = too_long(engine)[:-1]
    response = http.post("/generate", json={"text": at_bound})
    assert response.status_code == 400  # too many tokens, as the engine finds out
    assert "characters long" not in response.json()["error"]["message"]


class RecordingTokenizer:
    """The toy tokenizer, recording which threads render chat templates and tokenize them."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def encode(self, text: str, **kwargs: Any) -> Any:
        if text.startswith("<|im_start|>"):  # a rendered chat (the toy engine encodes too)
            self.threads.add(threading.current_thread().name)
        return self._tokenizer.encode(text, **kwargs)


def test_chat_rendering_and_tokenizing_run_in_the_server_pool(
    tokenizer: Any, make_server: Any
) -> None:
    recording = RecordingTokenizer(tokenizer)
    live, engine = make_server(ServerConfig())
    engine._tokenizer = recording
    with httpx.Client(base_url=live.url, timeout=30) as client:
        for route, body in [
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ]:
            recording.threads.clear()
            assert client.post(route, json=body).status_code == 200
            assert len(recording.threads) == 1, recording.threads
            assert all(name.startswith("radixlm-server") for name in recording.threads), (
                recording.threads
            )
