"""`radixlm serve` in a subprocess for end-to-end tests: started, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def served(
    args: Sequence[str],
    log: Path,
    port: int,
    timeout: float = 90,
    command: Sequence[str] | None = None,
    started: list[subprocess.Popen[bytes]] | None = None,
) -> Iterator[str]:
    """Run `COMMAND ARGS --port PORT` (output to `log`; the command defaults to
    `python -m radixlm.server`) until `/health` answers; yields its base URL and stops it with
    SIGINT afterwards (unless it exited). The process is appended to `started` if given."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    program = list(command) if command is not None else [sys.executable, "-m", "radixlm.server"]
    command = [*program, *args, "--port", str(port)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if started is not None:
        started.append(process)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the server exited:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
