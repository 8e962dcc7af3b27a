"""Shared fixtures of the radixlm-lang integration tests: one live reference server on a tiny model.

A random-weight Llama with a ChatML chat template (`radixlm.runtime.fixtures.build_tiny_model`)
runs in one `radixlm.runtime.Engine`, served by `radixlm.server.create_app` under uvicorn in a
thread on a free port. It is built once per test session however many test modules import the
fixtures (pytest makes a fixture imported into several modules one definition per module, so the
server itself is a process-wide singleton). Import the fixtures explicitly:

    sys.path.insert(0, str(Path(__file__).parent))
    from lang_fixtures import endpoint_fixture, live_fixture  # noqa: F401  (pytest fixtures)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from uvicorn_thread import ThreadedServer

import radixlm.lang as sgl
from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model
from radixlm.server import ServerConfig, create_app

SERVED_MODEL_NAME = "tiny-llama"
#: Engine keywords: a small KV pool and a fixed seed are all the tiny model needs.
ENGINE_KWARGS: dict[str, Any] = {
    "show_progress": False,
    "max_total_tokens": 16384,
    "random_seed": 0,
}


@dataclass
class LiveServer:
    """The reference server on the tiny model: `url`, the `engine` behind it, its model dir."""

    url: str
    engine: Engine
    model_dir: Path
    _server: ThreadedServer
    _stopped: bool = field(default=False)

    def server_info(self) -> dict[str, Any]:
        """`GET /get_server_info` (config and live statistics of the engine)."""
        response = httpx.get(f"{self.url}/get_server_info", timeout=30)
        response.raise_for_status()
        info: dict[str, Any] = response.json()
        return info

    def generate(self, body: dict[str, Any]) -> Any:
        """`POST /generate` with `body`; the decoded JSON answer."""
        response = httpx.post(f"{self.url}/generate", json=body, timeout=60)
        response.raise_for_status()
        return response.json()

    def flush_cache(self) -> None:
        """Empty the radix cache (fails while requests run)."""
        httpx.post(f"{self.url}/flush_cache", timeout=30).raise_for_status()

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Wait until no request runs or waits; the server info then."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is still busy after {timeout} s: {info}")
            time.sleep(0.05)

    def assert_no_leaks(self) -> None:
        """Idle, with a consistent radix cache and every KV slot free or cached."""
        self.wait_idle()
        self.engine.check_invariants()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._server.stop()
        self.engine.shutdown()


def start_live_server(model_dir: Path, config: ServerConfig | None = None) -> LiveServer:
    """An Engine on `model_dir` behind create_app, served by uvicorn on a free port."""
    engine = Engine(str(model_dir), **ENGINE_KWARGS)
    app = create_app(engine, config or ServerConfig(served_model_name=SERVED_MODEL_NAME))
    server = ThreadedServer(app, "lang-live-server", access_log=False)
    try:
        server.start(timeout=30)
    except RuntimeError:
        engine.shutdown()
        raise
    return LiveServer(server.url, engine, model_dir, server)


_LIVE: LiveServer | None = None
_LIVE_LOCK = threading.Lock()


def shared_live_server() -> LiveServer:
    """The session's one live server (built on first use)."""
    global _LIVE
    with _LIVE_LOCK:
        if _LIVE is None:
            torch.set_num_threads(min(2, torch.get_num_threads()))
            root = Path(tempfile.mkdtemp(prefix="radixlm-lang-live-"))
            _LIVE = start_live_server(build_tiny_model(root / "tiny-llama"))
        return _LIVE


@pytest.fixture(scope="session", name="live")
def live_fixture() -> Iterator[LiveServer]:
    """The live reference server (shared by every module that imports this fixture)."""
    live = shared_live_server()
    yield live
    live.stop()  # idempotent: the first module's teardown at the session's end stops it


@pytest.fixture(name="endpoint")
def endpoint_fixture(live: LiveServer) -> Iterator[sgl.RuntimeEndpoint]:
    """A RuntimeEndpoint on the live server; no default backend is left behind."""
    backend = sgl.RuntimeEndpoint(live.url, timeout=60)
    sgl.set_default_backend(None)
    yield backend
    sgl.set_default_backend(None)
    backend.close()


def token_count(live: LiveServer, text: str) -> int:
    """How many tokens the server's tokenizer makes of `text` (no special tokens added)."""
    return len(live.engine.tokenizer.encode(text, add_special_tokens=False))
