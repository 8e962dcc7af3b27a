"""The reference server with LoRA adapters, end to end: `python -m radixlm.server
--lora-paths ...` in a subprocess, the official `openai` client naming adapters as models,
SGLang's `/generate` with `lora_path`, and adapters loaded and unloaded at run time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import free_port, served  # this folder is not a package

from radixlm.runtime.fixtures import build_random_lora, build_tiny_model

pytestmark = pytest.mark.timeout(150)

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("lora-server")
    model = build_tiny_model(root / "model")
    first = build_random_lora(model, root / "first", rank=8, seed=1, scale=0.3)
    second = build_random_lora(model, root / "second", rank=4, seed=2, scale=0.3)
    args = [
        "--model-path", str(model), "--served-model-name", "tiny", "--log-level", "warning",
        "--lora-paths", f"first={first}", "--max-loras-per-batch", "2", "--max-lora-rank", "8",
    ]  # fmt: skip
    with served(args, root / "serve.log", free_port()) as base:
        yield base, first, second


def _generate(base: str, lora_path: str | None) -> list[int]:
    body = {"text": "the cat sat on", "sampling_params": GREEDY, "lora_path": lora_path}
    response = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["output_ids"]
    return ids


def test_adapters_by_model_name_and_lora_path(setup: tuple[str, Path, Path]) -> None:
    base = setup[0]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    ids = [model.id for model in client.models.list().data]
    assert ids == ["tiny", "first"]
    plain = _generate(base, None)
    adapted = _generate(base, "first")
    assert adapted != plain
    for model in ("first", "tiny:first"):
        reply = client.completions.create(
            model=model,
            prompt="the cat sat on",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.model == model
        text = reply.choices[0].text
        assert (
            text
            == httpx.post(
                f"{base}/generate",
                json={"text": "the cat sat on", "sampling_params": GREEDY, "lora_path": "first"},
                timeout=60,
            ).json()["text"]
        )
    chat = client.chat.completions.create(
        model="first", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_load_and_unload_at_run_time(setup: tuple[str, Path, Path]) -> None:
    base, _, second = setup
    loaded = httpx.post(
        f"{base}/load_lora_adapter",
        json={"lora_name": "second", "lora_path": str(second)},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    assert set(loaded.json()["loaded_adapters"]) == {"first", "second"}
    assert _generate(base, "second") != _generate(base, "first")
    gone = httpx.post(f"{base}/unload_lora_adapter", json={"lora_name": "second"}, timeout=60)
    assert gone.status_code == 200, gone.text
    refused = httpx.post(
        f"{base}/generate",
        json={"text": "x", "sampling_params": GREEDY, "lora_path": "second"},
        timeout=60,
    )
    assert refused.status_code == 400 and "second" in refused.text
    bad = httpx.post(
        f"{base}/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": "/no/such/dir"},
        timeout=60,
    )
    assert bad.status_code == 400 and "does not exist" in bad.text
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
