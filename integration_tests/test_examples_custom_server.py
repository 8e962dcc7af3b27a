"""examples/custom_server.py: radixlm-server's create_app on radixlm-runtime's Engine with a route
of its own, started as a script on a free port (the built-in demo model)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "custom_server.py"

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("custom-server") / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the example exited:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the example did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_custom_route_asks_the_engine_for_the_capital(url: str) -> None:
    reply = httpx.get(f"{url}/capital/France", timeout=30)
    assert reply.status_code == 200
    assert reply.json()["capital"] == "Paris"  # the demo model's documented answer
    assert reply.json()["country"] == "France"


def test_the_custom_route_shares_the_engine_radix_cache(url: str) -> None:
    httpx.get(f"{url}/capital/Japan", timeout=30).raise_for_status()
    again = httpx.get(f"{url}/capital/Japan", timeout=30).json()
    assert again["cached_tokens"] > 0


def test_the_custom_route_answers_bad_input_with_an_openai_error(url: str) -> None:
    reply = httpx.get(f"{url}/capital/{'1' * 3}", timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "country"


def test_the_openai_routes_are_mounted_beside_it(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["radixlm-demo"]
    reply = client.chat.completions.create(
        model="radixlm-demo",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    completion = client.completions.create(
        model="radixlm-demo", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text.startswith(" Paris")


def test_the_native_generate_route_is_mounted_too(url: str) -> None:
    params = {"max_new_tokens": 4, "temperature": 0}
    body = {"text": "The capital of France is", "sampling_params": params}
    out = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    assert out["text"].startswith(" Paris")
