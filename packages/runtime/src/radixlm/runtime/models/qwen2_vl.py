"""Qwen2-VL and Qwen2.5-VL: a native-resolution vision transformer whose patch merger feeds the
Qwen2 decoder, and M-RoPE in the decoder (rotary positions on three axes: time, height, width).

The runner asks `encode_media` for the embeddings of a prompt's images and videos; they take the
placeholder positions, and the prompt's three-axis positions come from the media processor
(`radixlm.runtime.multimodal.qwen2_vl`), as transformers' model computes them."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from radixlm.runtime.models.arch import ArchConfig, RopeConfig
from radixlm.runtime.models.decoder import DecoderForCausalLM, RMSNorm
from radixlm.runtime.models.linear import LinearFactory
from radixlm.runtime.models.qwen2 import qwen_sliding_windows
from radixlm.runtime.models.registry import ModelFamily, register
from radixlm.runtime.models.rope import RotaryEmbedding, apply_rotary

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
# transformers' default when a config names no section.
_DEFAULT_MROPE_SECTION = (16, 24, 24)
# Checkpoint prefixes (transformers 5 layout) -> this model's (the older layout's).
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
_VISION_NORM_EPS = 1e-6


def text_config(hf_config: Any) -> Any:
    """The language model's config: `text_config`, or the top level of an older config."""
    return getattr(hf_config, "text_config", None) or hf_config


def mrope_section(hf_config: Any) -> tuple[int, ...]:
    """How many rotary frequencies turn with each axis (time, height, width, in turn)."""
    text = text_config(hf_config)
    params: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(text, name, None)
        if isinstance(value, Mapping):
            params.update(value)
    return tuple(int(n) for n in params.get("mrope_section") or _DEFAULT_MROPE_SECTION)


def qwen2_vl_arch(hf_config: Any) -> ArchConfig:
    text = text_config(hf_config)
    if not getattr(text, "architectures", None):
        text.architectures = list(hf_config.architectures)
    if text is not hf_config and getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf_config, "dtype", None)  # saved on the top level only
    arch = ArchConfig.from_hf(text, qkv_bias=True, sliding_windows=qwen_sliding_windows(text))
    rope = arch.rope
    if rope.rope_type == "mrope":  # older configs: the default frequencies, on three axes
        rope = dataclasses.replace(rope, rope_type="default")
    # The tie flag lives on the top-level config.
    tie = getattr(hf_config, "tie_word_embeddings", None)
    return dataclasses.replace(
        arch,
        architecture=hf_config.architectures[0],
        rope=rope,
        tie_word_embeddings=arch.tie_word_embeddings if tie is None else bool(tie),
        multimodal=hf_config,
    )


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: the rotary frequencies split into three sections that turn with the time, height
    and width positions. Takes positions [3, tokens], or [tokens] (text: every axis the same,
    which is ordinary RoPE)."""

    def __init__(
        self, head_dim: int, rope: RopeConfig, max_positions: int, section: Sequence[int]
    ) -> None:
        super().__init__(head_dim, rope, max_positions)
        if sum(section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(section)} must add up to head_dim / 2 = {head_dim // 2}"
            )
        axis = torch.cat(
            [torch.full((size,), k % 3, dtype=torch.int64) for k, size in enumerate(section)]
        )
        self.axis: torch.Tensor
        self.register_buffer("axis", axis, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        # Frequency i turns with the position on axis `axis[i]`: [head_dim / 2, tokens].
        chosen = positions.to(torch.float32)[self.axis.to(positions.device)]
        freqs = chosen.t() * self.inv_freq.to(positions.device)[None, :]
        cos = (freqs.cos() * self.scale).to(dtype)
        sin = (freqs.sin() * self.scale).to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


# Vision tower ------------------------------------------------------------------------------


def _segment_groups(lengths: Iterable[int], device: torch.device) -> list[torch.Tensor]:
    """Row indices [segments, length] of consecutive segments, grouped by length (one batched
    attention call per distinct length)."""
    starts: dict[int, list[int]] = defaultdict(list)
    offset = 0
    for length in lengths:
        if length:
            starts[length].append(offset)
        offset += length
    return [
        torch.tensor(first, device=device)[:, None] + torch.arange(length, device=device)
        for length, first in starts.items()
    ]


class PatchEmbed(nn.Module):
    """A 3-D convolution over (temporal_patch_size, patch, patch) pixel blocks, one per row."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(
            channels,
            dim,
            kernel_size=(temporal, patch, patch),
            stride=(temporal, patch, patch),
            bias=False,
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        flat = weight.reshape(weight.shape[0], -1)
        if pixels.shape[-1] != flat.shape[1]:
            raise ValueError(
                f"pixel rows have {pixels.shape[-1]} values; this vision tower takes "
                f"{flat.shape[1]} (channels x temporal_patch_size x patch_size^2)"
            )
        # A convolution whose kernel covers its whole input is one matrix product (the same
        # numbers as transformers' Conv3d up to float rounding, without a convolution kernel).
        return F.linear(pixels.to(weight.dtype), flat)


