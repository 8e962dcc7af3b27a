"""Live servers on radixlm's real engine: a tiny random-weight Llama built once per session,
`create_app(Engine(...), ServerConfig(...))` served by uvicorn in a thread on a free port.

Fixtures are lazy (session scope): test files that do not ask for them pay nothing.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from uvicorn_thread import ThreadedServer  # this folder is not a package

CONTEXT_LENGTH = 1024
POOL_TOKENS = 16384


@dataclass
class Served:
    """A live server and the engine behind it."""

    live: ThreadedServer
    engine: Any
    model_name: str

    @property
    def url(self) -> str:
        return self.live.url

    def wait_idle(self, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until nothing runs or waits in the engine; its server_info then."""
        deadline = time.monotonic() + timeout
        while True:
            info: dict[str, Any] = self.engine.server_info()
            if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the engine is not idle: {info['num_running_reqs']} running, "
                    f"{info['num_queued_reqs']} queued"
                )
            time.sleep(0.02)

    def assert_no_leaks(self) -> None:
        """Nothing running or queued, and every KV slot is free or cached."""
        self.wait_idle()
        # free + cached + held by running requests == pool size, and nothing runs now.
        self.engine.check_invariants()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer Llama with the tiny BPE tokenizer and its chat template."""
    from radixlm.runtime.fixtures import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM", seed=0, init_std=0.5
    )


def _engine(model: Path, **kwargs: Any) -> Any:
    import torch

    from radixlm.runtime import Engine

    torch.set_num_threads(min(2, torch.get_num_threads()))
    options: dict[str, Any] = dict(
        show_progress=False,
        max_total_tokens=POOL_TOKENS,
        context_length=CONTEXT_LENGTH,
        device="cpu",
    )
    options.update(kwargs)
    return Engine(str(model), **options)


@pytest.fixture(scope="session")
def serve(tiny_llama: Path) -> Iterator[Callable[..., Served]]:
    """Start a server on its own engine: `serve(server_config_kwargs, **engine_kwargs)`.

    Everything started is stopped at the end of the session."""
    from radixlm.server import ServerConfig, create_app

    started: list[Served] = []

    def start(config: dict[str, Any] | None = None, **engine_kwargs: Any) -> Served:
        options = {"served_model_name": "tiny-llama", "log_requests": False, **(config or {})}
        # An engine setting, as `radixlm serve --enable-custom-logit-processor` passes it.
        if options.pop("enable_custom_logit_processor", False):
            engine_kwargs.setdefault("enable_custom_logit_processor", True)
        engine = _engine(tiny_llama, **engine_kwargs)
        app = create_app(engine, ServerConfig(**options))
        served = Served(
            ThreadedServer(app, lifespan="off").start(), engine, str(options["served_model_name"])
        )
        started.append(served)
        return served

    yield start
    for served in started:
        served.live.stop()
        served.engine.shutdown()


@pytest.fixture(scope="session")
def server(serve: Callable[..., Served]) -> Served:
    """The shared server: custom logit processors and metrics on, no API key."""
    return serve({"enable_custom_logit_processor": True, "enable_metrics": True})


@pytest.fixture
def http(server: Served) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture
def client(server: Served) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
