"""The HTTP router in regular mode, live, over fake worker servers: it proxies the generating
routes (streamed or not, byte for byte) to a worker the policy picks, keeps shared prefixes
together, takes failing workers out of routing and brings them back, and answers the info
and control routes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("httpx", reason="the HTTP router needs the http extra")
pytest.importorskip("fastapi", reason="the HTTP router needs the http extra")

import httpx
import router_fakes as fakes  # loaded by conftest.py

from radixlm.router.workers import HealthConfig, RouterConfig

Workers = Callable[[int], list[Any]]
Start = Callable[[RouterConfig], Any]
#: Health checks that never run again during a test (the first, at start-up, does).
NO_RECHECKS = HealthConfig(interval_s=600.0)


def _wait(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not come true in time")
        time.sleep(0.02)


def test_generate_is_answered_by_one_worker_byte_for_byte(workers: Workers, router: Start) -> None:
    pool = workers(2)
    front = router(RouterConfig.regular([w.url for w in pool], policy="round_robin"))
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "rid": "r1"}
    answer = httpx.post(front.url + "/generate", json=body)
    assert answer.status_code == 200
    (worker,) = [w for w in pool if w.bodies]
    assert worker.bodies == [body]
    assert answer.content == worker.sent[0]
    assert answer.headers["content-type"] == "application/json"


def test_a_stream_comes_back_byte_for_byte(workers: Workers, router: Start) -> None:
    (worker,) = workers(1)
    front = router(RouterConfig.regular([worker.url]))
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", front.url + "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        received = b"".join(answer.iter_raw())
    assert received == b"".join(worker.sent)
    assert received.endswith(b"data: [DONE]\n\n")
    assert worker.routes == ["/v1/chat/completions"]


def test_a_stream_the_worker_breaks_off_ends_with_an_error_event(
    workers: Workers, router: Start
) -> None:
    (worker,) = workers(1)
    worker.break_stream = True
    front = router(RouterConfig.regular([worker.url]))
    with httpx.stream(
        "POST", front.url + "/generate", json={"text": "x", "stream": True}
    ) as answer:
        events = b"".join(answer.iter_raw()).decode().strip().split("\n\n")
    assert events[0] == worker.sent[0].decode().strip()
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["worker"] == worker.url and "broke off" in error["message"]
    assert events[2:] == ["data: [DONE]"]


def test_every_generating_route_is_proxied_unchanged(workers: Workers, router: Start) -> None:
    (worker,) = workers(1)
    front = router(RouterConfig.regular([worker.url]))
    raw = b'{"model": "fake",  "prompt": "spacing kept", "max_tokens": 2}'
    headers = {"content-type": "application/json", "authorization": "Bearer k"}
    for route in ("/v1/completions", "/generate"):
        assert httpx.post(front.url + route, content=raw, headers=headers).status_code == 200
    assert worker.raw == [raw, raw]
    assert worker.routes == ["/v1/completions", "/generate"]


def test_cache_aware_keeps_shared_prefixes_on_one_worker(workers: Workers, router: Start) -> None:
    pool = workers(2)
    front = router(RouterConfig.regular([w.url for w in pool], policy="cache_aware"))
    prefixes = [f"system prompt {p}: " + "a long shared instruction " * 20 for p in range(4)]
    with httpx.Client(base_url=front.url) as client:
        for round_ in range(3):
            for p, prefix in enumerate(prefixes):
                text = f"{prefix} question {round_}-{p}"
                assert client.post("/generate", json={"text": text}).status_code == 200
                messages = [{"role": "system", "content": prefix}, {"role": "user", "content": "q"}]
                chat = {"model": "fake", "messages": messages}
                assert client.post("/v1/chat/completions", json=chat).status_code == 200
    # A chat is keyed by its rendered messages, a text by itself: eight prefixes in all.
    where: dict[tuple[str, str], set[str]] = {}
    for worker in pool:
        for route, body in zip(worker.routes, worker.bodies, strict=True):
            text = body.get("text") or body["messages"][0]["content"]
            where.setdefault((route, text[:16]), set()).add(worker.name)
    assert len(where) == 8 and all(len(names) == 1 for names in where.values()), where
    assert all(w.bodies for w in pool)  # new prefixes spread over both


def test_round_robin_uses_every_worker(workers: Workers, router: Start) -> None:
    pool = workers(3)
    front = router(RouterConfig.regular([w.url for w in pool], policy="round_robin"))
    for i in range(6):
        httpx.post(front.url + "/generate", json={"text": f"same prompt {i}"})
    assert [len(w.bodies) for w in pool] == [2, 2, 2]


def test_a_worker_that_refuses_a_request_is_skipped_and_taken_out(
    workers: Workers, router: Start
) -> None:
    pool = workers(2)
    front = router(
        RouterConfig.regular([w.url for w in pool], policy="round_robin", health=NO_RECHECKS)
    )
    pool[0].stop()  # no health check notices it: the requests do
    for i in range(4):
        assert httpx.post(front.url + "/generate", json={"text": f"p{i}"}).status_code == 200
    assert len(pool[1].bodies) == 4
    listed = httpx.get(front.url + "/list_workers").json()["workers"]
    assert [w["healthy"] for w in listed] == [False, True]


def test_with_every_worker_down_requests_get_a_503_naming_the_pool(router: Start) -> None:
    front = router(RouterConfig.regular([fakes.dead_url()]))
    answer = httpx.post(front.url + "/generate", json={"text": "x"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert "no regular worker is serving" in answer.json()["error"]["message"]
    assert httpx.get(front.url + "/health").status_code == 503


def test_health_checks_take_a_failing_worker_out_and_bring_it_back(
    workers: Workers, router: Start
) -> None:
    pool = workers(2)
    front = router(RouterConfig.regular([w.url for w in pool], health=fakes.QUICK_HEALTH))

    def healthy() -> list[bool]:
        return [w["healthy"] for w in httpx.get(front.url + "/list_workers").json()["workers"]]

    assert healthy() == [True, True]
    pool[0].health_status = 503
    _wait(lambda: healthy() == [False, True])
    for i in range(3):
        httpx.post(front.url + "/generate", json={"text": f"while down {i}"})
    assert not pool[0].bodies and len(pool[1].bodies) == 3
    pool[0].health_status = 200
    _wait(lambda: healthy() == [True, True])


def test_a_worker_error_is_passed_through(workers: Workers, router: Start) -> None:
    (worker,) = workers(1)
    worker.fail = 400
    front = router(RouterConfig.regular([worker.url]))
    answer = httpx.post(front.url + "/generate", json={"text": "x"})
    assert answer.status_code == 400 and answer.json() == worker.error_body()


def test_a_body_that_is_no_json_object_is_a_400(workers: Workers, router: Start) -> None:
    (worker,) = workers(1)
    front = router(RouterConfig.regular([worker.url]))
    answer = httpx.post(front.url + "/generate", content=b"{not json")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
    answer = httpx.post(front.url + "/generate", json=[1, 2])
    assert answer.status_code == 400 and not worker.bodies


def test_info_routes_answer_from_the_workers(workers: Workers, router: Start) -> None:
    pool = workers(2)
    front = router(RouterConfig.regular([w.url for w in pool]))
    assert httpx.get(front.url + "/health").status_code == 200
    assert httpx.get(front.url + "/v1/models").json()["data"][0]["id"] == "fake"
    info = httpx.get(front.url + "/get_server_info").json()
    assert info["router"]["mode"] == "regular"
    assert info["router"]["policies"] == {"regular": "cache_aware"}
    assert [w["server_info"]["name"] for w in info["workers"]] == ["w0", "w1"]
    assert [w["url"] for w in info["workers"]] == [w.url for w in pool]


def test_flush_cache_reaches_every_worker(workers: Workers, router: Start) -> None:
    pool = workers(2)
    front = router(RouterConfig.regular([w.url for w in pool]))
    answer = httpx.post(front.url + "/flush_cache")
    assert answer.status_code == 200 and answer.json()["success"]
    assert [w.flushed for w in pool] == [1, 1]


def test_abort_reaches_the_worker_that_runs_the_request(workers: Workers, router: Start) -> None:
    pool = workers(2)
    for worker in pool:
        worker.hold = True
    front = router(RouterConfig.regular([w.url for w in pool], policy="round_robin"))
    with httpx.Client(base_url=front.url, timeout=20) as client:
        import threading

        held = threading.Thread(
            target=client.post, args=("/generate",), kwargs={"json": {"text": "x", "rid": "r-9"}}
        )
        held.start()
        _wait(lambda: any(w.bodies for w in pool))
        aborted = client.post("/abort_request", json={"rid": "r-9"}).json()
        held.join(timeout=10)
    (runner,) = [w for w in pool if w.bodies]
    assert aborted == {"success": True, "workers": [runner.url]}
    assert runner.aborts == ["r-9"] and not any(w.aborts for w in pool if w is not runner)
