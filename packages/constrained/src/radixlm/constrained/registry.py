"""The backend registry: names -> factories, imported only when a backend is created."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.constrained.errors import BackendUnavailable
from radixlm.constrained.interfaces import GrammarBackend
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.tokenizer import TokenizerInfo

BackendFactory = Callable[[TokenizerInfo, GrammarOptions], GrammarBackend]


@dataclass(frozen=True, slots=True)
class _Entry:
    target: str | BackendFactory  # "module:attribute", imported lazily, or a factory
    requires: tuple[str, ...]  # top-level modules that must be importable
    extra: str  # the pip extra that brings them


_REGISTRY: dict[str, _Entry] = {
    "xgrammar": _Entry(
        "radixlm.constrained.backends.xgrammar_backend:XGrammarBackend",
        ("xgrammar", "torch"),
        "xgrammar",
    ),
    "llguidance": _Entry(
        "radixlm.constrained.backends.llguidance_backend:LLGuidanceBackend",
        ("llguidance", "torch"),
        "llguidance",
    ),
    "outlines": _Entry(
        "radixlm.constrained.backends.outlines_backend:OutlinesBackend",
        ("outlines_core",),
        "outlines",
    ),
    # Chooses per constraint among the installed ones above; needs at least one of them.
    "auto": _Entry("radixlm.constrained.backends.auto_backend:AutoBackend", (), ""),
}
DEFAULT_BACKEND = "auto"
#: The order `auto` tries the backends in (fastest masks first).
AUTO_ORDER = ("xgrammar", "llguidance", "outlines")


def register_backend(
    name: str, factory: BackendFactory, *, requires: tuple[str, ...] = (), extra: str = ""
) -> None:
    """Add (or replace) a backend: `factory(tokenizer_info, options)` builds it."""
    _REGISTRY[name] = _Entry(factory, tuple(requires), extra)


def registered_backends() -> list[str]:
    return list(_REGISTRY)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_backends() -> list[str]:
    """The registered backends whose dependencies are installed (nothing is imported); `auto`
    counts when at least one of the backends it chooses from is."""
    found = [
        name
        for name, entry in _REGISTRY.items()
        if name != "auto" and all(map(_installed, entry.requires))
    ]
    if any(name in found for name in AUTO_ORDER):
        found.append("auto")
    return found


def create_backend(
    name: str, tokenizer_info: TokenizerInfo, options: GrammarOptions | None = None
) -> GrammarBackend:
    """A backend by name (`auto`, the default, `xgrammar`, `llguidance` or `outlines`) for
    `tokenizer_info`.

    Raises ValueError for an unknown name and `BackendUnavailable` (an ImportError naming the
    extra to install) when its package is missing."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown grammar backend {name!r}; registered: {', '.join(_REGISTRY)}")
    missing = [module for module in entry.requires if not _installed(module)]
    if missing:
        hint = f"pip install 'radixlm-constrained[{entry.extra}]'" if entry.extra else "install it"
        verb = "is" if len(missing) == 1 else "are"
        raise BackendUnavailable(
            f"the {name} grammar backend needs {' and '.join(missing)}, which {verb} not "
            f"installed: {hint} (available backends: {', '.join(available_backends()) or 'none'})"
        )
    factory: BackendFactory
    if isinstance(entry.target, str):
        module_name, attribute = entry.target.split(":")
        factory = getattr(importlib.import_module(module_name), attribute)
    else:
        factory = entry.target
    return factory(tokenizer_info, options or GrammarOptions())