class VisionRotary(nn.Module):
    """2-D rotary positions of the patches: half the frequencies turn with the row, half with
    the column (patches ordered as the processor lays them out: by merge block)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        half = head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32) / half
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def cos_sin(
        self, grids: Sequence[tuple[int, int, int]], merge: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [patches, 1, head_dim] in float32."""
        device = self.inv_freq.device
        rows: list[torch.Tensor] = []
        for t, h, w in grids:
            hh = torch.arange(h, device=device)[:, None].expand(h, w)
            ww = torch.arange(w, device=device)[None, :].expand(h, w)
            pairs = [
                axis.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
                for axis in (hh, ww)
            ]
            rows.append(torch.stack(pairs, dim=-1).repeat(t, 1))
        positions = torch.cat(rows).to(torch.float32)  # [patches, 2]
        angles = (positions[:, :, None] * self.inv_freq[None, None, :]).flatten(1)
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment (a frame, or a window of one)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"the vision width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        count = x.shape[0]
        q, k, v = self.qkv(x).view(count, 3, self.heads, -1).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = torch.empty_like(q)
        for rows in groups:
            # [segments, heads, length, head_dim]
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(1, 2), k[rows].transpose(1, 2), v[rows].transpose(1, 2)
            )
            out[rows] = attended.transpose(1, 2)
        projected: torch.Tensor = self.proj(out.reshape(count, -1))
        return projected


class VisionMLP(nn.Module):
    """Qwen2-VL's block MLP: fc1, activation (QuickGELU), fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = ACT2FN[act]
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL's block MLP: act(gate) * up, down (SwiGLU, with biases)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


class VisionBlock(nn.Module):
    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module):
        super().__init__()
        self.norm1 = norm1
        self.norm2 = norm2
        self.attn = attn
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        mixed: torch.Tensor = self.mlp(self.norm2(x))
        return x + mixed


class PatchMerger(nn.Module):
    """Each merge x merge block of patches -> one embedding of the language model's width."""

    def __init__(self, norm: nn.Module, context: int, out: int, merge: int) -> None:
        super().__init__()
        self.width = context * merge * merge
        self.ln_q = norm
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged: torch.Tensor = self.mlp(self.ln_q(x).reshape(-1, self.width))
        return merged


