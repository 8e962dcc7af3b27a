"""examples/custom_server.py: radixlm-server's create_app on radixlm-runtime's Engine with a route
of its own, started as a script on a free port (the built-in demo model)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import free_port, served  # this folder is not a package

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "custom_server.py"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("custom-server") / "server.log"
    with served([], log, free_port(), command=[sys.executable, str(SCRIPT)]) as base:
        yield base


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
