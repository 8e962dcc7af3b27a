"""The adapter pool of one rank: the wrapped layers' slot buffers and the adapters they hold.

The scheduler (rank 0, `radixlm.runtime.scheduler.adapters.AdapterSlots`) decides which
adapter sits in which slot; each step carries that table, and `sync` makes this rank's buffers
match it before the forward, copying an adapter's weights in only when its slot changed.
Rank 0 keeps every registered adapter's weights on the CPU (`add` / `remove`), so a slot swap
is a copy; the other ranks read an adapter from its directory when a slot first needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.kernels import lora_plan
from radixlm.runtime.lora.adapter import (
    TARGET_MODULES,
    LoraAdapter,
    LoraAdapterError,
    LoraModuleWeights,
    load_adapter,
)
from radixlm.runtime.lora.layers import LoraBatch, apply_lora
from radixlm.runtime.models.arch import ArchConfig

#: The rank of the pool when no initial adapter tells it (`max_lora_rank`).
DEFAULT_MAX_RANK = 16
#: A slot's entry in a step's table: (adapter uid, adapter directory), or None when empty.
SlotEntry = tuple[str, str] | None


@dataclass(frozen=True)
class PoolShape:
    """What the pool can hold: `slots` adapters at once, ranks up to `max_rank`, on the
    projections `targets` (Hugging Face names)."""

    slots: int
    max_rank: int
    targets: frozenset[str]

    def check(self, adapter: LoraAdapter) -> None:
        """LoraAdapterError unless the pool can hold `adapter`."""
        if adapter.rank > self.max_rank:
            raise LoraAdapterError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above the server's "
                f"max_lora_rank {self.max_rank}; restart it with --max-lora-rank {adapter.rank}"
            )
        outside = sorted(adapter.target_modules - self.targets)
        if outside:
            raise LoraAdapterError(
                f"LoRA adapter {adapter.name!r} targets {', '.join(outside)}, which the server's "
                f"adapter pool does not hold ({', '.join(sorted(self.targets))}); restart it "
                "with --lora-target-modules all (or naming these)"
            )


def pool_shape(
    initial: Sequence[LoraAdapter],
    slots: int,
    max_rank: int | None,
    target_modules: Sequence[str] | None,
) -> PoolShape:
    """The pool's shape: given values, else what the initial adapters need (all projections
    and rank 16 without any)."""
    if target_modules is not None:
        unknown = sorted(set(target_modules) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(
                f"lora_target_modules: {', '.join(unknown)} cannot be adapted; choose among "
                f"{', '.join(TARGET_MODULES)} (or all)"
            )
        targets = frozenset(target_modules)
    elif initial:
        targets = frozenset().union(*(a.target_modules for a in initial))
    else:
        targets = frozenset(TARGET_MODULES)
    rank = max_rank if max_rank is not None else max((a.rank for a in initial), default=0)
    return PoolShape(slots=slots, max_rank=rank or DEFAULT_MAX_RANK, targets=targets)


class LoraManager:
    """This rank's adapter pool over a model whose projections it wraps."""

    def __init__(
        self,
        model: nn.Module,
        arch: ArchConfig,
        shape: PoolShape,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.arch = arch
        self.shape = shape
        self.device = device
        self.context, self.layers = apply_lora(
            model, shape.targets, shape.slots, shape.max_rank, dtype
        )
        #: The (layer, projection) pairs the wrapped layers hold (a mixture-of-experts layer
        #: has no dense gate/up/down to adapt).
        self.covered = {
            (layer, name)
            for layer, wrappers in self.layers.items()
            for wrapper in wrappers
            for name in wrapper.projection_names()
        }
        #: Adapters registered on this rank (rank 0: every loaded one), by uid.
        self.registered: dict[str, LoraAdapter] = {}
        #: Adapters a slot needed that were not registered here (other ranks), by uid.
        self._fetched: dict[str, LoraAdapter] = {}
        #: The uid each slot holds.
        self.slots: list[str | None] = [None] * shape.slots
        self.swaps = 0

    def add(self, uid: str, adapter: LoraAdapter) -> None:
        """Register a checked adapter (LoraAdapterError when the pool cannot hold it)."""
        self.check(adapter)
        self.registered[uid] = adapter

    def check(self, adapter: LoraAdapter) -> None:
        self.shape.check(adapter)
        missing = sorted(set(adapter.weights) - self.covered)
        if missing:
            layer, module = missing[0]
            raise LoraAdapterError(
                f"LoRA adapter {adapter.name!r} adapts layer {layer}'s {module}, which this "
                "model does not have as a dense projection (a mixture-of-experts layer's "
                "experts cannot be adapted)"
            )

    def remove(self, uid: str) -> None:
        self.registered.pop(uid, None)

    def sync(self, table: Sequence[SlotEntry]) -> None:
        """Make the slots hold the adapters of `table` (the step's slot table)."""
        if len(table) != self.shape.slots:
            raise ValueError(f"a slot table of {len(table)} entries for {self.shape.slots} slots")
        for slot, entry in enumerate(table):
            uid = entry[0] if entry is not None else None
            if self.slots[slot] == uid:
                continue
            if entry is not None:
                self._write(slot, self._adapter(*entry))
            self.slots[slot] = uid
        wanted = {entry[0] for entry in table if entry is not None}
        for uid in [u for u in self._fetched if u not in wanted]:
            del self._fetched[uid]

    def _adapter(self, uid: str, path: str) -> LoraAdapter:
        adapter = self.registered.get(uid) or self._fetched.get(uid)
        if adapter is None:
            adapter = load_adapter(uid, path, self.arch)
            self.check(adapter)
            self._fetched[uid] = adapter
        return adapter

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        by_layer: dict[int, dict[str, LoraModuleWeights]] = {}
        for (layer, module), weights in adapter.weights.items():
            by_layer.setdefault(layer, {})[module] = weights
        for layer, wrappers in self.layers.items():
            found = by_layer.get(layer, {})
            for wrapper in wrappers:
                wrapper.set_slot(slot, found)
        self.swaps += 1

    def set_batch(self, segments: Sequence[tuple[int, int]]) -> None:
        """The next forward's rows: (row count, slot) per request in order; slot -1: none."""
        if all(slot < 0 for _, slot in segments):
            self.context.batch = None
            return
        indptr = [0]
        for count, _ in segments:
            indptr.append(indptr[-1] + count)
        seg_indptr = torch.tensor(indptr, dtype=torch.int64, device=self.device)
        seg_slots = torch.tensor(
            [slot for _, slot in segments], dtype=torch.int64, device=self.device
        )
        # The torch path groups the rows by adapter once here, not in each layer's call.
        plan = None if self.device.type == "cuda" else lora_plan(seg_indptr, seg_slots, indptr[-1])
        self.context.batch = LoraBatch(seg_indptr, seg_slots, plan)

    def clear_batch(self) -> None:
        self.context.batch = None

    def buffer_bytes(self) -> int:
        return sum(
            buffer.numel() * buffer.element_size()
            for wrappers in self.layers.values()
            for wrapper in wrappers
            for buffer in wrapper.buffers(recurse=False)
        )
