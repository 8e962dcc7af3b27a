"""Linear layers with per-row LoRA deltas from a pool of adapter slots.

`apply_lora` wraps the decoder's projections (q/k/v and gate/up merged column layers, o and
down row layers). Each wrapper holds, for every slot of the pool, the A matrices of the
projections it adapts stacked into one [slots, n * max_rank, in] buffer (the projections of a
merged layer read the same input: one shrink serves them all) and one B buffer
[slots, out, max_rank] per projection. Smaller ranks are zero-padded; a projection an adapter
does not target stays zero. A step's rows carry their adapter's slot (`LoraBatch`: segments of
rows, one per request, slot -1 for none), so one forward serves requests of different
adapters and of none: `lora_shrink` then `lora_expand` (radixlm.kernels: Triton on GPUs, torch
elsewhere) add each row's own delta.

Under tensor parallelism a column layer's B holds this rank's output rows (its `Part`), a row
layer's A this rank's input columns: the row layer's delta is then a partial sum like its
matmul, added before the one all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.kernels import LoraPlan, lora_expand, lora_shrink
from radixlm.runtime.lora.adapter import LoraModuleWeights
from radixlm.runtime.models.linear import MergedColumnLinear, Part, RowLinear

#: Merged column layer -> its projections' Hugging Face names, by shard.
COLUMN_SHARDS = {
    "qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
    "gate_up_proj": {"gate": "gate_proj", "up": "up_proj"},
}
ROW_MODULES = {"o_proj": "o_proj", "down_proj": "down_proj"}
_LAYER_PATH = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|gate_up_proj|o_proj|down_proj)$"
)


@dataclass(frozen=True)
class LoraBatch:
    """The adapters of one forward's rows: `indptr` [segments + 1] splits the rows into
    segments (one per request), `slots` [segments] gives each its pool slot (-1: none)."""

    indptr: torch.Tensor
    slots: torch.Tensor
    #: The rows grouped by slot, built once per step for the torch path (None on CUDA, where
    #: the Triton kernels read the segments themselves).
    plan: LoraPlan | None = None


class LoraContext:
    """What the wrapped layers read at each forward: the current batch's `LoraBatch`, or
    None when no row of it has an adapter (the layers then add nothing)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.batch: LoraBatch | None = None
        #: The dtype of the LoRA weights where the base weights are quantized.
        self.dtype = dtype


class _LoraLinear(nn.Module):
    def __init__(self, context: LoraContext, max_rank: int, like: torch.Tensor) -> None:
        super().__init__()
        self.context = context
        self.max_rank = max_rank
        self.dtype = like.dtype if like.is_floating_point() else context.dtype
        self.device = like.device

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def set_slot(self, slot: int, weights: Mapping[str, LoraModuleWeights]) -> None:
        raise NotImplementedError

    def projection_names(self) -> list[str]:
        """The Hugging Face names of the projections this layer adapts."""
        raise NotImplementedError


class LoraColumnLinear(_LoraLinear):
    """A merged column layer plus the LoRA deltas of its adapted projections."""

    lora_a: torch.Tensor

    def __init__(
        self,
        base: MergedColumnLinear,
        projections: Mapping[str, str],
        num_slots: int,
        max_rank: int,
        context: LoraContext,
    ) -> None:
        super().__init__(context, max_rank, base.weight)
        self.base = base
        #: (Hugging Face name, output columns, this rank's Part) of each adapted projection.
        self.targets: list[tuple[str, tuple[int, int], Part]] = [
            (hf_name, base.shard_ranges[shard], base.parts[shard])
            for shard, hf_name in projections.items()
        ]
        n = len(self.targets)
        self.register_buffer(
            "lora_a", self._zeros(num_slots, n * max_rank, base.in_features), persistent=False
        )
        for i, (_, (begin, end), _part) in enumerate(self.targets):
            self.register_buffer(
                f"lora_b{i}", self._zeros(num_slots, end - begin, max_rank), persistent=False
            )

    def projection_names(self) -> list[str]:
        return [hf_name for hf_name, _cols, _part in self.targets]

    def b(self, i: int) -> torch.Tensor:
        buffer: torch.Tensor = getattr(self, f"lora_b{i}")
        return buffer

    def set_slot(self, slot: int, weights: Mapping[str, LoraModuleWeights]) -> None:
        rank = self.max_rank
        with torch.no_grad():
            for i, (hf_name, _cols, part) in enumerate(self.targets):
                a = self.lora_a[slot, i * rank : (i + 1) * rank]
                b = self.b(i)[slot]
                a.zero_()
                b.zero_()
                found = weights.get(hf_name)
                if found is not None:
                    r = found.rank
                    a[:r].copy_(found.a)
                    b[:, :r].copy_(part.take(found.b, 0))

    def checkpoint_leaves(self) -> tuple[str, ...]:
        return self.base.checkpoint_leaves()

    def load_weight(self, shard: str | None, name: str, tensor: object) -> None:
        self.base.load_weight(shard, name, tensor)

    @property
    def shard_ranges(self) -> dict[str, tuple[int, int]]:
        return self.base.shard_ranges

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        batch = self.context.batch
        if batch is None:
            return out
        y = lora_shrink(x, self.lora_a, batch.indptr, batch.slots, plan=batch.plan)
        rank = self.max_rank
        for i, (_, (begin, end), _part) in enumerate(self.targets):
            lora_expand(
                y[:, i * rank : (i + 1) * rank],
                self.b(i),
                batch.indptr,
                batch.slots,
                out[:, begin:end],
                plan=batch.plan,
            )
        return out