class VisionTransformer(nn.Module):
    """`visual` of a Qwen2-VL (LayerNorm + QuickGELU blocks, attention within each frame) or a
    Qwen2.5-VL (RMSNorm + SwiGLU blocks, attention within windows except in the blocks
    `fullatt_block_indexes` names). Parameter names follow the checkpoints."""

    def __init__(self, config: Any, windowed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.merge = int(config.spatial_merge_size)
        patch = int(config.patch_size)
        temporal = int(config.temporal_patch_size)
        channels = vision_channels(config)
        heads = int(config.num_heads)
        if windowed:
            dim, out = int(config.hidden_size), int(config.out_hidden_size)
            hidden = int(config.intermediate_size)
        else:
            dim, out = int(config.embed_dim), int(config.hidden_size)
            hidden = int(dim * config.mlp_ratio)
        act = str(config.hidden_act)

        def norm() -> nn.Module:
            return RMSNorm(dim, _VISION_NORM_EPS, dtype) if windowed else nn.LayerNorm(dim, 1e-6)

        def mlp() -> nn.Module:
            return VisionGatedMLP(dim, hidden, act) if windowed else VisionMLP(dim, hidden, act)

        self.patch_embed = PatchEmbed(channels, temporal, patch, dim)
        rope = getattr(config, "rope_parameters", None) or {}
        self.rotary = VisionRotary(dim // heads, float(rope.get("rope_theta", 10000.0)))
        depth = int(config.depth)
        self.blocks = nn.ModuleList(
            VisionBlock(norm(), norm(), VisionAttention(dim, heads), mlp()) for _ in range(depth)
        )
        self.merger = PatchMerger(norm(), dim, out, self.merge)
        self.windowed = windowed
        self.full_blocks = (
            {int(i) for i in config.fullatt_block_indexes} if windowed else set(range(depth))
        )
        # A window's side, in merge blocks.
        self.window_blocks = (
            max(1, int(config.window_size) // self.merge // patch) if windowed else 0
        )

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Embeddings [sum of t*h*w / merge^2, out] of the items' patches, in order."""
        x = self.patch_embed(pixels)
        unit = self.merge * self.merge
        cos, sin = self.rotary.cos_sin(grids, self.merge)
        frames = _segment_groups((h * w for t, h, w in grids for _ in range(t)), x.device)
        windows = frames
        order: torch.Tensor | None = None
        if self.windowed:
            order, lengths = self._window_order(grids, x.device)

            def permute(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(-1, unit, *t.shape[1:])[order].reshape(t.shape)

            x, cos, sin = permute(x), permute(cos), permute(sin)
            windows = _segment_groups((n * unit for n in lengths), x.device)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if index in self.full_blocks else windows)
        merged: torch.Tensor = self.merger(x)
        if order is not None:
            restored = torch.empty_like(merged)
            restored[order] = merged
            merged = restored
        return merged

    def _window_order(
        self, grids: Sequence[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, list[int]]:
        """The merge blocks reordered window by window (each frame cut into windows of
        window_blocks x window_blocks blocks, row-major), and each window's block count."""
        side = self.window_blocks
        order: list[torch.Tensor] = []
        lengths: list[int] = []
        offset = 0
        for t, h, w in grids:
            rows, cols = h // self.merge, w // self.merge
            blocks = torch.arange(t * rows * cols, device=device).reshape(t, rows, cols) + offset
            # Pad to whole windows with -1, then lay the windows out one per row.
            padded = F.pad(blocks, (0, -cols % side, 0, -rows % side), value=-1)
            across, down = padded.shape[2] // side, padded.shape[1] // side
            windows = padded.reshape(t, down, side, across, side).permute(0, 1, 3, 2, 4)
            windows = windows.reshape(-1, side * side)
            order.append(windows[windows >= 0])
            lengths.extend((windows >= 0).sum(dim=1).tolist())
            offset += t * rows * cols
        return torch.cat(order), lengths


# Model ---------------------------------------------------------------------------------------


def vision_channels(vision: Any) -> int:
    """Input channels (`in_channels`; older configs say `in_chans`)."""
    return int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3)


def item_grid(item: Any) -> tuple[int, int, int]:
    """An item's patch grid (t, h, w) from its processor outputs."""
    grid = item.extra.get("grid_thw") if isinstance(item.extra, Mapping) else None
    if grid is None:
        raise ValueError("a Qwen2-VL media item needs `grid_thw` among its processor outputs")
    t, h, w = (int(v) for v in grid)
    return t, h, w


class Qwen2VLForConditionalGeneration(DecoderForCausalLM):
    """The Qwen2 decoder with M-RoPE plus the vision transformer (replicated, in the model's
    dtype)."""

    windowed = False

    def __init__(
        self,
        arch: ArchConfig,
        dtype: torch.dtype = torch.float32,
        linears: LinearFactory | None = None,
    ) -> None:
        super().__init__(arch, dtype, linears)
        config = arch.multimodal
        self.model.rotary = MRotaryEmbedding(
            arch.head_dim, arch.rope, arch.max_position_embeddings, mrope_section(config)
        )
        self.visual = VisionTransformer(config.vision_config, self.windowed, dtype).to(dtype)

    def encode_media(self, items: Sequence[Any]) -> list[torch.Tensor]:
        """Embeddings [t*h*w / merge^2, hidden] of each item (image or video), in order; an
        item's pixel values are [t*h*w, channels x temporal_patch_size x patch^2] and its
        `extra["grid_thw"]` is (t, h, w). Attention never crosses items."""
        grids = [item_grid(item) for item in items]
        weight = self.visual.patch_embed.proj.weight
        pixels = []
        for item, (t, h, w) in zip(items, grids, strict=True):
            values = torch.as_tensor(item.pixel_values)
            if values.dim() != 2 or values.shape[0] != t * h * w:
                raise ValueError(
                    f"pixel values of shape {list(values.shape)} do not hold the {t * h * w} "
                    f"patches of grid {(t, h, w)}"
                )
            pixels.append(values)
        features = self.visual(torch.cat(pixels).to(weight.device, weight.dtype), grids)
        unit = self.visual.merge * self.visual.merge
        return list(torch.split(features, [t * h * w // unit for t, h, w in grids]))

    # Weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.load_weights_beside(weights, _rename, own=("visual.",))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder; RMSNorm + SwiGLU vision blocks with window attention."""

    windowed = True


def _rename(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


register(ModelFamily(QWEN2_VL, qwen2_vl_arch, Qwen2VLForConditionalGeneration))
register(ModelFamily(QWEN2_5_VL, qwen2_vl_arch, Qwen2_5_VLForConditionalGeneration))
