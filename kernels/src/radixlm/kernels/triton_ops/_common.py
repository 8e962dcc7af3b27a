"""What the Triton kernels share: interpreter mode, block sizes, the soft-cap helper."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

# Fixed when this module is imported, like Triton's own choice of interpreter or compiler.
INTERPRETED: bool = bool(knobs.runtime.interpret)


def next_pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(1, n)))


def dot_block(n: int) -> int:
    """Block size for a ``tl.dot`` dimension: a power of two, at least 16 when compiled."""
    return max(next_pow2(n), 1 if INTERPRETED else 16)


def upcast_dots(dtype: torch.dtype) -> bool:
    """Run ``tl.dot`` in fp32: always in the interpreter (its bf16 dot is wrong), and for
    fp32 inputs so that the compiled kernel does not silently drop to tf32."""
    return INTERPRETED or dtype == torch.float32


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere); cached per device."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms_cuda(index)


@functools.cache
def _num_sms_cuda(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@triton.jit
def soft_cap(x, cap):
    """``cap * tanh(x / cap)`` written with exp (tanh is not in every Triton build)."""
    return cap - 2.0 * cap / (tl.exp(2.0 * x / cap) + 1.0)


@dataclass(frozen=True, slots=True)
class Blocks:
    """Tile sizes and launch settings of one matmul-like kernel call."""

    m: int
    n: int
    k: int
    num_warps: int
    num_stages: int


def capped_dot_block(n: int, cap: int) -> int:
    """A tile edge for `n` elements: a power of two, at least 16 (tl.dot needs every dimension
    >= 16 when compiled; narrower edges are masked), at most `cap`."""
    return min(max(16, next_pow2(n)), cap)
