"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders with experts on the sparse layers
(`decoder_sparse_step`, `mlp_only_layers`), top-k of a softmax over the experts, renormalised
when `norm_topk_prob`; Qwen2-MoE adds a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.models.arch import ArchConfig, MoEConfig
from radixlm.runtime.models.moe import sparse_layers
from radixlm.runtime.models.qwen2 import qwen_sliding_windows
from radixlm.runtime.models.registry import ModelFamily, register


def _moe(hf_config: Any, shared: int) -> MoEConfig:
    experts = int(hf_config.num_experts)
    return MoEConfig(
        num_experts=experts,
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.moe_intermediate_size),
        normalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_intermediate_size=shared,
        sparse_layers=sparse_layers(hf_config, experts),
    )


def qwen2_moe_arch(hf_config: Any) -> ArchConfig:
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    return ArchConfig.from_hf(
        hf_config,
        qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
        sliding_windows=qwen_sliding_windows(hf_config),
        moe=_moe(hf_config, shared),
    )


def qwen3_moe_arch(hf_config: Any) -> ArchConfig:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchConfig.from_hf(
        hf_config,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        sliding_windows=qwen_sliding_windows(hf_config),
        moe=_moe(hf_config, 0),
    )


register(ModelFamily("Qwen2MoeForCausalLM", qwen2_moe_arch))
register(ModelFamily("Qwen3MoeForCausalLM", qwen3_moe_arch))
