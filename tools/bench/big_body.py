#!/usr/bin/env python3
"""How long radixlm serve takes to refuse a huge request body, and what it costs the others.

    .venv/bin/python tools/bench/big_body.py                 # starts `radixlm serve` (built-in model)
    .venv/bin/python tools/bench/big_body.py --url http://127.0.0.1:30000   # a running server

Measures, on the built-in model: the latency of a normal chat request alone (median of
--repeats); the seconds until a --size-mib body is answered on /generate and
/v1/chat/completions (with Content-Length) and on /generate chunked, with its status; and the
latency of a normal request sent while such a body is being refused. Prints the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

MiB = 1024 * 1024
NORMAL = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}


def big_body(route: str, size: int) -> bytes:
    """A JSON body of `size` bytes for `route`: one prompt of that many characters, about."""

    def body(pad: str) -> bytes:
        if route == "/generate":
            return json.dumps({"text": pad}).encode()
        return json.dumps({"messages": [{"role": "user", "content": pad}]}).encode()

    return body("x" * (size - len(body(""))))


def chunked(raw: bytes, size: int = MiB) -> Iterator[bytes]:
    for start in range(0, len(raw), size):
        yield raw[start : start + size]


def normal_latency(url: str) -> float:
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=NORMAL, timeout=600)
    response.raise_for_status()
    return time.monotonic() - start


def refuse(url: str, route: str, content: Any) -> tuple[int, float]:
    """(status, seconds) of one big request."""
    start = time.monotonic()
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=600) as client:
        response = client.post(f"{url}{route}", content=content, headers=headers)
    return response.status_code, time.monotonic() - start


def beside(url: str, route: str, content: Any) -> tuple[int, float, float]:
    """(big status, big seconds, normal latency) with the normal request sent 50 ms after the
    big one starts."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(big=refuse(url, route, content)))
    thread.start()
    time.sleep(0.05)
    latency = normal_latency(url)
    thread.join()
    status, seconds = result["big"]
    return status, seconds, latency


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "radixlm.server", "--port", str(port)]
    process = subprocess.Popen([*command, "--log-level", "warning"], env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health_generate", timeout=30).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit("radixlm serve exited before it was ready")
        time.sleep(0.5)
    process.terminate()
    raise SystemExit("radixlm serve did not get ready in 300 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: start radixlm serve)")
    parser.add_argument("--size-mib", type=int, default=64, help="the big body's size")
    parser.add_argument("--repeats", type=int, default=5, help="normal requests per figure")
    args = parser.parse_args()
    process = None
    url = args.url
    if url is None:
        process, url = start_server()
    try:
        size = args.size_mib * MiB
        normal_latency(url)  # warm up
        alone = [normal_latency(url) for _ in range(args.repeats)]
        print(f"server {url}, body {args.size_mib} MiB, {args.repeats} repeats")
        print(f"normal chat request alone: median {statistics.median(alone) * 1000:.0f} ms")
        cases = [
            ("/generate", "Content-Length", big_body("/generate", size)),
            ("/v1/chat/completions", "Content-Length", big_body("/v1/chat/completions", size)),
            ("/generate", "chunked", None),
        ]
        for route, framing, raw in cases:
            runs = []
            for _ in range(args.repeats):
                content = raw if raw is not None else chunked(big_body(route, size))
                runs.append(beside(url, route, content))
            statuses = sorted({status for status, _, _ in runs})
            refused = statistics.median(seconds for _, seconds, _ in runs)
            latency = statistics.median(latency for _, _, latency in runs)
            print(
                f"{route} {framing}: HTTP {','.join(map(str, statuses))} after median "
                f"{refused * 1000:.0f} ms; a normal request beside it: median "
                f"{latency * 1000:.0f} ms"
            )
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
