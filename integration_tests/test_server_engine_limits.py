"""Oversized requests against the real engine (the tiny Llama): a 64 MiB body is refused with a
413 within seconds, on /generate and /v1/chat/completions, while a normal request sent beside it
is answered; a body under the limit whose text cannot fit in the context is a 400 naming the
field, before anything tokenizes it. (Before the body limit and the character bound, a 64 MiB
body took about three minutes to be refused, and held up every other request meanwhile.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

MiB = 1024 * 1024
#: Generous: a liveness check (a refusal takes well under a second here), not a speed claim.
SECONDS = 10.0


def big_body(route: str, size: int) -> bytes:
    """A JSON body of exactly `size` bytes for `route`, its text one long prompt."""

    def body(pad: str) -> bytes:
        if route == "/generate":
            return json.dumps({"text": pad}).encode()
        return json.dumps({"messages": [{"role": "user", "content": pad}]}).encode()

    return body("x" * (size - len(body(""))))


def chunked(raw: bytes, size: int = MiB) -> Iterator[bytes]:
    for start in range(0, len(raw), size):
        yield raw[start : start + size]


def normal_request(url: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def send_beside(url: str, route: str, content: Any) -> tuple[httpx.Response, float, httpx.Response]:
    """Send the big body and, once it is under way, a normal request: (the big one's answer,
    its seconds, the normal one's answer)."""
    answer: dict[str, Any] = {}

    def big() -> None:
        start = time.monotonic()
        with httpx.Client(timeout=120) as client:
            answer["response"] = client.post(
                f"{url}{route}", content=content, headers={"Content-Type": "application/json"}
            )
        answer["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.05)
    normal = normal_request(url)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the big request never finished"
    return answer["response"], answer["seconds"], normal


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_a_64_mib_body_is_refused_413_at_once_and_a_normal_request_beside_it_is_served(
    server: Any, route: str
) -> None:
    response, seconds, normal = send_beside(server.url, route, big_body(route, 64 * MiB))
    assert response.status_code == 413, response.text[:300]
    assert "--max-request-bytes" in response.json()["error"]["message"]
    assert seconds < SECONDS
    assert normal.status_code == 200, normal.text
    assert normal.json()["choices"][0]["message"]["role"] == "assistant"
    server.assert_no_leaks()


def test_a_chunked_64_mib_body_is_refused_413_once_past_the_limit(server: Any) -> None:
    raw = big_body("/generate", 64 * MiB)
    response, seconds, normal = send_beside(server.url, "/generate", chunked(raw))
    assert response.status_code == 413, response.text[:300]
    assert seconds < SECONDS
    assert normal.status_code == 200, normal.text


@pytest.mark.parametrize(
    ("route", "param"), [("/v1/chat/completions", "messages"), ("/generate", "text")]
)
def test_an_8_mib_text_far_longer_than_the_context_is_refused_400_naming_the_field(
    server: Any, http: httpx.Client, route: str, param: str
) -> None:
    start = time.monotonic()
    response = http.post(
        route, content=big_body(route, 8 * MiB), headers={"Content-Type": "application/json"}
    )
    seconds = time.monotonic() - start
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param
    assert "characters long" in error["message"] and "shorten it" in error["message"]
    assert seconds < SECONDS
    server.assert_no_leaks()
