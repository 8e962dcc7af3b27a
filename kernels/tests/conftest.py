"""Kernel tests: Triton runs in its interpreter on CPU-only machines, natively on CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Must happen before any Triton kernel is defined, i.e. before radixlm.kernels.triton_ops
# is imported (radixlm.kernels itself imports it lazily).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The shared helpers module sits beside this file (pytest runs with --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test draws the same random tensors whatever runs before it."""
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    """Where parity tests run: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def needs_triton() -> None:
    pytest.importorskip("triton")
