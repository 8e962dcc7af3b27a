"""A pytest plugin: every `Engine(...)` a test builds runs its core in its own process.

    python3 tools/dev.py test runtime integration --engine-mode process

(or `PYTHONPATH=tools/testing pytest -p pytest_engine_process ...`). An engine a test builds
with an explicit `engine_process=...`, or on a `runner=`, keeps what it asked for. Tests
marked `@pytest.mark.thread_only("why")` read or patch the core's internals (its scheduler,
runner, grammar service), which only a core on a thread exposes; they are skipped here with
their reason.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from radixlm.runtime import config as engine_config

    original = engine_config.EngineConfig.from_kwargs

    def from_kwargs(cls: type, model_path: str, **kwargs: Any) -> Any:
        kwargs.setdefault("engine_process", True)
        return original(model_path, **kwargs)

    engine_config.EngineConfig.from_kwargs = classmethod(from_kwargs)  # type: ignore[assignment,method-assign]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("thread_only")
        if marker is not None:
            why = marker.args[0] if marker.args else "it reads the engine core's internals"
            item.add_marker(pytest.mark.skip(reason=f"thread mode only: {why}"))
