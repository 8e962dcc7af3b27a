"""The HTTP router in PD mode, live, over fake prefill and decode workers: both get the same
body with the bootstrap fields of the chosen prefill worker, the client gets the decode
worker's answer byte for byte, a failing half aborts the other and its error reaches the
client, the prefill side is cache-aware and the decode side load-based."""

from __future__ import annotations

import json
import threading
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


def _pd(prefill: list[Any], decode: list[Any], **options: Any) -> RouterConfig:
    ports = [(w.url, 9000 + i) for i, w in enumerate(prefill)]
    return RouterConfig.pd(ports, [w.url for w in decode], **options)


def _wait(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not come true in time")
        time.sleep(0.02)


def test_both_workers_get_the_same_body_with_the_bootstrap_fields(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    front = router(_pd([prefill], [decode]))
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    answer = httpx.post(front.url + "/generate", json=body)
    assert answer.status_code == 200
    assert answer.content == decode.sent[0]  # the decode worker's answer, not the prefill's
    # The prefill half runs beside the decode half, so it may land after the answer.
    _wait(lambda: len(prefill.raw) == len(decode.raw))
    assert prefill.raw == decode.raw  # the same bytes
    (sent,) = decode.bodies
    assert sent["text"] == "hello" and sent["sampling_params"] == {"max_new_tokens": 4}
    assert sent["bootstrap_host"] == "127.0.0.1" and sent["bootstrap_port"] == 9000
    assert isinstance(sent["bootstrap_room"], int) and 0 <= sent["bootstrap_room"] < 2**63
    assert isinstance(sent["rid"], str) and sent["rid"]  # the router gave it one


def test_each_request_gets_its_own_room_and_keeps_the_clients_rid(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    front = router(_pd([prefill], [decode]))
    for rid in ("a", "b"):
        httpx.post(front.url + "/generate", json={"text": "x", "rid": rid})
    assert [b["rid"] for b in decode.bodies] == ["a", "b"]
    assert decode.bodies[0]["bootstrap_room"] != decode.bodies[1]["bootstrap_room"]


def test_openai_routes_carry_the_fields_at_the_top_level(workers: Workers, router: Start) -> None:
    prefill, decode = workers(2)
    front = router(_pd([prefill], [decode]))
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    completion = {"model": "fake", "prompt": "once upon", "max_tokens": 3}
    assert httpx.post(front.url + "/v1/chat/completions", json=chat).status_code == 200
    assert httpx.post(front.url + "/v1/completions", json=completion).status_code == 200
    _wait(lambda: len(prefill.routes) == 2)  # the prefill half may land after the answer
    assert prefill.routes == decode.routes == ["/v1/chat/completions", "/v1/completions"]
    assert prefill.raw == decode.raw
    for body, sent in zip((chat, completion), decode.bodies, strict=True):
        extra = {k: v for k, v in sent.items() if k not in body}
        assert set(extra) == {"bootstrap_host", "bootstrap_port", "bootstrap_room", "rid"}


def test_the_client_gets_the_decode_stream_byte_for_byte(workers: Workers, router: Start) -> None:
    prefill, decode = workers(2)
    decode.delay = 0.02
    front = router(_pd([prefill], [decode]))
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", front.url + "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        received = b"".join(answer.iter_raw())
    assert received == b"".join(decode.sent)
    assert b"w0-" not in received  # nothing of the prefill worker's own stream


def test_a_failing_prefill_aborts_the_decode_and_its_error_is_the_answer(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    prefill.fail, decode.hold = 500, True
    front = router(_pd([prefill], [decode]))
    answer = httpx.post(front.url + "/generate", json={"text": "x", "rid": "r1"}, timeout=10)
    assert answer.status_code == 500 and answer.json() == prefill.error_body()
    _wait(lambda: "r1" in decode.aborts)  # posted before the answer; recorded by now
    listed = httpx.get(front.url + "/list_workers").json()["workers"]
    assert [w["in_flight"] for w in listed] == [0, 0]


def test_an_error_inside_the_prefills_200_stream_counts_as_its_failure(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    prefill.error_in_stream, decode.hold = True, True
    front = router(_pd([prefill], [decode]))
    body = {"text": "x", "rid": "r2", "stream": True}
    answer = httpx.post(front.url + "/generate", json=body, timeout=10)
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "w0 refused the request"
    _wait(lambda: "r2" in decode.aborts)


def test_an_unreachable_prefill_aborts_the_decode_with_a_502_naming_it(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    decode.hold = True
    front = router(_pd([prefill], [decode], health=NO_RECHECKS))
    prefill.stop()
    answer = httpx.post(front.url + "/generate", json={"text": "x", "rid": "r3"}, timeout=10)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["worker"] == prefill.url and prefill.url in error["message"]
    assert error["code"] == "prefill_worker_failed"
    _wait(lambda: "r3" in decode.aborts)


def test_a_dead_decode_is_a_502_naming_it_and_the_prefill_is_aborted(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    prefill.hold = True
    front = router(_pd([prefill], [decode], health=NO_RECHECKS))
    decode.stop()
    answer = httpx.post(front.url + "/generate", json={"text": "x", "rid": "r4"}, timeout=10)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["worker"] == decode.url and "decode worker" in error["message"]
    _wait(lambda: "r4" in prefill.aborts)
    # Out of routing now: the next request is refused at once, naming the pool.
    again = httpx.post(front.url + "/generate", json={"text": "x"}, timeout=10)
    assert again.status_code == 503 and "no decode worker" in again.json()["error"]["message"]


def test_a_decode_error_status_is_the_answer_and_aborts_the_prefill(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    prefill.hold, decode.fail = True, 503
    front = router(_pd([prefill], [decode]))
    answer = httpx.post(front.url + "/generate", json={"text": "x", "rid": "r5"}, timeout=10)
    assert answer.status_code == 503 and answer.json() == decode.error_body()
    _wait(lambda: "r5" in prefill.aborts)


def test_a_prefill_failing_under_a_stream_ends_it_with_its_error(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    prefill.fail, prefill.delay = 500, 0.3
    decode.delay = 0.2  # the first event at 0.2 s, the next at 0.4 s
    front = router(_pd([prefill], [decode]))
    body = {"text": "x", "rid": "r6", "stream": True}
    with httpx.stream("POST", front.url + "/generate", json=body, timeout=10) as answer:
        assert answer.status_code == 200
        events = b"".join(answer.iter_raw()).decode().strip().split("\n\n")
    assert events[0] == decode.sent[0].decode().strip()
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["worker"] == prefill.url and "w0 refused the request" in error["message"]
    assert events[-1] == "data: [DONE]" and len(events) < 5
    _wait(lambda: "r6" in decode.aborts)


def test_the_prefill_side_keeps_shared_prefixes_together(workers: Workers, router: Start) -> None:
    *prefill, decode = workers(3)
    front = router(_pd(prefill, [decode]))
    prefixes = [f"tenant {p}: " + "a long few-shot prefix " * 20 for p in range(4)]
    with httpx.Client(base_url=front.url) as client:
        for round_ in range(3):
            for prefix in prefixes:
                client.post("/generate", json={"text": f"{prefix} question {round_}"})
    where: dict[str, set[int]] = {}
    for body in decode.bodies:
        where.setdefault(body["text"][:9], set()).add(body["bootstrap_port"])
    assert len(where) == 4 and all(len(ports) == 1 for ports in where.values()), where
    _wait(lambda: sum(len(w.bodies) for w in prefill) == 12)  # the last may land late
    assert all(w.bodies for w in prefill)
    for worker, port in zip(prefill, (9000, 9001), strict=True):
        assert {b["bootstrap_port"] for b in worker.bodies} == {port}


def test_the_decode_side_takes_the_worker_with_the_fewest_in_flight(
    workers: Workers, router: Start
) -> None:
    prefill, *decode = workers(3)
    decode[0].hold = decode[1].hold = True
    front = router(_pd([prefill], decode))
    with httpx.Client(base_url=front.url, timeout=20) as client:
        held = [
            threading.Thread(target=client.post, args=("/generate",), kwargs={"json": body})
            for body in ({"text": "same", "rid": "h1"}, {"text": "same", "rid": "h2"})
        ]
        held[0].start()
        _wait(lambda: any(w.bodies for w in decode))
        held[1].start()  # one in flight on one worker: this goes to the other
        _wait(lambda: all(w.bodies for w in decode))
        for rid in ("h1", "h2"):
            assert client.post("/abort_request", json={"rid": rid}).json()["success"]
        for thread in held:
            thread.join(timeout=10)
    assert sorted(w.bodies[0]["rid"] for w in decode) == ["h1", "h2"]
    assert sorted(prefill.aborts) == ["h1", "h2"]  # an abort reaches both halves


def test_pd_info_names_both_pools(workers: Workers, router: Start) -> None:
    prefill, decode = workers(2)
    front = router(_pd([prefill], [decode]))
    info = httpx.get(front.url + "/get_server_info").json()
    assert info["router"]["mode"] == "pd"
    assert info["router"]["policies"] == {"prefill": "cache_aware", "decode": "shortest_queue"}
    roles = [(w["role"], w.get("bootstrap_port")) for w in info["workers"]]
    assert roles == [("prefill", 9000), ("decode", None)]
    assert httpx.get(front.url + "/health").status_code == 200


def test_without_a_serving_decode_worker_the_router_is_not_healthy(
    workers: Workers, router: Start
) -> None:
    (prefill,) = workers(1)
    front = router(RouterConfig.pd([(prefill.url, None)], [fakes.dead_url()]))
    health = httpx.get(front.url + "/health")
    assert health.status_code == 503 and "no decode worker" in health.json()["error"]["message"]
    answer = httpx.post(front.url + "/generate", json={"text": "x"})
    assert answer.status_code == 503 and not prefill.bodies


def test_a_client_gone_before_the_answer_aborts_both_halves(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    prefill.hold = decode.hold = True
    front = router(_pd([prefill], [decode]))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(front.url + "/generate", json={"text": "x", "rid": "r7"}, timeout=0.5)
    _wait(lambda: "r7" in prefill.aborts and "r7" in decode.aborts)
    _wait(lambda: [w["in_flight"] for w in _listed(front)] == [0, 0])


def test_a_client_gone_under_a_stream_aborts_the_prefill_still_running(
    workers: Workers, router: Start
) -> None:
    prefill, decode = workers(2)
    prefill.hold, decode.delay = True, 0.2
    front = router(_pd([prefill], [decode]))
    body = {"text": "x", "rid": "r8", "stream": True}
    with httpx.stream("POST", front.url + "/generate", json=body, timeout=10) as answer:
        first = next(answer.iter_raw())
    assert first == decode.sent[0]
    _wait(lambda: "r8" in prefill.aborts)
    _wait(lambda: [w["in_flight"] for w in _listed(front)] == [0, 0])


def _listed(front: Any) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = httpx.get(front.url + "/list_workers").json()["workers"]
    return workers
