"""Linear layers behind a small interface, replicated on one device or split across ranks.

A model never builds `nn.Linear` itself: it asks a `LinearFactory` for a *merged column* layer
(several projections that read the same input, stored as one matrix: q/k/v, gate/up) or a *row*
layer (a projection whose input is the output of a column layer: o_proj, down_proj). Under
tensor parallelism (`factory.tp.size > 1`) a column layer holds this rank's part of each
projection's output rows (a `Part`: q heads split evenly, K/V heads split or replicated) and a
row layer this rank's input columns, its partial outputs summed by one all-reduce. Each layer
reads its slice of a checkpoint tensor in `load_weight`, so a rank never holds more.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixlm import kernels
from radixlm.runtime.distributed import SINGLE, TensorParallel


class Linear(Protocol):
    """A linear layer a model calls and the loader fills."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b for x of shape [..., in_features]."""
        ...

    def load_weight(self, shard: str | None, name: str, tensor: Any) -> None:
        """Copy a checkpoint tensor (`name` is "weight" or "bias") into the given shard.

        `shard` names one projection of a merged layer ("q", "gate", ...) or is None for a
        layer with a single projection. `tensor` is a torch tensor or a lazy checkpoint slice
        (`narrow` / `read`). Raises ValueError on a shape mismatch.
        """
        ...


@dataclass(frozen=True)
class Part:
    """This rank's piece of a dimension of `size`: the `index`-th of `parts` equal pieces."""

    size: int
    parts: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.size % self.parts:
            raise ValueError(f"{self.size} does not split into {self.parts} equal parts")

    @property
    def local(self) -> int:
        return self.size // self.parts

    @property
    def start(self) -> int:
        return self.index * self.local

    def take(self, tensor: Any, dim: int) -> torch.Tensor:
        """This part of a checkpoint tensor along `dim` (read from disk only there when lazy)."""
        if tensor.shape[dim] != self.size:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(tensor.shape)}, the model expects "
                f"{self.size} along dimension {dim}"
            )
        if self.parts == 1:
            return materialize(tensor)
        piece: torch.Tensor = tensor.narrow(dim, self.start, self.local)
        return piece


def materialize(tensor: Any) -> torch.Tensor:
    """A torch tensor from a tensor or a lazy checkpoint slice."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    read: torch.Tensor = tensor.read()
    return read


def split_evenly(size: int, tp: TensorParallel, what: str) -> Part:
    """This rank's part of a dimension split across every rank."""
    if size % tp.size:
        raise ValueError(f"{what} ({size}) must be divisible by tp_size ({tp.size})")
    return Part(size, tp.size, tp.rank)


@dataclass(frozen=True)
class HeadLayout:
    """Attention heads on one rank: its query heads and its key/value heads (split across ranks,
    or each replicated on `tp_size / num_kv_heads` ranks when there are fewer than ranks)."""

    num_heads: int
    num_kv_heads: int
    q: Part
    kv: Part

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel) -> HeadLayout:
        if num_heads % tp.size:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be divisible by tp_size ({tp.size})"
            )
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) and tp_size ({tp.size}) must divide "
                "one another (K/V heads are split across ranks, or replicated when fewer)"
            )
        kv_parts = min(num_kv_heads, tp.size)
        kv_index = tp.rank * kv_parts // tp.size
        return cls(
            num_heads=num_heads // tp.size,
            num_kv_heads=num_kv_heads // kv_parts,
            q=Part(num_heads * head_dim, tp.size, tp.rank),
            kv=Part(num_kv_heads * head_dim, kv_parts, kv_index),
        )


class LinearFactory(Protocol):
    """Builds the linear layers of a model (replicated, or sharded across `tp`'s ranks)."""

    #: Whether the model should keep its LM head in oneDNN's packed layout (CPU).
    packs_lm_head: bool
    #: The tensor-parallel group the layers are split across (`SINGLE`: not split).
    tp: TensorParallel

    def merged_column(
        self, in_features: int, shards: Mapping[str, int | Part], bias: bool
    ) -> Linear: ...

    def row(self, in_features: int, out_features: int, bias: bool) -> Linear: ...


def _copy_checked(target: torch.Tensor, tensor: Any, what: str) -> None:
    tensor = materialize(tensor)
    if target.shape != tensor.shape:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)


def as_parts(shards: Mapping[str, int | Part]) -> dict[str, Part]:
    """Each projection's Part (a plain size is the whole of it)."""
    return {name: size if isinstance(size, Part) else Part(size) for name, size in shards.items()}


def whole_sizes(shards: Mapping[str, int | Part], what: str) -> dict[str, int]:
    """Each projection's size, for a layer that cannot be split across ranks."""
    sizes: dict[str, int] = {}
    for name, part in as_parts(shards).items():
        if part.parts != 1:
            raise ValueError(f"{what} cannot be split across tensor-parallel ranks")
        sizes[name] = part.size
    return sizes


