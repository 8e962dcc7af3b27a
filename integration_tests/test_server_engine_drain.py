"""`radixlm serve` drains on SIGTERM under load: the streams in flight finish whole, new
requests and `/health` get 503 meanwhile, and the process then exits with status 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from server_process import free_port, served  # this folder is not a package

BODY: dict[str, Any] = {
    "text": "drain me",
    "sampling_params": {"temperature": 0, "max_new_tokens": 160, "ignore_eos": True},
}
# A fifth, longer stream keeps the drain going while the test checks that new work is refused:
# on a fast machine the four short streams can end (and the server exit) within milliseconds
# of the SIGTERM.
KEEPER_TOKENS = 2000


def test_sigterm_lets_streams_finish_refuses_new_work_and_exits_zero(
    tiny_llama: Path, tmp_path: Path
) -> None:
    args = [
        "--model-path", str(tiny_llama),
        "--device", "cpu",
        "--dtype", "float32",
        "--max-total-tokens", "4096",
        "--graceful-shutdown-timeout", "120",
        "--log-level", "info",
    ]  # fmt: skip
    started: list[subprocess.Popen[bytes]] = []
    log = tmp_path / "serve.log"
    with served(args, log, free_port(), started=started) as url:
        process = started[0]
        first_chunk = threading.Barrier(6)
        finished: list[dict[str, Any]] = []
        kept: list[dict[str, Any]] = []

        def stream(tokens: int = 160) -> None:
            body = {**BODY, "stream": True}
            body["sampling_params"] = {**BODY["sampling_params"], "max_new_tokens": tokens}
            with (
                httpx.Client(base_url=url, timeout=120) as client,
                client.stream("POST", "/generate", json=body) as response,
            ):
                chunks = []
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks) == 1:
                            first_chunk.wait(60)
            (finished if tokens == 160 else kept).append(chunks[-1])

        threads = [threading.Thread(target=stream) for _ in range(4)]
        threads.append(threading.Thread(target=stream, args=(KEEPER_TOKENS,)))
        for thread in threads:
            thread.start()
        first_chunk.wait(60)  # every stream is running
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        try:
            while httpx.get(f"{url}/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "/health stayed healthy after SIGTERM"
                time.sleep(0.02)
            refused = httpx.post(f"{url}/generate", json=BODY, timeout=10)
        except httpx.TransportError as error:
            raise AssertionError(
                f"the server stopped listening: {error!r}\n{log.read_text()}"
            ) from error
        assert not kept, "the long stream ended before the checks: they proved nothing"
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert refused.json()["error"]["code"] == "draining"
        for thread in threads:
            thread.join(120)
        assert len(finished) == 4 and len(kept) == 1, log.read_text()
        assert kept[0]["meta_info"]["completion_tokens"] == KEEPER_TOKENS
        for last in finished:
            meta = last["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 160
        assert process.wait(timeout=60) == 0, log.read_text()
        assert "draining" in log.read_text()
