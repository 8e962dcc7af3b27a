"""The model registry: Hugging Face `architectures` name -> how to read its config, which class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    """How to build one architecture: read its HF config into an ArchConfig; the model class."""

    architecture: str
    arch_config: Callable[[Any], ArchConfig]
    model_class: type[DecoderForCausalLM] = DecoderForCausalLM


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add a family (a family file calls this at import). Re-registering a name replaces it."""
    _FAMILIES[family.architecture] = family
    return family


def family_of(architecture: str) -> ModelFamily:
    """The registered family of one architecture name (KeyError when unknown)."""
    return _FAMILIES[architecture]


def supported_architectures() -> list[str]:
    """Names accepted in config.json's `architectures`, sorted."""
    return sorted(_FAMILIES)


class UnsupportedArchitecture(ValueError):
    """The checkpoint's architecture has no implementation here."""


def resolve(architectures: list[str] | None) -> ModelFamily:
    """The family for a config's `architectures` list; raises UnsupportedArchitecture."""
    for name in architectures or []:
        if name in _FAMILIES:
            return _FAMILIES[name]
    raise UnsupportedArchitecture(
        f"model architecture {architectures or '(none given)'} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
