"""The reference server under tensor parallelism (TP=2, gloo on CPU): a rank killed under load
ends every open stream with an error and `/health` reports the engine down; and two
`radixlm serve` processes on localhost, standing in for two nodes (`--nnodes 2`), serve the
same greedy answers as one unsplit engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

STREAMS = 8
COLLECTIVE_TIMEOUT_S = 20.0


async def _stream(http: httpx.AsyncClient, i: int, started: asyncio.Event) -> tuple[Any, float]:
    """(the error the stream ended with, or None; when it ended)."""
    body = {
        "text": f"stream {i} tells",
        "stream": True,
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0.0},
    }
    error: Any = None
    try:
        async with http.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                error = (response.status_code, (await response.aread()).decode())
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                    started.set()
    except httpx.HTTPError as broken:
        error = repr(broken)
    started.set()
    return error, time.monotonic()


async def _load_then_kill(url: str, pid: int) -> tuple[float, list[tuple[Any, float]]]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0)) as http:
        started = [asyncio.Event() for _ in range(STREAMS)]
        tasks = [asyncio.ensure_future(_stream(http, i, started[i])) for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    return killed_at, list(outcomes)


def test_a_killed_rank_ends_every_stream_with_an_error_and_health_reports_down(
    serve: Callable[..., Any],
) -> None:
    served = serve(
        {}, tp_size=2, dist_timeout=COLLECTIVE_TIMEOUT_S, engine_restarts=0, max_total_tokens=20000
    )
    worker = served.engine.rank_pids[1]
    assert worker is not None
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/get_server_info").json()["tp_size"] == 2

    killed_at, outcomes = asyncio.run(_load_then_kill(served.url, worker))

    for i, (error, ended_at) in enumerate(outcomes):
        assert error is not None, f"stream {i} ended without an error"
        assert ended_at - killed_at < COLLECTIVE_TIMEOUT_S, (i, ended_at - killed_at)
        if isinstance(error, dict):  # the SSE error event the server sends
            assert error["code"] == "engine_unavailable", error
    with httpx.Client(base_url=served.url, timeout=30) as http:
        down = http.get("/health")
        assert down.status_code == 503
        assert down.json()["error"]["code"] == "engine_unavailable"
        refused = http.post("/generate", json={"text": "hello", "sampling_params": {}})
        assert refused.status_code == 503


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, f"radixlm serve exited:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"radixlm serve did not start:\n{log.read_text()}"
        time.sleep(0.2)


def test_two_nodes_on_localhost_serve_what_one_engine_does(
    tiny_llama: Path, tmp_path: Path
) -> None:
    from radixlm.runtime import Engine

    port, rendezvous = _free_port(), _free_port()
    common = [
        "--model-path", str(tiny_llama), "--device", "cpu", "--max-total-tokens", "4096",
        "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{rendezvous}",
        "--dist-timeout", "60", "--log-level", "warning",
    ]  # fmt: skip
    # Both "nodes" are this machine: gloo must use its loopback interface.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = []
    for rank, extra in ((1, []), (0, ["--port", str(port)])):
        command = [sys.executable, "-m", "radixlm.server", *common, "--node-rank", str(rank)]
        with logs[rank].open("w") as out:
            nodes.append(
                subprocess.Popen(command + extra, stdout=out, stderr=subprocess.STDOUT, env=env)
            )
    node1, node0 = nodes
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, node0, logs[0])
        assert node1.poll() is None, logs[1].read_text()
        prompts = ["the cache of the radix tree", "a batch of decode steps", "hello"]
        params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=120) as http:
            answer = http.post("/generate", json={"text": prompts, "sampling_params": params})
            assert answer.status_code == 200, answer.text
            ours = [item["output_ids"] for item in answer.json()]
            info = http.get("/get_server_info").json()
            assert info["tp_size"] == 2 and len(info["tp_ranks"]) == 2
        with Engine(str(tiny_llama), show_progress=False, max_total_tokens=4096) as single:
            theirs = [out["output_ids"] for out in single.generate(prompts, params)]
        assert ours == theirs
        # Node 0 stopping ends node 1's rank too: its `radixlm serve` exits by itself.
        # (uvicorn re-raises the signal once it has shut down, so node 0's status is -SIGINT.)
        node0.send_signal(signal.SIGINT)
        node0.wait(timeout=60)
        assert node1.wait(timeout=60) == 0, logs[1].read_text()
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait(timeout=10)
