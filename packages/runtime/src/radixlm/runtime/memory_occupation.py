"""Giving a model runner's memory back and taking it again (SGLang's memory occupation tags).

A rollout engine sleeps while its trainer runs on the same device: the KV pool and the
weights give their memory back and are allocated again before the next rollout. Each tensor
keeps its shape, dtype and every view of it; only the storage under it is freed (resized to
nothing) and later allocated anew, filled with zeros. Whatever holds raw addresses into that
storage — the CPU decode path, captured CUDA graphs — is dropped on release and built again
once the memory is back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from radixlm.runtime.cuda_graph import CudaGraphRunner
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.models.decoder import DecoderForCausalLM
from radixlm.runtime.models.linear import PackedWeight
from radixlm.sampling import InvalidRequest

logger = logging.getLogger("radixlm.runtime.memory")

#: SGLang's tags: the model's parameters, the KV cache (the K/V pool and the request table),
#: the captured CUDA graphs (on CPUs a tag with nothing under it).
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


def memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags a release or a resume names, in `TAGS` order (None or empty: all of them);
    InvalidRequest naming `tags` for one it does not know."""
    if not tags:
        return TAGS
    unknown = [tag for tag in tags if tag not in TAGS]
    if unknown:
        raise InvalidRequest(
            "tags",
            f"unknown memory tag {unknown[0]!r}: use {', '.join(TAGS)} (or no tags for all)",
        )
    return tuple(tag for tag in TAGS if tag in tags)


