"""Vision towers of LLaVA-style models: CLIP's and SigLIP's ViT encoders, parameter names as in
their Hugging Face checkpoints (`vision_model.embeddings...`, `vision_model.encoder.layers...`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision hidden_size {hidden} is not divisible by {heads} heads")
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, hidden // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        projected: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))
        return projected


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class VisionLayer(nn.Module):
    """A pre-norm transformer layer (CLIP's and SigLIP's are the same)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = VisionMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class VisionEmbeddings(nn.Module):
    """Patches (a strided convolution) plus learned positions; CLIP prepends a class token."""

    def __init__(self, config: Any, class_token: bool) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_size = patch
        self.num_patches = (config.image_size // patch) ** 2
        self.patch_embedding = nn.Conv2d(
            config.num_channels, hidden, kernel_size=patch, stride=patch, bias=not class_token
        )
        self.class_embedding = nn.Parameter(torch.zeros(hidden)) if class_token else None
        positions = self.num_patches + (1 if class_token else 0)
        self.position_embedding = nn.Embedding(positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.num_patches:
            raise ValueError(
                f"the image gives {patches.shape[1]} patches but the vision tower takes "
                f"{self.num_patches} (a different image size than the processor's?)"
            )
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        out: torch.Tensor = patches + self.position_embedding.weight.unsqueeze(0)
        return out


class VisionEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))


class VisionTransformer(nn.Module):
    """`vision_model` of a CLIPVisionModel / SiglipVisionModel."""

    def __init__(self, config: Any, kind: str) -> None:
        super().__init__()
        clip = kind == "clip"
        self.embeddings = VisionEmbeddings(config, class_token=clip)
        hidden, eps = config.hidden_size, config.layer_norm_eps
        # (sic: CLIP's checkpoints spell it "pre_layrnorm")
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps) if clip else None
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)

    def hidden_states(self, pixel_values: torch.Tensor, layers: int) -> list[torch.Tensor]:
        """The embeddings and the output of each of the first `layers` layers (HF's
        `hidden_states`, truncated: later layers are not computed)."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in list(self.encoder.layers)[:layers]:
            x = layer(x)
            states.append(x)
        return states


class VisionTower(nn.Module):
    """The vision tower of a LLaVA model: the selected layer's patch features (the class token
    dropped under the `default` strategy)."""

    def __init__(self, config: Any, feature_layers: int | list[int], strategy: str) -> None:
        super().__init__()
        kind = str(getattr(config, "model_type", "clip_vision_model"))
        if kind.startswith("clip"):
            self.kind = "clip"
        elif kind.startswith("siglip"):
            self.kind = "siglip"
        else:
            raise ValueError(
                f"vision tower {kind!r} is not supported (CLIP and SigLIP vision models are)"
            )
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        self.vision_model = VisionTransformer(config, self.kind)
        layers = config.num_hidden_layers
        picked = [feature_layers] if isinstance(feature_layers, int) else list(feature_layers)
        self.feature_layers = [p if p >= 0 else layers + 1 + p for p in picked]
        if not all(0 <= p <= layers for p in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower")
        self.drop_class = strategy == "default"

    @property
    def tokens_per_image(self) -> int:
        embeddings = self.vision_model.embeddings
        has_class = embeddings.class_embedding is not None
        return int(embeddings.num_patches) + int(has_class) - int(self.drop_class)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, tokens_per_image, features] for pixel values [images, 3, H, W]."""
        states = self.vision_model.hidden_states(pixel_values, max(self.feature_layers))
        picked = [states[p] for p in self.feature_layers]
        if self.drop_class:
            # Under `default` LLaVA drops the first position (CLIP's class token; a SigLIP
            # tower has none, and transformers drops its first patch all the same).
            picked = [s[:, 1:] for s in picked]
        return torch.cat(picked, dim=-1)
