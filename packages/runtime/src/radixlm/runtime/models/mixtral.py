"""Mixtral: Mistral's decoder with a sparse mixture of experts in every layer (top-k of a
softmax over the experts, renormalised; the weights kept in float32)."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.models.arch import ArchConfig, MoEConfig
from radixlm.runtime.models.registry import ModelFamily, register


def mixtral_arch(hf_config: Any) -> ArchConfig:
    window = getattr(hf_config, "sliding_window", None)
    layers = int(hf_config.num_hidden_layers)
    moe = MoEConfig(
        num_experts=int(hf_config.num_local_experts),
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.intermediate_size),
        normalize=True,
        weights_in_float=True,
        sparse_layers=frozenset(range(layers)),
    )
    return ArchConfig.from_hf(
        hf_config, sliding_windows=(int(window) if window else None,) * layers, moe=moe
    )


register(ModelFamily("MixtralForCausalLM", mixtral_arch))
