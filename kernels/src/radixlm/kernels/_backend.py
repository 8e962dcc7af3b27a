"""Backend selection: Triton kernels where they can run, the torch references elsewhere."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Literal

import torch

BackendName = Literal["auto", "triton", "reference"]
_BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")
_TRITON_OPS = "radixlm.kernels.triton_ops"
ENV_BACKEND = "RADIXLM_KERNELS_BACKEND"


def _initial_backend() -> BackendName:
    value = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if value not in _BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={value!r}: expected one of {', '.join(_BACKENDS)}")
    return value  # type: ignore[return-value]


# The switch is process-wide on purpose: the engine loop usually runs in its own thread, and a
# choice made by the caller (a test, a benchmark, a launcher flag) must reach it.
_current: BackendName = _initial_backend()


def get_backend() -> BackendName:
    """The backend setting in force: ``"auto"``, ``"triton"`` or ``"reference"``."""
    return _current


class use_backend:
    """Force every kernel call to one backend.

    ``"auto"`` (the default) runs Triton on CUDA tensors when Triton is installed and the torch
    reference otherwise; ``"triton"`` always runs the Triton kernel (on CPU tensors this needs
    the interpreter, ``TRITON_INTERPRET=1``); ``"reference"`` always runs the torch reference.

    Calling it sets the backend at once for the whole process; used as a context manager it
    restores the previous setting on exit::

        use_backend("reference")            # from now on
        with use_backend("triton"):         # only inside the block
            out = decode_attention(...)

    The initial setting comes from the environment variable ``RADIXLM_KERNELS_BACKEND``.
    """

    def __init__(self, backend: BackendName) -> None:
        global _current
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")
        self.backend: BackendName = backend
        self._previous: BackendName = _current
        _current = backend

    def __enter__(self) -> use_backend:
        return self

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = self._previous


def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether Triton kernels run (or will run) in Triton's CPU interpreter.

    Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so once this package's Triton
    module is imported its mode is fixed; before that the environment decides.
    """
    module = sys.modules.get(_TRITON_OPS)
    if module is not None:
        return bool(module.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Whether the Triton kernels can run here: Triton is installed and either a CUDA device
    is present or Triton's interpreter is enabled (``TRITON_INTERPRET=1``)."""
    if not triton_installed():
        return False
    return interpreter_enabled() or torch.cuda.is_available()


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a call whose main input is ``tensor`` goes to the Triton kernel.

    Raises ``RuntimeError`` when Triton is forced but cannot run on this tensor.
    """
    if _current == "reference":
        return False
    if _current == "auto":
        return tensor.is_cuda and triton_installed() and not interpreter_enabled()
    if not triton_installed():
        raise RuntimeError("use_backend('triton') is set but the 'triton' package is not installed")
    if not tensor.is_cuda and not interpreter_enabled():
        raise RuntimeError(
            "use_backend('triton') on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before radixlm.kernels runs its first Triton kernel"
        )
    return True


def triton_ops() -> types.ModuleType:
    """Import the Triton kernels on first use (so the package imports without Triton)."""
    return importlib.import_module(_TRITON_OPS)
