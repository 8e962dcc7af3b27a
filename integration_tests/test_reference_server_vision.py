"""The reference server on the built-in vision model, end to end.

`python -m radixlm.server --model-path radixlm-demo-vision` in a subprocess; SGLang's
multimodal `/generate` example (an image file the server may read), the official `openai`
client with an `image_url` part, and a radixlm-lang program with `image()`. The pictures are
the documented examples in `examples/images/`; the answers asserted are the ones the model was
trained to give.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import free_port, served  # this folder is not a package

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(120)

MODEL = "radixlm-demo-vision"
ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "examples" / "images"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vision-server") / "serve.log"
    args = ["--model-path", MODEL, "--allowed-local-media-path", str(IMAGES)]
    with served([*args, "--log-level", "warning"], log, free_port()) as base:
        yield base


def _prompt(question: str) -> str:
    """The demo chat format with the image first, as the model was trained."""
    return f"<|im_start|>user\n<image>\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((IMAGES / name).read_bytes()).decode()


def test_model_info_names_the_image_placeholder(url: str) -> None:
    info = httpx.get(f"{url}/get_model_info", timeout=10).json()
    assert info["image_token"] == "<image>"


def test_sglang_generate_example_with_an_image_file(url: str) -> None:
    # SGLang's multimodal /generate example: the prompt with its placeholder, the image a path.
    answer = httpx.post(
        f"{url}/generate",
        json={
            "text": _prompt("What colour is the square?"),
            "image_data": str(IMAGES / "red_square.png"),
            "sampling_params": {"max_new_tokens": 16, "temperature": 0},
        },
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert "red" in answer.json()["text"].lower()


def test_openai_chat_with_an_image_url_part(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url("three_circles.png")}},
                    {"type": "text", "text": "How many circles are there?"},
                ],
            }
        ],
        temperature=0,
        max_tokens=16,
    )
    content = reply.choices[0].message.content or ""
    assert "3" in content or "three" in content.lower()
    assert reply.usage is not None and reply.usage.prompt_tokens > 16  # the image: 16


def test_questions_about_one_image_reuse_its_kv(url: str) -> None:
    image = base64.b64encode((IMAGES / "red_square.png").read_bytes()).decode()
    bodies = [
        {
            "text": _prompt(question),
            "image_data": image,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
        for question in ("What colour is the square?", "What shape is it?")
    ]
    httpx.post(f"{url}/flush_cache", timeout=10)
    first, second = (httpx.post(f"{url}/generate", json=b, timeout=60).json() for b in bodies)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] > 16  # the chat prefix and the image (16)


def test_an_unreadable_image_is_a_400_and_the_server_stays_healthy(url: str) -> None:
    answer = httpx.post(
        f"{url}/generate",
        json={"text": _prompt("What is it?"), "image_data": base64.b64encode(b"nope").decode()},
        timeout=30,
    )
    assert answer.status_code == 400
    assert "image_data" in answer.text
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_a_lang_program_with_an_image(url: str) -> None:
    @sgl.function
    def describe(s: sgl.ProgramState, path: str) -> None:
        s += sgl.user(sgl.image(path) + "What colour is the square?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))

    state = describe.run(path=str(IMAGES / "red_square.png"), backend=sgl.RuntimeEndpoint(url))
    assert "red" in state["answer"].lower()
