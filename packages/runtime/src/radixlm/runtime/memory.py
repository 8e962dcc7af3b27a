"""The KV pool (per-layer K/V slot tensors) and the request-to-token slot table."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm import kernels
from radixlm.cache import TokenSlotAllocator
from radixlm.runtime.config import MemoryConfig

_CPU_DEFAULT_KV_BYTES = 1 << 30


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVPool:
    """K and V of every cached token, per layer, in tensors `[num_slots + 1, kv_heads, head_dim]`.

    Slot ids `0 .. num_slots - 1` are handed out by a `radixlm.cache.TokenSlotAllocator`
    (`alloc` / `free` pass through to it); the extra last row, `padding_slot`, is never handed
    out and absorbs the writes of padded (CUDA-graph) batch rows. With `page_size > 1`,
    `alloc_pages` hands out whole pages: runs of `page_size` consecutive slots starting at a
    multiple of `page_size`.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {page_size}")
        num_slots -= num_slots % page_size
        if num_slots < 1:
            raise ValueError("the KV pool needs at least one page of slots")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_size = page_size
        self.padding_slot = num_slots
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [self._zeros(shape) for _ in range(num_layers)]
        self.v_buffers = [self._zeros(shape) for _ in range(num_layers)]
        # With pages, the allocator hands out page ids; slots are page * page_size + offset.
        self.allocator = TokenSlotAllocator(num_slots // page_size)

    def _zeros(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """One layer's K or V buffer; on the CPU on huge pages (attention streams a long
        context's keys and values from memory, as a decode step does its weights)."""
        if self.device.type == "cpu":
            return kernels.cpu.zeros_on_huge_pages(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * (self.num_slots + 1)

    @property
    def available(self) -> int:
        """Free token slots."""
        return self.allocator.available * self.page_size

    def alloc(self, n: int) -> list[int] | None:
        """`n` free token slots (page_size 1 only), or None if fewer are free. Mutates the pool."""
        if self.page_size != 1:
            raise RuntimeError("this pool is paged: use alloc_pages")
        return self.allocator.alloc(n)

    def free(self, slots: Sequence[int]) -> None:
        """Give token slots back (page_size 1), or whole pages' slots (any page size)."""
        if self.page_size == 1:
            self.allocator.free(list(slots))
            return
        if len(slots) % self.page_size:
            raise ValueError("a paged pool frees whole pages only")
        self.allocator.free([s // self.page_size for s in slots[:: self.page_size]])

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """The token slots of `num_pages` free pages (page-aligned runs), or None."""
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            return None
        size = self.page_size
        if size == 1:
            return pages
        return [page * size + offset for page in pages for offset in range(size)]

    def reset(self) -> None:
        """Take every slot back (the tensors keep their contents)."""
        self.allocator.reset()

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of new tokens [T, kv_heads, head_dim] at `slots` [T] (mutates the pool)."""
        if self.dtype in _FP8:
            # float8 has no infinity: out-of-range values would turn into NaN, so saturate.
            limit = torch.finfo(self.dtype).max
            k, v = k.clamp(-limit, limit), v.clamp(-limit, limit)
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)


class ReqToTokenPool:
    """Rows of token slots, one row per running request: `req_to_token[row, i]` is the slot of
    the request's token i. The extra last row is a padding row for CUDA-graph batches."""

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str):
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (max_requests + 1, max_context_len), dtype=torch.int32, device=self.device
        )
        self.padding_row = max_requests
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when `max_requests` rows are in use. Mutates the pool."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Give a row back (its contents are left as they are)."""
        if not 0 <= row < self.max_requests or row in self._free_rows:
            raise ValueError(f"row {row} is not in use")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: Sequence[int]) -> None:
        """Set slots of tokens `start .. start + len(slots) - 1` of a row (e.g. a cached prefix)."""
        if start + len(slots) > self.max_context_len:
            raise ValueError(
                f"{start + len(slots)} tokens exceed the context length {self.max_context_len}"
            )
        if slots:
            values = torch.tensor(list(slots), dtype=torch.int32)
            self.req_to_token[row, start : start + len(slots)] = values.to(self.device)

    def read(self, row: int, length: int) -> list[int]:
        """The first `length` slots of a row (a device-to-host copy)."""
        return [int(s) for s in self.req_to_token[row, :length].tolist()]

    def reset(self) -> None:
        self._free_rows = list(range(self.max_requests - 1, -1, -1))


def kv_pool_capacity(
    bytes_per_token: int, device: torch.device, memory: MemoryConfig
) -> tuple[int, int]:
    """(token slots, budget bytes) the pool may take under `memory` on `device`.

    On CUDA the budget is `kv_cache_fraction` of the memory currently free (call it after the
    weights are loaded) unless `kv_cache_bytes` is set; on CPU it is `kv_cache_bytes` (1 GiB by
    default). `max_total_tokens` caps the result. Raises MemoryError if not one page fits.
    """
    if memory.kv_cache_bytes is not None:
        budget = memory.kv_cache_bytes
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * memory.kv_cache_fraction)
    else:
        budget = _CPU_DEFAULT_KV_BYTES
    tokens = budget // bytes_per_token
    if memory.max_total_tokens is not None:
        tokens = min(tokens, memory.max_total_tokens)
    tokens -= tokens % memory.page_size
    if tokens < memory.page_size:
        raise MemoryError(
            f"the KV budget of {budget} bytes holds no page of {memory.page_size} tokens "
            f"({bytes_per_token} bytes per token); raise kv_cache_bytes / kv_cache_fraction"
        )
    return tokens, budget