class LoraRowLinear(_LoraLinear):
    """A row layer plus its LoRA delta (a partial sum under tensor parallelism, like its
    matmul, so the one all-reduce adds both)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(
        self,
        base: RowLinear,
        hf_name: str,
        num_slots: int,
        max_rank: int,
        context: LoraContext,
    ) -> None:
        super().__init__(context, max_rank, base.weight)
        self.base = base
        self.hf_name = hf_name
        self.register_buffer(
            "lora_a", self._zeros(num_slots, max_rank, base.in_features), persistent=False
        )
        self.register_buffer(
            "lora_b", self._zeros(num_slots, base.out_features, max_rank), persistent=False
        )

    def set_slot(self, slot: int, weights: Mapping[str, LoraModuleWeights]) -> None:
        with torch.no_grad():
            a = self.lora_a[slot]
            b = self.lora_b[slot]
            a.zero_()
            b.zero_()
            found = weights.get(self.hf_name)
            if found is not None:
                r = found.rank
                a[:r].copy_(self.base.input_part.take(found.a, 1))
                b[:, :r].copy_(found.b)

    def checkpoint_leaves(self) -> tuple[str, ...]:
        return self.base.checkpoint_leaves()

    def load_weight(self, shard: str | None, name: str, tensor: object) -> None:
        self.base.load_weight(shard, name, tensor)

    def projection_names(self) -> list[str]:
        return [self.hf_name]

    def _delta_into(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        y = lora_shrink(x, self.lora_a, batch.indptr, batch.slots, plan=batch.plan)
        lora_expand(y, self.lora_b, batch.indptr, batch.slots, out, plan=batch.plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        batch = self.context.batch
        if batch is None:
            plain: torch.Tensor = base(x)
            return plain
        if not base.tp.enabled:
            out: torch.Tensor = base(x)
            self._delta_into(x, out, batch)
            return out
        partial = base._matmul(x, None)
        self._delta_into(x, partial, batch)
        summed = base.tp.all_reduce(partial)
        return summed if base.bias is None else summed + base.bias


def apply_lora(
    model: nn.Module,
    targets: frozenset[str],
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
) -> tuple[LoraContext, dict[int, list[_LoraLinear]]]:
    """Wrap the decoder projections of `model` that `targets` (Hugging Face names) name
    (LoRA weights in `dtype`). Returns the shared context and the wrappers by layer index."""
    context = LoraContext(dtype)
    layers: dict[int, list[_LoraLinear]] = {}
    for path, module in list(model.named_modules()):
        match = _LAYER_PATH.search(path)
        if match is None or any(part in path for part in ("vision", "visual")):
            continue
        layer, kind = int(match.group(1)), match.group(2)
        wrapper: _LoraLinear
        if kind in COLUMN_SHARDS:
            if not isinstance(module, MergedColumnLinear):
                raise ValueError(f"LoRA cannot adapt {path} ({type(module).__name__})")
            projections = {shard: hf for shard, hf in COLUMN_SHARDS[kind].items() if hf in targets}
            if not projections:
                continue
            wrapper = LoraColumnLinear(module, projections, num_slots, max_rank, context)
        else:
            if ROW_MODULES[kind] not in targets:
                continue
            if not isinstance(module, RowLinear):
                raise ValueError(f"LoRA cannot adapt {path} ({type(module).__name__})")
            wrapper = LoraRowLinear(module, ROW_MODULES[kind], num_slots, max_rank, context)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, wrapper)
        layers.setdefault(layer, []).append(wrapper)
    return context, layers
