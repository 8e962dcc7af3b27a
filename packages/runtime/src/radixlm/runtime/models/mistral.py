"""Mistral: Llama with a sliding attention window on every layer when `sliding_window` is set."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.registry import ModelFamily, register


def mistral_arch(hf_config: Any) -> ArchConfig:
    window = getattr(hf_config, "sliding_window", None)
    layers = int(hf_config.num_hidden_layers)
    return ArchConfig.from_hf(
        hf_config, sliding_windows=(int(window) if window else None,) * layers
    )


register(ModelFamily("MistralForCausalLM", mistral_arch))
