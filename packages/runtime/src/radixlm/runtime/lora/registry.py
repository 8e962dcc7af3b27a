"""The engine core's adapter names: load, unload, and which requests still use an adapter.

Each load gets a fresh uid (`name#n`): the KV cache keys requests by it (`extra_key`) and the
slot table names it, so an adapter unloaded and loaded again under the same name never meets
KV or weights of the earlier one. Unloading removes the name at once (new requests naming it
are refused) and frees the weights once the last request that named it has ended. An adapter
given as tensors (a trainer's push) replaces one of the same name the same way.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

from radixlm.runtime.lora.adapter import (
    LoraAdapter,
    LoraAdapterError,
    adapter_from_tensors,
    load_adapter,
)
from radixlm.runtime.lora.manager import LoraManager
from radixlm.runtime.scheduler.adapters import AdapterSlots
from radixlm.sampling import InvalidRequest


class AdapterPeers(Protocol):
    """The other tensor-parallel ranks' adapter pools, for adapters given as tensors (they
    have no directory the ranks could read when a slot needs them)."""

    def add(self, uid: str, adapter: LoraAdapter) -> None:
        """Register `adapter` under `uid` on every other rank."""
        ...

    def remove(self, uid: str) -> None:
        """Forget `uid` on every other rank."""
        ...


class AdapterRegistry:
    """Adapter names -> (uid, directory), with the open requests of each uid."""

    def __init__(
        self, manager: LoraManager, slots: AdapterSlots, peers: AdapterPeers | None = None
    ) -> None:
        self.manager = manager
        self.slots = slots
        #: Under tensor parallelism: the other ranks, told of adapters given as tensors.
        self.peers = peers
        self._pushed: set[str] = set()
        self.names: dict[str, tuple[str, str]] = {}
        self.refs: Counter[str] = Counter()
        self._unloaded: set[str] = set()
        self._count = itertools.count(1)
        self.loads = 0
        self.unloads = 0

    def _check_name(self, name: str) -> None:
        if not name:
            raise LoraAdapterError("a LoRA adapter needs a non-empty name", field="lora_name")
        if name in self.names:
            raise LoraAdapterError(
                f"a LoRA adapter named {name!r} is already loaded (from "
                f"{self.names[name][1]}); unload it first or choose another name",
                field="lora_name",
            )

    def add(self, adapter: LoraAdapter) -> None:
        """Register an adapter already read (the start-up ones)."""
        self._check_name(adapter.name)
        uid = f"{adapter.name}#{next(self._count)}"
        self.manager.add(uid, adapter)
        self.names[adapter.name] = (uid, adapter.path)
        self.loads += 1

    def load(self, name: str, path: str) -> dict[str, str]:
        """Read, check and register an adapter; the loaded adapters after it."""
        self._check_name(name)
        self.add(load_adapter(name, path, self.manager.arch))
        return self.listing()

    def load_tensors(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any]
    ) -> dict[str, str]:
        """Check and register an adapter given as PEFT-named tensors and its PEFT config; an
        adapter already loaded under `name` is replaced for new requests (the ones using it
        finish on it, then it is freed), and nothing is cached across the two. The loaded
        adapters after it."""
        if not name:
            raise LoraAdapterError("a LoRA adapter needs a non-empty name", field="lora_name")
        adapter = adapter_from_tensors(name, tensors, config, self.manager.arch)
        self.manager.check(adapter)
        uid = f"{name}#{next(self._count)}"
        if self.peers is not None:
            self.peers.add(uid, adapter)
        # Only now, with the new one in place everywhere, does the earlier one go.
        if name in self.names:
            self._retire(self.names.pop(name)[0])
        self._pushed.add(uid)
        self.manager.add(uid, adapter)
        self.names[name] = (uid, adapter.path)
        self.loads += 1
        return self.listing()

    def unload(self, name: str) -> dict[str, str]:
        """Remove a name; its weights go once no request uses them. The adapters after it."""
        entry = self.names.pop(name, None)
        if entry is None:
            known = ", ".join(sorted(self.names)) or "none"
            raise LoraAdapterError(
                f"no LoRA adapter named {name!r} is loaded (loaded: {known})", field="lora_name"
            )
        self.unloads += 1
        self._retire(entry[0])
        return self.listing()

    def _retire(self, uid: str) -> None:
        """A uid no name leads to any more: dropped now, or once its last request ends."""
        if self.refs[uid] > 0:
            self._unloaded.add(uid)
        else:
            self._drop(uid)

    def resolve(self, name: str) -> tuple[str, str]:
        """(uid, directory) of a loaded adapter; InvalidRequest naming `lora_path` if none."""
        entry = self.names.get(name)
        if entry is None:
            known = ", ".join(sorted(self.names)) or "none"
            raise InvalidRequest(
                "lora_path",
                f"unknown LoRA adapter {name!r} (loaded: {known}); load it with "
                "POST /load_lora_adapter or name a loaded one",
            )
        return entry

    def open(self, uid: str) -> None:
        self.refs[uid] += 1

    def close(self, uid: str) -> None:
        self.refs[uid] -= 1
        if self.refs[uid] <= 0:
            del self.refs[uid]
            if uid in self._unloaded:
                self._drop(uid)

    def _drop(self, uid: str) -> None:
        self._unloaded.discard(uid)
        self.manager.remove(uid)
        self.slots.drop(uid)
        if uid in self._pushed:
            self._pushed.discard(uid)
            if self.peers is not None:
                self.peers.remove(uid)

    def listing(self) -> dict[str, str]:
        return {name: path for name, (_uid, path) in self.names.items()}

    def stats(self) -> dict[str, object]:
        return {
            "lora_adapters": self.listing(),
            "lora_slots": [entry[0] if entry else None for entry in self.slots.table],
            "lora_slot_swaps": self.manager.swaps,
            "lora_unloading": sorted(self._unloaded),
        }
