"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower, a two-layer
projector, and a Llama / Mistral / Qwen2 / Qwen3 language model (the shared decoder).

The runner asks `encode_media` for the embeddings of a prompt's images; they take the image
placeholder positions (the rows `ForwardBatch` marks), exactly as transformers' model merges
them into the language model's input embeddings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.decoder import DecoderForCausalLM
from radixlm.runtime.models.linear import LinearFactory
from radixlm.runtime.models.registry import ModelFamily, register, resolve
from radixlm.runtime.models.vision import VisionTower

# The language model's family by its config's model_type.
_TEXT_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Checkpoint prefixes (transformers 5 layout first, then the older one) -> this model's.
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def image_token_id(hf_config: Any) -> int:
    """The placeholder token of one image position."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, name, None)
        if value is not None:
            return int(value)
    raise ValueError("the config names no image_token_index / image_token_id")


def llava_arch(hf_config: Any) -> ArchConfig:
    text = hf_config.text_config
    family_name = _TEXT_FAMILIES.get(str(getattr(text, "model_type", "")))
    if family_name is None:
        raise ValueError(
            f"a LLaVA language model of type {getattr(text, 'model_type', None)!r} is not "
            f"supported (supported: {', '.join(sorted(_TEXT_FAMILIES))})"
        )
    if not getattr(text, "architectures", None):
        text.architectures = [family_name]
    arch = resolve([family_name]).arch_config(text)
    return ArchConfig(
        **{
            **{f: getattr(arch, f) for f in arch.__dataclass_fields__},
            "architecture": hf_config.architectures[0],
            # The tie flag lives on the top-level config for LLaVA checkpoints.
            "tie_word_embeddings": bool(
                getattr(hf_config, "tie_word_embeddings", arch.tie_word_embeddings)
            ),
            "multimodal": hf_config,
        }
    )


class MultiModalProjector(nn.Module):
    def __init__(self, vision_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_features, hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out


class LlavaForConditionalGeneration(DecoderForCausalLM):
    """The decoder plus a vision tower and a projector (replicated, in the model's dtype)."""

    def __init__(
        self,
        arch: ArchConfig,
        dtype: torch.dtype = torch.float32,
        linears: LinearFactory | None = None,
    ) -> None:
        super().__init__(arch, dtype, linears)
        config = arch.multimodal
        vision = config.vision_config
        layers = config.vision_feature_layer
        strategy = str(config.vision_feature_select_strategy)
        self.vision_tower = VisionTower(vision, layers, strategy).to(dtype)
        count = 1 if isinstance(layers, int) else len(layers)
        self.multi_modal_projector = MultiModalProjector(
            vision.hidden_size * count,
            arch.hidden_size,
            str(getattr(config, "projector_hidden_act", "gelu")),
            bool(getattr(config, "multimodal_projector_bias", True)),
        ).to(dtype)

    @property
    def tokens_per_image(self) -> int:
        return self.vision_tower.tokens_per_image

    def encode_media(self, items: Sequence[Any]) -> list[torch.Tensor]:
        """Embeddings [item.length, hidden] of each image (pixel values [1, 3, H, W])."""
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.cat([item.pixel_values for item in items]).to(weight.device, weight.dtype)
        features = self.multi_modal_projector(self.vision_tower(pixels))
        return list(features)

    # Weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.load_weights_beside(
            weights,
            _rename,
            own=("vision_tower.", "multi_modal_projector."),
            # SigLIP's pooling head: LLaVA reads the patch features.
            skipped=("vision_tower.vision_model.head.",),
        )


def _rename(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    # Towers saved without their `vision_model.` level (as transformers 5 writes them).
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


register(ModelFamily("LlavaForConditionalGeneration", llava_arch, LlavaForConditionalGeneration))
