"""An engine that stops serving (EngineUnavailable, `healthy` False): 503 `engine_unavailable`
before a response starts, an error event that ends a stream already under way, and `/health`
answering 503 until the engine serves again."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import server_fake_engine as fake  # loaded by conftest.py

from radixlm.sampling import EngineUnavailable, GenerateChunk, GenerateRequest
from radixlm.server import ServerConfig

DIED = "the engine process died (exit code -9); it is being restarted, retry shortly"
LONG = {"max_new_tokens": 500, "ignore_eos": True}


class DyingEngine(fake.FakeEngine):  # type: ignore[misc]
    """The toy engine, with radixlm's `healthy` and `failed`; `die()` ends every open
    stream with EngineUnavailable, as a dead engine process does."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, token_delay=0.01)  # streams outlast the test's reads
        self.healthy = True
        self.failed = False
        self.dying = False

    def die(self) -> None:
        self.healthy = False
        self.dying = True

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if not self.healthy:
            raise EngineUnavailable("the engine is not serving (its process is restarting)")
        async for chunk in super().generate(request):
            if self.dying:
                raise EngineUnavailable(DIED)
            yield chunk


def _served(make_server: Any, tokenizer: Any, monkeypatch: Any) -> tuple[Any, DyingEngine]:
    monkeypatch.setattr(fake, "FakeEngine", DyingEngine)
    try:
        return make_server(ServerConfig(served_model_name="toy"))  # type: ignore[no-any-return]
    finally:
        monkeypatch.undo()


def _events(lines: list[str]) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_health_is_503_while_the_engine_is_down_and_200_once_it_serves_again(
    make_server: Any, tokenizer: Any, monkeypatch: Any
) -> None:
    live, engine = _served(make_server, tokenizer, monkeypatch)
    assert httpx.get(f"{live.url}/health").status_code == 200
    engine.healthy = False
    down = httpx.get(f"{live.url}/health")
    assert down.status_code == 503
    assert down.json()["error"]["code"] == "engine_unavailable"
    assert "restarting" in down.json()["error"]["message"]
    engine.failed = True
    assert "will not restart" in httpx.get(f"{live.url}/health").json()["error"]["message"]
    engine.healthy, engine.failed = True, False
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_a_request_while_the_engine_is_down_is_a_503_on_every_route(
    make_server: Any, tokenizer: Any, monkeypatch: Any
) -> None:
    live, engine = _served(make_server, tokenizer, monkeypatch)
    engine.healthy = False
    chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}]}
    for route, body in [
        ("/generate", {"text": "hi"}),
        ("/generate", {"text": "hi", "stream": True}),
        ("/v1/completions", {"model": "toy", "prompt": "hi"}),
        ("/v1/chat/completions", {**chat, "stream": True}),
    ]:
        response = httpx.post(f"{live.url}{route}", json=body, timeout=30)
        assert response.status_code == 503, (route, response.text)
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable" and "restarting" in error["message"]


def test_an_engine_dying_mid_stream_ends_a_generate_stream_with_an_error_event(
    make_server: Any, tokenizer: Any, monkeypatch: Any
) -> None:
    live, engine = _served(make_server, tokenizer, monkeypatch)
    body = {"text": "long", "stream": True, "sampling_params": LONG}
    with httpx.stream("POST", f"{live.url}/generate", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        engine.die()
        rest = _events([line for line in lines if line])
    assert rest[-1] == "[DONE]"
    error = rest[-2]["error"]
    assert error["code"] == "engine_unavailable" and error["message"] == DIED
    assert engine.active == {}


def test_an_engine_dying_mid_stream_ends_a_chat_stream_with_an_error_event(
    make_server: Any, tokenizer: Any, monkeypatch: Any
) -> None:
    live, engine = _served(make_server, tokenizer, monkeypatch)
    body = {
        "model": "toy",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        **LONG,
        "max_tokens": 500,
    }
    body.pop("max_new_tokens")
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line)
        engine.die()
        rest = _events([line for line in lines if line])
    assert rest[-1] == "[DONE]"
    assert rest[-2]["error"]["code"] == "engine_unavailable"
    assert all("choices" in event for event in rest[:-2])
