"""Decoders served for their hidden states: embedders saved as the bare model (`Qwen3Model`,
`LlamaModel`, ...), sequence classifiers (`*ForSequenceClassification`) and reward models
(`Qwen2ForRewardModel`), each registered beside its causal-LM family."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.decoder import DecoderForCausalLM, copy_weight
from radixlm.runtime.models.linear import LinearFactory
from radixlm.runtime.models.registry import ModelFamily, family_of, register

#: The decoder families that have pooling variants.
POOLING_BASES = ("Llama", "Mistral", "Qwen2", "Qwen3")


class DecoderForPooling(DecoderForCausalLM):
    """A decoder without an LM head, with the head of `arch.pooling_head` over a pooled
    final hidden state (none for an embedder).

    Checkpoint names: a bare model's (`layers.0...`, `embed_tokens.weight`) or a head
    model's (`model.layers.0...`, `score.weight`); both load, the first under `model.`."""

    def __init__(
        self,
        arch: ArchConfig,
        dtype: torch.dtype = torch.float32,
        linears: LinearFactory | None = None,
    ) -> None:
        # No logits are computed: the tied "head" is the embedding table, no lm_head is read.
        super().__init__(dataclasses.replace(arch, tie_word_embeddings=True), dtype, linears)
        self.score: nn.Module | None = None
        if arch.pooling_head is not None:
            kind, labels = arch.pooling_head
            hidden = arch.hidden_size
            if kind == "score":
                self.score = nn.Linear(hidden, labels, bias=False, dtype=dtype)
            else:  # Qwen2ForRewardModel: Linear, ReLU, Linear
                self.score = nn.Sequential(
                    nn.Linear(hidden, hidden, dtype=dtype),
                    nn.ReLU(),
                    nn.Linear(hidden, labels, dtype=dtype),
                )

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head's float32 outputs [B, labels] for pooled rows [B, hidden] (the rows
        themselves for an embedder)."""
        if self.score is None:
            return pooled.float()
        weight = next(self.score.parameters())
        return self.score(pooled.to(weight.dtype)).float()  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        head_names: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("score."):
                    if name not in params:
                        raise ValueError(
                            f"the checkpoint has a head tensor the model does not know: {name}"
                        )
                    copy_weight(name, params[name], tensor)
                    head_names.add(name)
                elif name == "lm_head.weight":
                    continue  # a causal LM's head, unused when pooling
                else:
                    yield (name if name.startswith("model.") else f"model.{name}"), tensor

        return super().load_weights(decoder_weights()) | head_names


def _with_head(arch_config: Callable[[Any], ArchConfig], kind: str) -> Callable[[Any], ArchConfig]:
    def read(hf_config: Any) -> ArchConfig:
        labels = int(getattr(hf_config, "num_labels", 1) or 1)
        return dataclasses.replace(arch_config(hf_config), pooling_head=(kind, labels))

    return read


def register_pooling_families() -> None:
    """Register `<Base>Model` and `<Base>ForSequenceClassification` for each base family,
    and `Qwen2ForRewardModel`."""
    for base in POOLING_BASES:
        causal = family_of(f"{base}ForCausalLM")
        register(ModelFamily(f"{base}Model", causal.arch_config, DecoderForPooling))
        register(
            ModelFamily(
                f"{base}ForSequenceClassification",
                _with_head(causal.arch_config, "score"),
                DecoderForPooling,
            )
        )
    qwen2 = family_of("Qwen2ForCausalLM")
    register(
        ModelFamily(
            "Qwen2ForRewardModel", _with_head(qwen2.arch_config, "reward"), DecoderForPooling
        )
    )
