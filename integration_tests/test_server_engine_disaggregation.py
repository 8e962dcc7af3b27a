"""Prefill/decode disaggregation behind the HTTP server: a request sent to a prefill server and a
decode server with the same bootstrap fields (as radixlm-router --pd-disaggregation sends it)
is answered by the decode server as a colocated server answers it, on `/generate` and the
OpenAI routes; a decode server refuses a request without the fields (400); and with real
`radixlm serve --disaggregation-mode prefill` / `decode` processes, a decode engine killed
mid-stream ends the client's stream with an error event instead of leaving it hanging; and
`--dp-size 2` prefill and decode servers (built as `radixlm serve` builds them, served from
this process) answer concurrent requests as a colocated engine, each prefill replica computing
the rooms that are its own, and export their disaggregation queues as gauges."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import free_port, served  # this folder is not a package

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
#: Settings of every engine compared (their numbers agree bit for bit).
ENGINE = {"dtype": "float32", "cpu_threads": 1}


def _fields(prefill_port: int, room: int | list[int] | None = None) -> dict[str, Any]:
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill_port,
        "bootstrap_room": random.getrandbits(63) if room is None else room,
    }


def _both(prefill_url: str, decode_url: str, route: str, body: dict[str, Any]) -> Any:
    """POST `body` to both servers at once, as a router does; the decode server's answer
    (the prefill server's must be a 200 too)."""
    answers: dict[str, httpx.Response] = {}

    def post(name: str, url: str) -> None:
        answers[name] = httpx.post(f"{url}{route}", json=body, timeout=60)

    thread = threading.Thread(target=post, args=("prefill", prefill_url))
    thread.start()
    post("decode", decode_url)
    thread.join(60)
    assert answers["prefill"].status_code == 200, answers["prefill"].text
    assert answers["decode"].status_code == 200, answers["decode"].text
    return answers["decode"].json()


def _without_run_details(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in ("id", "e2e_latency", "timestamps")}


def test_routes_answer_through_a_prefill_and_a_decode_server(serve: Callable[..., Any]) -> None:
    colocated = serve(**ENGINE)
    prefill = serve(disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **ENGINE)
    decode = serve(disaggregation_mode="decode", **ENGINE)
    port = prefill.engine.info.static_info["disaggregation"]["bootstrap_port"]

    body = {
        "text": "Disaggregated: the radix tree",
        "sampling_params": GREEDY,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    answer = _both(prefill.url, decode.url, "/generate", {**body, **_fields(port)})
    expected = httpx.post(f"{colocated.url}/generate", json=body, timeout=60).json()
    assert answer["text"] == expected["text"] and answer["output_ids"] == expected["output_ids"]
    assert _without_run_details(answer["meta_info"]) == _without_run_details(expected["meta_info"])

    chat = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Disaggregated chat, say something"}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    answer = _both(prefill.url, decode.url, "/v1/chat/completions", {**chat, **_fields(port)})
    expected = httpx.post(f"{colocated.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
    assert answer["choices"][0]["logprobs"] == expected["choices"][0]["logprobs"]

    prompts = ["Disaggregated completion one", "Disaggregated completion two"]
    completion = {"model": "tiny-llama", "prompt": prompts, "max_tokens": 6, "temperature": 0}
    rooms = [random.getrandbits(63) for _ in prompts]
    answer = _both(
        prefill.url, decode.url, "/v1/completions", {**completion, **_fields(port, rooms)}
    )
    expected = httpx.post(f"{colocated.url}/v1/completions", json=completion, timeout=60).json()
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in expected["choices"]]

    decode.assert_no_leaks()
    prefill.assert_no_leaks()


def test_a_decode_server_refuses_a_request_without_bootstrap_fields(
    serve: Callable[..., Any],
) -> None:
    decode = serve(disaggregation_mode="decode", **ENGINE)
    body = {"text": "no room", "sampling_params": GREEDY}
    refused = httpx.post(f"{decode.url}/generate", json=body, timeout=30)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "bootstrap_host" and "decode server" in error["message"]
    completion = {"model": "tiny-llama", "prompt": ["a", "b"], "bootstrap_room": 7}
    refused = httpx.post(f"{decode.url}/v1/completions", json=completion, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "bootstrap_room"


def _start_together(
    stack: contextlib.ExitStack,
    servers: Sequence[tuple[list[str], Path, list[subprocess.Popen[bytes]] | None]],
) -> list[str]:
    """Start `radixlm serve` processes at once (each `(args, log, started)`), stopped when
    `stack` closes; their URLs."""
    managers = [served(args, log, free_port(), started=started) for args, log, started in servers]
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
    urls = []
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager.__exit__)
            urls.append(future.result())
    for future in futures:
        future.result()  # the first failure, once every started server will be stopped
    return urls


def _engine_processes(pid: int) -> list[int]:
    """The spawned engine processes among `pid`'s children (Linux: read from /proc)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                found.append(int(child))
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the engine in /proc")
def test_radixlm_serve_prefill_and_decode_processes(tiny_llama: Path, tmp_path: Path) -> None:
    from radixlm.runtime import Engine

    common = [
        "--model-path", str(tiny_llama), "--device", "cpu", "--dtype", "float32",
        "--max-total-tokens", "4096",
    ]  # fmt: skip
    bootstrap_port = free_port()
    prefill_args = [
        *common, "--engine-mode", "thread", "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
    ]  # fmt: skip
    decode_args = [*common, "--disaggregation-mode", "decode", "--engine-restarts", "0"]
    started: list[subprocess.Popen[bytes]] = []
    body = {"text": "Served apart: the prefix", "sampling_params": GREEDY}
    with contextlib.ExitStack() as stack:
        prefill_url, decode_url = _start_together(
            stack,
            [
                (prefill_args, tmp_path / "prefill.log", None),
                (decode_args, tmp_path / "decode.log", started),
            ],
        )
        answer = _both(prefill_url, decode_url, "/generate", {**body, **_fields(bootstrap_port)})
        with Engine(str(tiny_llama), show_progress=False, device="cpu", **ENGINE) as colocated:
            expected = colocated.generate(body["text"], GREEDY)
        assert answer["output_ids"] == expected["output_ids"]
        assert answer["text"] == expected["text"]

        # A long stream whose decode engine is killed once it runs: the stream ends with an
        # error event at once, and the prefill server serves on.
        long_body = {
            "text": "Served apart: a long story",
            "sampling_params": {**GREEDY, "max_new_tokens": 2000},
            "stream": True,
            **_fields(bootstrap_port),
        }
        threading.Thread(
            target=httpx.post, args=(f"{prefill_url}/generate",), kwargs={"json": long_body}
        ).start()
        engines = _engine_processes(started[0].pid)
        assert len(engines) == 1, engines
        events: list[dict[str, Any]] = []
        with httpx.stream("POST", f"{decode_url}/generate", json=long_body, timeout=60) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: {"):
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    killed_at = time.monotonic()
                    os.kill(engines[0], signal.SIGKILL)
        ended_after = time.monotonic() - killed_at
        assert "error" in events[-1], events[-1]
        assert "engine" in events[-1]["error"]["message"]
        assert ended_after < 10
        # The prefill server is not hurt.
        assert httpx.get(f"{prefill_url}/health", timeout=10).status_code == 200


def _replicated(model: Path, mode: str, **options: Any) -> tuple[Any, Any]:
    """A `--dp-size 2` server of `mode` as `radixlm serve` builds it (two engine processes
    behind the server's router), served from this process; (its engine, its live server)."""
    from uvicorn_thread import ThreadedServer

    from radixlm.server import ServerConfig, create_app
    from radixlm.server.launcher import build_replicas

    kwargs = {
        "show_progress": False, "device": "cpu", "dtype": "float32", "max_total_tokens": 4096,
        "engine_restarts": 0, "disaggregation_mode": mode, **options,
    }  # fmt: skip
    engine = build_replicas(str(model), kwargs, dp_size=2, router_policy="cache_aware")
    config = ServerConfig(served_model_name="tiny-llama", enable_metrics=True, log_requests=False)
    return engine, ThreadedServer(create_app(engine, config), lifespan="off").start()


@pytest.mark.timeout(120)
def test_data_parallel_prefill_and_decode_servers(tiny_llama: Path) -> None:
    """`--dp-size 2` on both sides: the prefill server's router sends each room to replica
    room % 2, which listens on its own bootstrap port; the decode replicas, given the
    server's first port, register each room at its replica."""
    from radixlm.runtime import Engine

    prompts = [f"Replicated apart {k}: the radix tree" for k in range(6)]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        starting = [
            pool.submit(_replicated, tiny_llama, "prefill", disaggregation_bootstrap_port=0),
            pool.submit(_replicated, tiny_llama, "decode"),
            pool.submit(Engine, str(tiny_llama), show_progress=False, device="cpu", **ENGINE),
        ]
        for future in starting:  # what started stops at the end, even if another failed
            if future.exception() is None:
                started = future.result()
                if isinstance(started, tuple):  # (engine, live server): the server stops first
                    stack.callback(started[0].shutdown)
                    stack.callback(started[1].stop)
                else:
                    stack.callback(started.shutdown)
        (prefill, prefill_live), (decode, decode_live), colocated = (f.result() for f in starting)
        prefill_url, decode_url = prefill_live.url, decode_live.url
        section = httpx.get(f"{prefill_url}/get_server_info", timeout=10).json()["disaggregation"]
        ports = section["bootstrap_ports"]
        assert ports == [section["bootstrap_port"], section["bootstrap_port"] + 1]

        first = random.getrandbits(62) * 2
        rooms = [first + k for k in range(len(prompts))]  # both parities

        def send(k: int) -> Any:  # (the server's first port, as a router names it)
            body = {"text": prompts[k], "sampling_params": GREEDY, **_fields(ports[0], rooms[k])}
            return _both(prefill_url, decode_url, "/generate", body)

        with ThreadPoolExecutor(len(prompts)) as senders:
            answers = list(senders.map(send, range(len(prompts))))
        expected = [colocated.generate(p, GREEDY)["output_ids"] for p in prompts]
        assert [a["output_ids"] for a in answers] == expected

        for engine, url in ((prefill, prefill_url), (decode, decode_url)):
            info = httpx.get(f"{url}/get_server_info", timeout=10).json()
            assert info["dp_size"] == 2 and info["num_running_reqs"] == 0
            if url == prefill_url:  # each prefill replica computed its half of the prompts
                assert info["router_policy"] == "follow_bootstrap_room"
                assert all(r["prompt_tokens"] > 0 for r in info["replicas"]), info["replicas"]
            # The side's disaggregation queues are gauges (empty now), the other side's absent.
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            side, other = ("prefill", "decode") if url == prefill_url else ("decode", "prefill")
            for queue in ("prealloc", "inflight" if side == "prefill" else "transfer"):
                assert f"sglang:num_{side}_{queue}_queue_reqs{{" in metrics
            assert f"sglang:num_{other}_prealloc_queue_reqs" not in metrics
            # No KV slot is lost on any replica, and with the cache flushed every one is free.
            assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
            for replica in engine.replicas:
                replica.check_invariants()
                assert replica.server_info(fresh=True)["token_usage"] == 0.0
