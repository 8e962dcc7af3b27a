"""Fixtures of the HTTP router's tests (router_fakes.py: fake workers, live servers); without
the `http` extra only the tests that need none of it run."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _load_fakes() -> ModuleType | None:
    name = "router_fakes"
    if name in sys.modules:
        return sys.modules[name]
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("httpx") is None:
        return None
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fakes = _load_fakes()


@pytest.fixture
def workers() -> Iterator[Callable[[int], list[Any]]]:
    """Start `n` fake workers (`router_fakes.FakeWorker`, stopped after the test)."""
    assert fakes is not None
    started: list[Any] = []

    def start(n: int) -> list[Any]:
        new = [fakes.FakeWorker(f"w{len(started) + i}") for i in range(n)]
        started.extend(new)
        return new

    yield start
    fakes.stop_all([worker.server for worker in started])


@pytest.fixture
def router() -> Iterator[Callable[[Any], Any]]:
    """Start the HTTP router on a `RouterConfig` (its lifespan runs, the first health checks
    included); a `router_fakes.LiveServer`."""
    assert fakes is not None
    from radixlm.router.proxy import create_router_app

    started: list[Any] = []

    def start(config: Any) -> Any:
        server = fakes.LiveServer(create_router_app(config), lifespan="on").start()
        started.append(server)
        return server

    yield start
    fakes.stop_all(started)
