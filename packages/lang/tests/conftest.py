"""Fixtures: a toy model behind a fake native server, a fake engine and a fake /v1 API.

These stand in for the reference server while it is being built; the tests marked in the
package README are the ones to repoint at a live `radixlm serve` on a tiny model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lang_fake_server import FakeServer
from lang_toy_model import FakeEngine, ToyCore, ToyModel

import radixlm.lang as sgl

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_LIKE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

MakeServer = Callable[..., FakeServer]


@pytest.fixture(autouse=True)
def _no_default_backend() -> Iterator[None]:
    sgl.set_default_backend(None)
    yield
    sgl.set_default_backend(None)


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    """make_server(rules={...}, chat_template=None) -> a started FakeServer."""
    started: list[FakeServer] = []

    def make(rules: dict[str, str] | None = None, chat_template: str | None = None) -> FakeServer:
        server = FakeServer(ToyCore(ToyModel(rules), chat_template)).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def server(make_server: MakeServer) -> FakeServer:
    """A fake server whose model has no chat template."""
    return make_server()


@pytest.fixture
def endpoint(server: FakeServer) -> Iterator[Any]:
    backend = sgl.RuntimeEndpoint(server.url, timeout=20)
    yield backend
    backend.close()


@pytest.fixture
def make_engine() -> Callable[..., FakeEngine]:
    def make(rules: dict[str, str] | None = None, chat_template: str | None = None) -> FakeEngine:
        return FakeEngine(ToyCore(ToyModel(rules), chat_template))

    return make
