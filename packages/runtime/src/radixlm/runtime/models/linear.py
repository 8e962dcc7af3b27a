"""Linear layers behind a small interface, so a tensor-parallel version can replace them.

A model never builds `nn.Linear` itself: it asks a `LinearFactory` for a *merged column* layer
(several projections that read the same input, stored as one matrix: q/k/v, gate/up) or a *row*
layer (a projection whose input is the output of a column layer: o_proj, down_proj). The
replicated factory here keeps every weight whole on one device. A sharded factory would split
column layers by output rows and row layers by input columns (then all-reduce), and load each
checkpoint tensor's slice in `load_weight` — the models would not change.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Linear(Protocol):
    """A linear layer a model calls and the loader fills."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b for x of shape [..., in_features]."""
        ...

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (`name` is "weight" or "bias") into the given shard.

        `shard` names one projection of a merged layer ("q", "gate", ...) or is None for a
        layer with a single projection. Raises ValueError on a shape mismatch.
        """
        ...


class LinearFactory(Protocol):
    """Builds the linear layers of a model (replicated here; sharded in a TP build)."""

    #: Whether the model should keep its LM head in oneDNN's packed layout (CPU).
    packs_lm_head: bool

    def merged_column(self, in_features: int, shards: Mapping[str, int], bias: bool) -> Linear: ...

    def row(self, in_features: int, out_features: int, bias: bool) -> Linear: ...


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)


class MergedColumnLinear(nn.Module):
    """Several projections of the same input stored as one weight [sum(shards), in_features]."""

    def __init__(
        self,
        in_features: int,
        shards: Mapping[str, int],
        bias: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_ranges: dict[str, tuple[int, int]] = {}
        start = 0
        for shard_name, size in shards.items():
            self.shard_ranges[shard_name] = (start, start + size)
            start += size
        self.out_features = start
        self.weight = nn.Parameter(
            torch.empty(start, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(start, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The leaf names a checkpoint provides for each projection of this layer."""
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        if shard is None:
            if len(self.shard_ranges) != 1:
                raise ValueError(
                    f"a merged layer needs a shard name, one of {list(self.shard_ranges)}"
                )
            shard = next(iter(self.shard_ranges))
        begin, end = self.shard_ranges[shard]
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(
                f"{shard}: the checkpoint has a {name} the model config does not expect"
            )
        _copy_checked(target[begin:end], tensor, f"{shard}.{name}")


class RowLinear(nn.Module):
    """A plain projection; in a sharded build its input is split and its output all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The leaf names a checkpoint provides for this layer."""
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"the checkpoint has a {name} the model config does not expect")
        _copy_checked(target, tensor, name)


class ReplicatedLinears:
    """The single-device factory: every weight whole."""

    #: Whether the model should keep its LM head in oneDNN's packed layout too.
    packs_lm_head = False

    def __init__(self, dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.dtype = dtype
        self.device = device

    def merged_column(self, in_features: int, shards: Mapping[str, int], bias: bool) -> Linear:
        return MergedColumnLinear(in_features, shards, bias, self.dtype, self.device)

    def row(self, in_features: int, out_features: int, bias: bool) -> Linear:
        return RowLinear(in_features, out_features, bias, self.dtype, self.device)


@functools.cache
def cpu_packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pre-pack linear weights of `dtype` on this CPU.

    It needs a CPU build of torch with mkldnn, and for bfloat16 / float16 a CPU with the matching
    instructions (AVX512-BF16/FP16 or AVX-NE-CONVERT): without them oneDNN refuses to pack, so a
    tiny weight is packed and multiplied once to find out (the answer is cached per dtype).
    """
    available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if not available or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(2, 8, dtype=dtype), packed, None, "none", [], ""
        )
    except RuntimeError:
        return False
    return True


class PackedWeight:
    """A weight re-laid out by oneDNN for fast CPU GEMM/GEMV (1.5-2x over F.linear in bf16 on
    AVX512-BF16 machines). Packing happens at the first call, after the weights are loaded; the
    plain weight is then released unless `keep_plain` (a tied embedding still needs it)."""

    def __init__(self, keep_plain: bool = False) -> None:
        self.keep_plain = keep_plain
        self.packed: torch.Tensor | None = None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            if not self.keep_plain:
                weight.data = weight.data.new_empty(0)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return out

    def check_loadable(self) -> None:
        if self.packed is not None and not self.keep_plain:
            raise RuntimeError(
                "the weights were packed for CPU inference at the first forward; load weights "
                "before running the model"
            )


class PackedMergedColumnLinear(MergedColumnLinear):
    """MergedColumnLinear computed with oneDNN-packed weights (CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packing = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packing.linear(x, self.weight, self.bias)

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        self.packing.check_loadable()
        super().load_weight(shard, name, tensor)


class PackedRowLinear(RowLinear):
    """RowLinear computed with oneDNN-packed weights (CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packing = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packing.linear(x, self.weight, self.bias)

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        self.packing.check_loadable()
        super().load_weight(shard, name, tensor)


class PackedCPULinears(ReplicatedLinears):
    """The single-device factory for CPU inference: weights pre-packed for oneDNN."""

    packs_lm_head = True

    def merged_column(self, in_features: int, shards: Mapping[str, int], bias: bool) -> Linear:
        return PackedMergedColumnLinear(in_features, shards, bias, self.dtype, self.device)

    def row(self, in_features: int, out_features: int, bias: bool) -> Linear:
        return PackedRowLinear(in_features, out_features, bias, self.dtype, self.device)
