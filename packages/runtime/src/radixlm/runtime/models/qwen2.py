"""Qwen2 / Qwen2.5: biases on q, k and v; sliding window on the layers `layer_types` marks."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.models.arch import ArchConfig, layer_sliding_windows
from radixlm.runtime.models.registry import ModelFamily, register


def qwen_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Windows per layer: from `layer_types`, or (older configs) `use_sliding_window` applied to
    the layers from `max_window_layers` on."""
    if getattr(hf_config, "layer_types", None):
        return layer_sliding_windows(hf_config)
    layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if not (getattr(hf_config, "use_sliding_window", False) and window):
        return (None,) * layers
    first = int(getattr(hf_config, "max_window_layers", layers))
    return tuple(int(window) if i >= first else None for i in range(layers))


def qwen2_arch(hf_config: Any) -> ArchConfig:
    return ArchConfig.from_hf(
        hf_config, qkv_bias=True, sliding_windows=qwen_sliding_windows(hf_config)
    )


register(ModelFamily("Qwen2ForCausalLM", qwen2_arch))
