"""Llama 2 / 3 / 3.1 / 3.2 (including llama3 rope scaling)."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.registry import ModelFamily, register


def llama_arch(hf_config: Any) -> ArchConfig:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchConfig.from_hf(
        hf_config,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
    )


register(ModelFamily("LlamaForCausalLM", llama_arch))
