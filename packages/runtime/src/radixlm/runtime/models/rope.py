"""Rotary position embeddings: default, linear, llama3 and yarn frequency schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixlm.runtime.models.arch import RopeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    original = rope.original_max_position_embeddings or max_positions
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, rope: RopeConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    original = rope.original_max_position_embeddings or max_positions
    factor = rope.factor

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale_of(factor, rope.mscale) / mscale_of(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = mscale_of(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = correction_dim(rope.beta_fast)
    high = correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_frequencies(
    head_dim: int, rope: RopeConfig, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] in float32, scale applied to cos and sin)."""
    if rope.rope_type == "default":
        return _base_inv_freq(head_dim, rope.theta), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(head_dim, rope.theta) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(_base_inv_freq(head_dim, rope.theta), rope, max_positions), 1.0
    if rope.rope_type == "yarn":
        return _yarn(head_dim, rope, max_positions)
    raise ValueError(
        f"rope type {rope.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin for given positions, and their application to q and k (the rotate-half layout)."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, self.scale = rope_frequencies(head_dim, rope, max_positions)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and *signed* sin ([-sin, sin] halves) of shape [tokens, 1, head_dim] for
        positions [tokens], in `dtype` — the form `apply_rotary` takes."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = (freqs.cos() * self.scale).to(dtype)
        sin = (freqs.sin() * self.scale).to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] (rotate-half layout): x * cos + swap(x) * signed_sin,
    the same numbers as x * cos + cat(-x2, x1) * sin without negating x."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin
