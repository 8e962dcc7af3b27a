"""Qwen3: RMSNorm on each head of q and k before the rotary embedding; optional biases."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.qwen2 import qwen_sliding_windows
from radixlm.runtime.models.registry import ModelFamily, register


def qwen3_arch(hf_config: Any) -> ArchConfig:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchConfig.from_hf(
        hf_config,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        sliding_windows=qwen_sliding_windows(hf_config),
    )


register(ModelFamily("Qwen3ForCausalLM", qwen3_arch))
