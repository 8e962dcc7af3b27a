"""Backends, chosen from a small registry and imported only when used.

`create_backend("runtime_endpoint", url)`, `create_backend("engine", engine)`,
`create_backend("openai", "gpt-4o-mini")`; `as_backend(obj)` accepts a backend, an object with
an `.endpoint` backend (SGLang's Runtime), or an in-process engine (wrapped in EngineBackend).
"""

from __future__ import annotations

import importlib
from typing import Any

from radixlm.lang.backends.base import Backend, Completion, GenerateCall, Prompt

#: name -> (module, class). Modules are imported on first use, so `openai` (say) is imported
#: only by a program that uses the OpenAI backend.
REGISTRY: dict[str, tuple[str, str]] = {
    "runtime_endpoint": ("radixlm.lang.backends.runtime_endpoint", "RuntimeEndpoint"),
    "engine": ("radixlm.lang.backends.engine", "EngineBackend"),
    "openai": ("radixlm.lang.backends.openai", "OpenAI"),
}


def backend_class(name: str) -> type[Any]:
    """The backend class registered under `name` (imports its module)."""
    try:
        module_name, class_name = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(REGISTRY)}") from None
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]


def create_backend(name: str, *args: Any, **kwargs: Any) -> Backend:
    """Build the backend registered under `name`."""
    backend: Backend = backend_class(name)(*args, **kwargs)
    return backend


def as_backend(obj: object) -> Backend:
    """`obj` as a Backend: itself, its `.endpoint`, or an engine wrapped in EngineBackend."""
    if isinstance(obj, Backend):
        return obj
    endpoint = getattr(obj, "endpoint", None)
    if isinstance(endpoint, Backend):
        return endpoint
    from radixlm.lang.backends.engine import looks_like_engine

    if looks_like_engine(obj):
        return create_backend("engine", obj)
    raise TypeError(
        f"{type(obj).__name__} is not a backend; use RuntimeEndpoint(url), OpenAI(model) or "
        "an in-process engine"
    )


__all__ = [
    "REGISTRY",
    "Backend",
    "Completion",
    "GenerateCall",
    "Prompt",
    "as_backend",
    "backend_class",
    "create_backend",
]
