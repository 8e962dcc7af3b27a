"""Attention backends behind one interface, chosen by name from a small registry."""

from __future__ import annotations

import importlib

import torch

from radixlm.runtime.attention.base import (
    AttentionBackend,
    AttentionLayer,
    GraphableAttentionBackend,
)
from radixlm.runtime.memory import KVPool

# name -> "module:class", imported only when chosen.
_BACKENDS = {
    "torch_native": "radixlm.runtime.attention.torch_native:TorchNativeBackend",
    "triton": "radixlm.runtime.attention.triton:TritonBackend",
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """ "auto" -> triton on CUDA when radixlm-kernels can run Triton, else torch_native."""
    if name == "auto":
        from radixlm import kernels

        return "triton" if device.type == "cuda" and kernels.available() else "torch_native"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(backend_names())}"
        )
    return name


def create_backend(name: str, kv_pool: KVPool) -> AttentionBackend:
    """Instantiate a backend by name ("auto" resolved against the pool's device)."""
    resolved = resolve_backend_name(name, kv_pool.device)
    module_name, _, class_name = _BACKENDS[resolved].partition(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    backend: AttentionBackend = backend_class(kv_pool)
    return backend


__all__ = [
    "AttentionBackend",
    "AttentionLayer",
    "GraphableAttentionBackend",
    "backend_names",
    "create_backend",
    "resolve_backend_name",
]
