"""Operations: `/tokenize` and `/detokenize`, request priorities and timeouts passed to the
engine, and the graceful drain on SIGTERM (503 for new work and the health probe while the
requests in flight finish, then the server stops)."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from radixlm.server import ServerConfig
from radixlm.server.launcher import GracefulDrain

# ----------------------------------------------------------------------- tokenize


def test_tokenize_a_prompt_and_a_batch(http: httpx.Client, tokenizer: Any) -> None:
    text = "hello world, again"
    answer = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = list(tokenizer.encode(text))
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["max_model_len"] == 512
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    batch = http.post("/v1/tokenize", json={"prompt": [text, "x"]}).json()
    assert batch["tokens"] == [ids, list(tokenizer.encode("x"))]
    assert batch["count"] == [len(ids), len(batch["tokens"][1])]
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == list(tokenizer.encode(text, add_special_tokens=False))


def test_tokenize_messages_renders_the_chat_template(http: httpx.Client, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    answer = http.post("/tokenize", json={"messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == list(tokenizer.encode(text, add_special_tokens=False))
    no_prompt = http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert no_prompt["count"] < answer["count"]


def test_detokenize_gives_back_the_text(http: httpx.Client, tokenizer: Any) -> None:
    ids = list(tokenizer.encode("round trip", add_special_tokens=False))
    answer = http.post("/detokenize", json={"tokens": ids}).json()
    assert answer["text"] == answer["prompt"] == tokenizer.decode(ids)
    batch = http.post("/v1/detokenize", json={"tokens": [ids, ids[:1]]}).json()
    assert batch["text"] == [tokenizer.decode(ids), tokenizer.decode(ids[:1])]


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": "a", "unknown": 1}, "unknown"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenize_requests_name_the_field(
    http: httpx.Client, route: str, body: dict[str, Any], field: str
) -> None:
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in (error["param"] or "") + error["message"], error


# --------------------------------------------------------- priority and timeout


def test_priority_and_timeout_reach_the_engine(http: httpx.Client, engine: Any) -> None:
    chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post(
        "/v1/chat/completions", json={**chat, "priority": 7, "timeout": 2.5}
    ).is_success
    sent = engine.received[-1]
    assert (sent.priority, sent.timeout) == (7, 2.5)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "priority": -1}
    assert http.post("/generate", json=body).is_success
    assert engine.received[-1].priority == -1
    bad = http.post("/generate", json={**body, "timeout": -1})
    assert bad.status_code == 400 and "timeout" in bad.text


# ------------------------------------------------ prefill/decode disaggregation fields


def test_bootstrap_fields_reach_the_engine_from_every_route(
    http: httpx.Client, engine: Any
) -> None:
    fields = {"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 2**62}
    chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json={**chat, **fields}).is_success
    sent = engine.received[-1]
    assert (sent.bootstrap_host, sent.bootstrap_port, sent.bootstrap_room) == tuple(fields.values())
    completion = {"model": "toy", "prompt": ["a", "b"], "max_tokens": 2}
    rooms = {**fields, "bootstrap_room": [5, 6]}
    assert http.post("/v1/completions", json={**completion, **rooms}).is_success
    assert [r.bootstrap_room for r in engine.received[-2:]] == [5, 6]
    assert {r.bootstrap_host for r in engine.received[-2:]} == {"10.0.0.2"}
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, **fields}
    assert http.post("/generate", json=body).is_success
    assert engine.received[-1].bootstrap_room == 2**62


@pytest.mark.parametrize(
    ("route", "body"),
    [
        # Two prompts need two rooms (one room pairs one prompt's halves).
        ("/v1/completions", {"model": "toy", "prompt": ["a", "b"], "bootstrap_room": 5}),
        ("/v1/completions", {"model": "toy", "prompt": ["a", "b"], "bootstrap_room": [5]}),
        ("/v1/chat/completions",
         {"model": "toy", "messages": [{"role": "user", "content": "hi"}],
          "bootstrap_room": [5, 6]}),
        ("/generate", {"text": "hi", "bootstrap_room": -1}),
        ("/generate", {"text": "hi", "bootstrap_port": 0}),
    ],
)  # fmt: skip
def test_bad_bootstrap_fields_are_a_400_naming_them(
    http: httpx.Client, route: str, body: dict[str, Any]
) -> None:
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("bootstrap_room", "bootstrap_port")


# ------------------------------------------------------------------------- drain


class _Recorder:
    """Stands in for uvicorn's own signal handler."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def __call__(self, sig: int, frame: Any) -> None:
        self.signals.append(sig)


def test_sigterm_drains_then_stops_the_server(make_server: Any) -> None:
    """Under load: SIGTERM turns new POSTs and /health into 503 (with Retry-After), reads
    still answer, every streamed request in flight finishes whole, and only then does the
    server stop."""
    live, engine = make_server(ServerConfig(served_model_name="toy"), token_delay=0.02)
    drain = GracefulDrain(live.server, live.server.config.app.state.radixlm, timeout=30)
    drain.install()
    body = {"text": "go", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    finished: list[dict[str, Any]] = []

    def stream() -> None:
        with (
            httpx.Client(base_url=live.url, timeout=30) as client,
            client.stream("POST", "/generate", json={**body, "stream": True}) as response,
        ):
            chunks = [
                json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
            ]
        finished.append(chunks[-1])

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while len(engine.active) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.active) == 4
    live.server.handle_exit(signal.SIGTERM, None)
    with httpx.Client(base_url=live.url, timeout=10) as client:
        refused = client.post("/generate", json=body)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "draining"
        assert client.get("/health").status_code == 503
        assert client.get("/v1/models").status_code == 200
    assert not live.server.should_exit  # requests are still in flight
    for thread in threads:
        thread.join(30)
    assert [c["meta_info"]["finish_reason"]["type"] for c in finished] == ["length"] * 4
    assert all(c["meta_info"]["completion_tokens"] == 40 for c in finished)
    assert drain.thread is not None
    drain.thread.join(10)
    assert live.server.should_exit
    live.thread.join(10)
    assert not live.thread.is_alive()


def test_the_drain_gives_up_after_its_timeout_and_other_signals_stop_at_once() -> None:
    class Server:
        should_exit = False

        def __init__(self) -> None:
            self.handle_exit = _Recorder()
            self.config = type("Config", (), {"timeout_graceful_shutdown": None})()

    class State:
        draining = False
        open_requests = 1  # never finishes

    server, state = Server(), State()
    uvicorn_handler = server.handle_exit
    drain = GracefulDrain(server, state, timeout=0.2).install()
    drain.handle_exit(signal.SIGINT, None)
    assert uvicorn_handler.signals == [signal.SIGINT] and not state.draining
    started = time.monotonic()
    drain.handle_exit(signal.SIGTERM, None)
    assert state.draining and uvicorn_handler.signals == [signal.SIGINT]  # not passed on
    assert drain.thread is not None
    drain.thread.join(5)
    assert server.should_exit and time.monotonic() - started >= 0.2
    assert server.config.timeout_graceful_shutdown == drain.linger
    drain.handle_exit(signal.SIGTERM, None)  # a second SIGTERM: uvicorn's own stop
    assert uvicorn_handler.signals == [signal.SIGINT, signal.SIGTERM]
    off = GracefulDrain(Server(), State(), timeout=0)
    off.handle_exit(signal.SIGTERM, None)
    assert off._stop.signals == [signal.SIGTERM]  # type: ignore[attr-defined]