class ReleasedStorages:
    """The storages under some tensors (each once, however many tensors view it): `free`
    resizes them to nothing, `allocate` gives them their size back, zero-filled. The tensors
    keep their shapes, dtypes, strides and offsets throughout; their addresses change."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        found: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in found:
                found[storage.data_ptr()] = (storage, storage.nbytes())
        self._storages = list(found.values())
        #: Bytes the storages hold when allocated.
        self.nbytes = sum(size for _storage, size in self._storages)

    def free(self) -> None:
        for storage, _size in self._storages:
            storage.resize_(0)

    def allocate(self) -> None:
        for storage, size in self._storages:
            storage.resize_(size)
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()


class MemoryOccupation:
    """What of one model runner's memory is given back now, and the weights that hold no
    value since they were allocated again. Used by the engine core between steps only."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._released: dict[str, ReleasedStorages | None] = {}
        #: Checkpoint names of the weights allocated again (zeros) and not written since.
        self.unwritten: set[str] = set()
        #: The batch sizes of the CUDA graphs dropped at a release (captured again at resume).
        self._graph_sizes: list[int] = []

    @property
    def released(self) -> tuple[str, ...]:
        return tuple(tag for tag in TAGS if tag in self._released)

    @property
    def ready(self) -> bool:
        """Whether a step may run: the weights and the KV pool are allocated and every weight
        holds a value. (Released CUDA graphs only make decode steps run without them.)"""
        released = self._released
        return WEIGHTS not in released and KV_CACHE not in released and not self.unwritten

    def refusal(self, tags: Sequence[str]) -> str | None:
        """Why this runner's memory of `tags` cannot be released (None: it can)."""
        runner = self.runner
        if runner.tp.enabled:
            return "releasing memory under tensor parallelism is not available yet"
        if WEIGHTS not in tags or WEIGHTS in self._released:
            return None
        if runner.info.quantization is not None:
            return (
                "releasing the weights of a quantized model is not available yet (they could "
                "not be updated afterwards): release kv_cache alone, or serve the model "
                "unquantized"
            )
        if any(p.packed is not None and not p.keep_plain for p in _packings(runner.model)):
            return (
                "the weights were packed for oneDNN at the first forward and their plain "
                "copies dropped, so they could not be updated after a resume: start the engine "
                "with cpu_weight_packing=False, or release kv_cache alone"
            )
        return None

    def update_refusal(self) -> str | None:
        """Why the weights cannot be updated now (None: they can)."""
        if WEIGHTS in self._released:
            return (
                "the weights are released (release_memory_occupation): call "
                "resume_memory_occupation(['weights']) first; nothing was changed"
            )
        return None

    def release(self, tags: Sequence[str]) -> int:
        """Free the memory of `tags` (those not released already); returns the bytes freed.
        The caller has flushed the radix cache before releasing kv_cache (the slots'
        contents are gone) and made sure no request holds a slot."""
        runner = self.runner
        freed = 0
        if runner.graph_runner is not None:  # the graphs point at every tag's memory
            self._graph_sizes = list(runner.graph_runner.buckets)
            runner.graph_runner = None
        if KV_CACHE in tags or WEIGHTS in tags:
            runner.cpu_decode = None  # (it holds their addresses)
        for tag in tags:
            if tag in self._released:
                continue
            storages = None
            if tag == KV_CACHE:
                pool = runner.kv_pool
                table = runner.req_to_token_pool.req_to_token
                storages = ReleasedStorages([*pool.k_buffers, *pool.v_buffers, table])
            elif tag == WEIGHTS:
                _unpanel(runner.model)  # the plain weights are what is released and written
                for packing in _packings(runner.model):
                    packing.packed = None  # a kept plain weight's copy: packed again later
                storages = ReleasedStorages(runner.model.parameters())
            if storages is not None:
                storages.free()
                freed += storages.nbytes
            self._released[tag] = storages
        _return_to_system(runner.device)
        logger.info("released %s (%d bytes)", ", ".join(tags), freed)
        return freed

    def resume(self, tags: Sequence[str]) -> int:
        """Allocate the memory of the released `tags` again: the KV pool and request table
        empty, the weights zeros until every one is written (`written`); returns the bytes
        allocated. Once nothing is released, the CPU decode path and the CUDA graphs are
        built again over the new addresses."""
        runner = self.runner
        resumed = [tag for tag in tags if tag in self._released]
        allocated = 0
        for tag in resumed:
            storages = self._released[tag]
            if storages is not None:
                storages.allocate()  # (if this fails the tag stays released: retry it)
                allocated += storages.nbytes
            del self._released[tag]
            if tag == WEIGHTS:
                self.unwritten = runner.checkpoint_names()
        if not resumed:
            return 0
        if KV_CACHE not in self._released and WEIGHTS not in self._released:
            runner.build_cpu_decode()
        if not self._released and self._graph_sizes:
            graphs = CudaGraphRunner(
                runner.model,
                runner.attention,  # type: ignore[arg-type]
                runner.kv_pool,
                runner.req_to_token_pool,
                self._graph_sizes,
            )
            graphs.capture()
            runner.graph_runner, self._graph_sizes = graphs, []
        logger.info("resumed %s (%d bytes)", ", ".join(resumed), allocated)
        return allocated

    def written(self, names: Iterable[str]) -> None:
        """Weights an update wrote (checkpoint names)."""
        self.unwritten.difference_update(names)

    def stats(self) -> dict[str, Any]:
        return {"memory_released": list(self.released), "weights_unwritten": len(self.unwritten)}


def _packings(model: torch.nn.Module) -> list[PackedWeight]:
    """The oneDNN packings of the model's linear layers and LM head."""
    found = []
    for module in model.modules():
        for name in ("packing", "head_packing"):
            packing = getattr(module, name, None)
            if isinstance(packing, PackedWeight):
                found.append(packing)
    return found


def _unpanel(model: torch.nn.Module) -> None:
    """Bring back the plain weights that the CPU decode path holds in panels, dropping the
    panels (the path lays them out again when it is built after a resume)."""
    for module in model.modules():
        packing = getattr(module, "packing", None)
        if isinstance(packing, PackedWeight) and isinstance(module.weight, torch.Tensor):
            packing.unpack_for_load(module.weight)
        head_packing = getattr(module, "head_packing", None)
        if isinstance(head_packing, PackedWeight) and isinstance(module, DecoderForCausalLM):
            head_packing.unpack_for_load(module.head.weight)


def _return_to_system(device: torch.device) -> None:
    """Hand freed memory back to the system: CUDA's caching allocator keeps it otherwise, and
    glibc's heap keeps blocks it took below its (growing) mmap threshold."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "cpu":
        trim = getattr(_libc(), "malloc_trim", None)
        if trim is not None:
            trim(0)


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
