"""Fixtures: a tiny local tokenizer, the toy engine, and live uvicorn servers on free ports."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from radixlm.server import ServerConfig, create_app

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _load_fake_engine() -> ModuleType:
    name = "server_fake_engine"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so custom logit processors defined there can be imported
    spec.loader.exec_module(module)
    return module


fake = _load_fake_engine()


class LiveServer:
    """A uvicorn server in a thread, on a socket bound to a free port."""

    def __init__(self, app: Any) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return fake.build_tokenizer(tmp_path_factory.mktemp("toy-tokenizer"))


@pytest.fixture(scope="session")
def engine(tokenizer: Any) -> Any:
    return fake.FakeEngine(tokenizer, enable_custom_logit_processor=True)


DEFAULT_CONFIG = ServerConfig(served_model_name="toy", enable_metrics=True)


@pytest.fixture(scope="session")
def server(engine: Any) -> Iterator[LiveServer]:
    live = LiveServer(create_app(engine, DEFAULT_CONFIG)).start()
    yield live
    live.stop()


@pytest.fixture
def make_server(tokenizer: Any) -> Iterator[Callable[..., tuple[LiveServer, Any]]]:
    """Start a server with its own config and engine (engine keywords go to FakeEngine;
    `tracer_provider` to `create_app`)."""
    started: list[LiveServer] = []

    def start(
        config: ServerConfig, *, tracer_provider: Any = None, **engine_kwargs: Any
    ) -> tuple[LiveServer, Any]:
        engine = fake.FakeEngine(tokenizer, **engine_kwargs)
        live = LiveServer(create_app(engine, config, tracer_provider=tracer_provider)).start()
        started.append(live)
        return live, engine

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def _no_leaked_requests(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used the shared engine leaves it with nothing running."""
    yield
    if "engine" not in request.fixturenames:
        return
    engine = request.getfixturevalue("engine")
    deadline = time.monotonic() + 5
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.active, f"requests still running in the engine: {list(engine.active)}"