def mark_sharded(*params: nn.Parameter | None) -> None:
    """Tag parameters that hold one rank's slice (dummy weights then differ per rank, while
    replicated parameters stay equal on every rank)."""
    for param in params:
        if param is not None:
            param.tp_sharded = True  # type: ignore[attr-defined]


class MergedColumnLinear(nn.Module):
    """Several projections of the same input stored as one weight [sum of local sizes, in].

    Each projection holds its `Part` of the output rows (all of them when not split)."""

    def __init__(
        self,
        in_features: int,
        shards: Mapping[str, int | Part],
        bias: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = as_parts(shards)
        self.shard_ranges: dict[str, tuple[int, int]] = {}
        start = 0
        for shard_name, part in self.parts.items():
            self.shard_ranges[shard_name] = (start, start + part.local)
            start += part.local
        self.out_features = start
        self.weight = nn.Parameter(
            torch.empty(start, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(start, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        if any(part.parts > 1 for part in self.parts.values()):
            mark_sharded(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The leaf names a checkpoint provides for each projection of this layer."""
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def load_weight(self, shard: str | None, name: str, tensor: Any) -> None:
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
        try:
            piece = self.parts[shard].take(tensor, 0)
        except ValueError as error:
            raise ValueError(f"{shard}.{name}: {error}") from None
        _copy_checked(target[begin:end], piece, f"{shard}.{name}")


class RowLinear(nn.Module):
    """A projection of a column layer's output. Under tensor parallelism it holds this rank's
    input columns; the ranks' partial products are summed by one all-reduce, then the bias
    (whole on every rank) is added."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_part = split_evenly(in_features, tp, "the input of a row-parallel layer")
        self.in_features = self.input_part.local
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_features, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        if tp.enabled:
            mark_sharded(self.weight)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self._matmul(x, self.bias)
        out = self.tp.all_reduce(self._matmul(x, None))
        return out if self.bias is None else out + self.bias

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The leaf names a checkpoint provides for this layer."""
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def load_weight(self, shard: str | None, name: str, tensor: Any) -> None:
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"the checkpoint has a {name} the model config does not expect")
        if name == "weight":
            if len(tensor.shape) != 2:
                raise ValueError(f"weight: checkpoint tensor has shape {tuple(tensor.shape)}")
            try:
                tensor = self.input_part.take(tensor, 1)
            except ValueError as error:
                raise ValueError(f"weight: {error}") from None
        _copy_checked(target, tensor, name)


class VocabEmbedding(nn.Module):
    """An embedding table (or LM head) over the vocabulary, split by rows across ranks.

    Rank r holds rows `[r * per_rank, (r + 1) * per_rank)` (the last rank's rows past the
    vocabulary are zero padding). The lookup embeds the ids in this rank's range, zeros the
    others and all-reduces; as an LM head each rank scores its rows and the logits are
    gathered (`tp.all_gather`, then cut to the vocabulary). Not split, it is a plain table.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.vocab_start = min(tp.rank * self.per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False
        )
        if tp.enabled:
            mark_sharded(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        hidden = F.embedding(local, self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary from this rank's [..., per_rank] scores."""
        if not self.tp.enabled:
            return local
        return self.tp.all_gather(local)[..., : self.vocab_size]

    def checkpoint_leaves(self) -> tuple[str, ...]:
        return ("weight",)

    def load_weight(self, shard: str | None, name: str, tensor: Any) -> None:
        if name != "weight" or len(tensor.shape) != 2:
            raise ValueError(f"an embedding table has one 2-D weight; got {name}")
        if tensor.shape[0] != self.vocab_size or tensor.shape[1] != self.weight.shape[1]:
            raise ValueError(
                f"weight: checkpoint tensor has shape {tuple(tensor.shape)}, the model "
                f"expects {(self.vocab_size, self.weight.shape[1])}"
            )
        rows = self.vocab_end - self.vocab_start
        piece = (
            materialize(tensor) if not self.tp.enabled else tensor.narrow(0, self.vocab_start, rows)
        )
        _copy_checked(self.weight[:rows], piece, name)


class ReplicatedLinears:
    """The single-device factory: every weight whole."""

    #: Whether the model should keep its LM head in oneDNN's packed layout too.
    packs_lm_head = False
    tp = SINGLE

    def __init__(self, dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.dtype = dtype
        self.device = device

    def merged_column(
        self, in_features: int, shards: Mapping[str, int | Part], bias: bool
    ) -> Linear:
        return MergedColumnLinear(in_features, shards, bias, self.dtype, self.device)

    def row(self, in_features: int, out_features: int, bias: bool) -> Linear:
        return RowLinear(in_features, out_features, bias, self.dtype, self.device)


class ShardedLinears(ReplicatedLinears):
    """The tensor-parallel factory: column layers hold this rank's output rows (a plain size
    is split evenly), row layers its input columns and all-reduce; `pack` keeps the weights
    in oneDNN's packed layout (CPU)."""

    def __init__(
        self,
        tp: TensorParallel,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        pack: bool = False,
    ) -> None:
        super().__init__(dtype, device)
        self.tp = tp
        self.pack = pack
        self.packs_lm_head = pack

    def merged_column(
        self, in_features: int, shards: Mapping[str, int | Part], bias: bool
    ) -> Linear:
        parts = {
            name: size if isinstance(size, Part) else split_evenly(size, self.tp, name)
            for name, size in shards.items()
        }
        layer = PackedMergedColumnLinear if self.pack else MergedColumnLinear
        return layer(in_features, parts, bias, self.dtype, self.device)

    def row(self, in_features: int, out_features: int, bias: bool) -> Linear:
        layer = PackedRowLinear if self.pack else RowLinear
        return layer(in_features, out_features, bias, self.dtype, self.device, self.tp)


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
    plain weight is then released unless `keep_plain` (a tied embedding still needs it), and
    brought back from the packed copy when weights are loaded again (`unpack_for_load`).

    Or, for the CPU decode path's float32 layers on one thread (`use_panels`), in radixlm's
    float32 panels (`kernels.cpu.pack_f32_panels`): the plain weight is released, and every
    product, prefills' too, reads the panels in C."""

    def __init__(self, keep_plain: bool = False) -> None:
        self.keep_plain = keep_plain
        self.packed: torch.Tensor | None = None
        #: False once `stay_plain` or `use_panels` was called: oneDNN packs nothing.
        self.enabled = True
        #: The weight in float32 panels (`use_panels`), or None.
        self.panels: torch.Tensor | None = None
        self._rows = 0

    def stay_plain(self) -> bool:
        """Never pack: multiply the plain weight from now on, for a caller that reads it (the
        CPU decode path). False when it was packed (and released) already."""
        if self.packed is not None and not self.keep_plain:
            return False
        self.packed, self.enabled = None, False
        return True

    def use_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Hold this float32 weight [N, K] in panels from now on and release the plain one
        (kept when `keep_plain`); every product then runs in C on one thread. The panels, or
        None when oneDNN packed (and released) it already."""
        if self.panels is not None:
            return self.panels
        if not self.stay_plain():
            return None
        self.panels = kernels.cpu.pack_f32_panels(weight.detach())
        self._rows = weight.shape[0]
        if not self.keep_plain:
            weight.data = weight.data.new_empty(0)
        return self.panels

    def plain(self) -> torch.Tensor | None:
        """The weight read back from the panels, or None when it is not held in panels."""
        if self.panels is None:
            return None
        return kernels.cpu.unpack_f32_panels(self.panels, self._rows)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.panels is not None:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            product = kernels.cpu.f32_panel_linear(rows, self.panels, self._rows)
            if bias is not None:
                product += bias
            return product.view(*x.shape[:-1], self._rows)
        if not self.enabled:
            return F.linear(x, weight, bias)
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            if not self.keep_plain:
                weight.data = weight.data.new_empty(0)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return out

    def unpack_for_load(self, weight: torch.Tensor) -> None:
        """Before new weights are loaded into `weight` (a weight update): a released plain
        weight is brought back from the packed copy (oneDNN's reorder is lossless), so rows
        the update leaves alone keep their values; the packed copy is dropped either way and
        made again from the new weight at the next call. Panels are dropped the same way (the
        plain weight is multiplied until the CPU decode path, built again after a load, lays
        it out again)."""
        if self.panels is not None:
            if weight.numel() == 0:
                weight.data = kernels.cpu.unpack_f32_panels(self.panels, self._rows)
            self.panels = None
            return
        if self.packed is None:
            return
        if weight.numel() == 0:
            weight.data = self.packed.to_dense().to(weight.dtype)
        self.packed = None


class PackedMergedColumnLinear(MergedColumnLinear):
    """MergedColumnLinear computed with oneDNN-packed weights (CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packing = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packing.linear(x, self.weight, self.bias)

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        self.packing.unpack_for_load(self.weight)
        super().load_weight(shard, name, tensor)


class PackedRowLinear(RowLinear):
    """RowLinear computed with oneDNN-packed weights (CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packing = PackedWeight()

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.packing.linear(x, self.weight, bias)

    def load_weight(self, shard: str | None, name: str, tensor: torch.Tensor) -> None:
        self.packing.unpack_for_load(self.weight)
        super().load_weight(shard, name, tensor)


class PackedCPULinears(ReplicatedLinears):
    """The single-device factory for CPU inference: weights pre-packed for oneDNN."""

    packs_lm_head = True

    def merged_column(
        self, in_features: int, shards: Mapping[str, int | Part], bias: bool
    ) -> Linear:
        return PackedMergedColumnLinear(in_features, shards, bias, self.dtype, self.device)

    def row(self, in_features: int, out_features: int, bias: bool) -> Linear:
        return PackedRowLinear(in_features, out_features, bias, self.dtype, self.device)
