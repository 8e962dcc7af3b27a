"""The README's standalone example runs as written (uvicorn.run replaced by a test client)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def readme_app() -> Any:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(b for b in blocks if "create_app(" in b)
    assert "uvicorn.run(app, port=8000)" in example
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(
        compile(example.replace("uvicorn.run(app, port=8000)", ""), "README.md", "exec"), namespace
    )
    return namespace["app"]


def test_readme_engine_answers_generate(readme_app: Any) -> None:
    with TestClient(readme_app) as client:
        answer = client.post("/generate", content=b'{"text": "radixlm"}')
    assert answer.json()["text"] == "mlxidar"


def test_readme_engine_streams_and_serves_its_own_route(readme_app: Any) -> None:
    with TestClient(readme_app) as client:
        body = {"text": "abc", "stream": True}
        events = client.post("/generate", json=body).text.strip().split("\n\n")
        assert events[-1] == "data: [DONE]" and len(events) == 4
        assert client.get("/hello").json() == {"hello": "world"}
        completion = client.post("/v1/completions", json={"model": "echo", "prompt": "xy"})
        assert completion.json()["choices"][0]["text"] == "yx"


def test_an_engine_without_tokenizer_refuses_chat_clearly(readme_app: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(readme_app) as client:
        answer = client.post("/v1/chat/completions", json={"model": "echo", "messages": messages})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
