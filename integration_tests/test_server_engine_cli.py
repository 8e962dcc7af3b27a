"""`radixlm serve --model-path` in a subprocess: the flags reach the engine, the banner says how
to call it, the official client works against it, and each request is logged."""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_process import free_port, served  # this folder is not a package

from radixlm.runtime.fixtures import ForceTokenProcessor


def _command() -> list[str]:
    script = shutil.which("radixlm", path=str(Path(sys.executable).parent))
    return [script, "serve"] if script else [sys.executable, "-m", "radixlm.server"]


@pytest.fixture(scope="module")
def cli_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    args = [
        "--model-path", str(tiny_llama),
        "--served-model-name", "tiny",
        "--api-key", "k3y",
        "--dtype", "float32",
        "--device", "cpu",
        "--context-length", "512",
        "--max-total-tokens", "4096",
        "--max-running-requests", "8",
        "--max-queued-requests", "16",
        "--chunked-prefill-size", "64",
        "--schedule-policy", "lpm",
        "--grammar-backend", "xgrammar",
        "--strict-constraints",
        "--max-constraint-bytes", "65536",
        "--grammar-compile-timeout", "20",
        "--json-whitespace", "any",
        "--sampling-defaults", "openai",
        "--random-seed", "1",
        "--enable-metrics",
        "--enable-cache-report",
        "--enable-custom-logit-processor",
        "--log-level", "info",
    ]  # fmt: skip
    with served(args, log, free_port(), command=_command()) as url:
        yield url, log


def test_serve_prints_how_to_call_it(cli_server: Any) -> None:
    url, log = cli_server
    text = log.read_text()
    assert f"radixlm serving 'tiny' at {url}" in text
    assert f"curl {url}/generate" in text and "Authorization: Bearer k3y" in text


def test_serve_answers_the_openai_client_and_logs_the_request(cli_server: Any) -> None:
    url, log = cli_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages: Any = [{"role": "user", "content": "Hello"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    deadline = time.monotonic() + 5
    while not re.search(r"/v1/chat/completions rid=\S+ prompt_tokens=\d+ cached_tokens=[1-9]",
                        log.read_text()):  # fmt: skip
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_serve_passes_engine_flags_to_the_engine(cli_server: Any) -> None:
    url, _ = cli_server
    headers = {"Authorization": "Bearer k3y"}
    info = httpx.get(f"{url}/get_server_info", headers=headers).json()
    config = info["config"]
    assert info["max_total_num_tokens"] == 4096
    assert info["model"]["max_context_length"] == 512
    assert config["runner"]["memory"]["max_running_requests"] == 8
    assert config["scheduler"]["max_queued_requests"] == 16
    assert config["scheduler"]["chunked_prefill_size"] == 64
    assert config["grammar"]["json_whitespace"] == "flexible"
    assert (info["grammar_backend"], info["strict_constraints"]) == ("xgrammar", True)
    assert info["max_constraint_bytes"] == 65536 and info["grammar_compile_timeout"] == 20
    assert config["runner"]["sampler"]["enable_custom_logit_processor"] is True
    assert info["server_config"]["api_key"] == "***"
    forced = httpx.post(
        f"{url}/generate",
        headers=headers,
        json={
            "text": "x",
            "custom_logit_processor": ForceTokenProcessor.to_str(),
            "sampling_params": {"max_new_tokens": 3, "custom_params": {"token_id": 7}},
        },
    ).json()
    assert forced["output_ids"] == [7, 7, 7]
    assert "radixlm" in httpx.get(f"{url}/metrics", headers=headers).text
