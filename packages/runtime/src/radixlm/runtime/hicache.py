"""The hierarchical cache's tiers under the KV pool: host memory (L2) and storage (L3).

The radix tree (`radixlm.cache.RadixCache`) keeps what is in the KV pool (L1). With
`enable_hierarchical_cache`, what it evicts is copied to a host pool first (write-back), or
already was when it was cached (write-through); a prompt whose prefix goes on past the tree's
match into pages the host pool or the storage holds gets them copied back into fresh KV slots
and inserted into the tree, instead of being computed again. Pages are `hicache_page_size`
tokens, named by their prefix hash (`radixlm.cache.page_hashes`: the model's fingerprint and
the request's namespace start the chain), so a storage page file means the same K/V to every
process that serves the same model.

`HierarchicalCache` owns the host pool (`[layers, pages x page_size, kv_heads, head_dim]` for
K and for V, in the KV pool's dtype or a smaller one; pinned on CUDA) and the storage backend
(`FileStorage`: one file per page); `radixlm.cache.PageIndex` keeps the host pool's
bookkeeping. The scheduler calls it (see `radixlm.runtime.scheduler.Tiers`) on the one
thread that runs steps, so a copy never races a forward. Copies are synchronous (a step
waits for a promotion's bytes; on CUDA they are one gather per layer).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm.cache import Demoted, PageIndex, namespace_hash, page_hashes
from radixlm.runtime.config import CacheConfig
from radixlm.runtime.memory import KVPool

logger = logging.getLogger("radixlm.runtime.hicache")

_HOST_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
#: Most bytes of storage pages read ahead and not yet taken (older ones are dropped).
_READ_AHEAD_BYTES = 1 << 30


class FileStorage:
    """L3 on a file system: one file per page, `root/<first two hex digits>/<hash hex>`,
    written whole to a temporary name and renamed (a reader never sees half a page; replicas
    writing the same page write the same bytes). A file of the wrong size (another model's
    layout, a torn copy) reads as a miss."""

    def __init__(self, root: str | os.PathLike[str], page_bytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.page_bytes = page_bytes
        self.reads = self.writes = 0

    def _path(self, page: bytes) -> Path:
        name = page.hex()
        return self.root / name[:2] / name

    def exists(self, page: bytes) -> bool:
        path = self._path(page)
        try:
            return path.stat().st_size == self.page_bytes
        except OSError:
            return False

    def read(self, page: bytes) -> bytes | None:
        try:
            data = self._path(page).read_bytes()
        except OSError:
            return None
        if len(data) != self.page_bytes:
            return None
        self.reads += 1
        return data

    def write(self, page: bytes, data: bytes) -> None:
        if len(data) != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes; got {len(data)}")
        path = self._path(page)
        if self.exists(page):
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as out:
            out.write(data)
            temporary = out.name
        os.replace(temporary, path)
        self.writes += 1


@dataclass
class Found:
    """What the tiers hold past a tree match (see `HierarchicalCache.find`): the pages
    `hashes` from `first_page` on, of which the host pool holds the leading ones (in
    `host_slots`) and the storage the rest; tokens `start` .. `end` are the ones to bring
    back (the first page may begin before `start`, in the tree's part)."""

    start: int
    end: int
    first_page: int
    page_size: int
    hashes: list[bytes]
    host_slots: list[int]

    @property
    def host_tokens(self) -> int:
        """Of `start` .. `end`, the tokens in host pages."""
        host_end = (self.first_page + len(self.host_slots)) * self.page_size
        return max(0, min(self.end, host_end) - self.start)

    @property
    def storage_pages(self) -> list[bytes]:
        return self.hashes[len(self.host_slots) : (self.end // self.page_size) - self.first_page]


class HierarchicalCache:
    """The host pool (L2) and storage (L3) under `pool` (see the module)."""

    def __init__(self, config: CacheConfig, pool: KVPool, fingerprint: str) -> None:
        size = config.hicache_page_size
        if size % pool.page_size:
            raise ValueError(
                f"hicache_page_size ({size}) must be a multiple of the KV pool's page size "
                f"({pool.page_size})"
            )
        self.pool = pool
        self.page_size = size
        self.write_policy = config.hicache_write_policy
        self.dtype = _HOST_DTYPES.get(config.hicache_host_dtype, pool.dtype)
        token_bytes = 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * self.dtype.itemsize
        self.page_bytes = size * token_bytes
        if config.hicache_size > 0:
            pages = int(config.hicache_size * 1e9) // self.page_bytes
        else:
            pages = int(config.hicache_ratio * pool.num_slots) // size
        if pages < 1:
            raise ValueError(
                f"the host pool holds no page of {size} tokens ({self.page_bytes} bytes): "
                "raise hicache_size / hicache_ratio"
            )
        pin = pool.device.type == "cuda"
        shape = (pool.num_layers, pages * size, pool.num_kv_heads, pool.head_dim)
        self.host_k = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.host_v = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.index = PageIndex(pages)
        self.storage: FileStorage | None = None
        if config.hicache_storage_backend == "file":
            assert config.hicache_storage_dir is not None
            self.storage = FileStorage(config.hicache_storage_dir, self.page_bytes)
        self._fingerprint = fingerprint
        self._starts: dict[Hashable, bytes] = {}
        # Storage pages read ahead for requests that wait (a thread reads the files; the
        # scheduler's thread takes the bytes), at most `_READ_AHEAD_BYTES` of them.
        self._read_ahead: OrderedDict[bytes, bytes] = OrderedDict()
        self._read_ahead_lock = threading.Lock()
        self._reader: ThreadPoolExecutor | None = None
        self.prefetched_pages = 0
        # Counters (cumulative).
        self.host_hit_tokens = 0
        self.storage_hit_tokens = 0
        self.demoted_pages = 0
        self.written_through_pages = 0
        self.stored_pages = 0  # pages written to storage
        logger.info(
            "hierarchical cache: %d host pages of %d tokens (%.2f GB, %s)%s",
            pages,
            size,
            pages * self.page_bytes / 1e9,
            self.dtype,
            f", storage {config.hicache_storage_dir}" if self.storage else "",
        )

    # ------------------------------------------------------------------------------ naming

    def _start(self, extra_key: Hashable | None) -> bytes:
        start = self._starts.get(extra_key)
        if start is None:
            start = namespace_hash(self._fingerprint, extra_key)
            self._starts[extra_key] = start
        return start

    def _hashes(
        self, tokens: Sequence[int], extra_key: Hashable | None, first: int, count: int | None
    ) -> list[bytes]:
        return page_hashes(tokens, self.page_size, self._start(extra_key), first, count)

    # -------------------------------------------------------------------------- copies down

    def demote(self, leaf: Demoted) -> None:
        """The tree evicts `leaf`: copy the pages it completes that the host pool lacks
        (their earlier tokens may sit in the leaf's ancestors: their slots are given)."""
        size = self.page_size
        first, last = leaf.start // size, len(leaf.tokens) // size
        if last <= first:
            return
        hashes = self._hashes(leaf.tokens, leaf.namespace, first, last - first)
        self.demoted_pages += self._copy_down(hashes, first, leaf.slots)

    def cached(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        extra_key: Hashable | None,
        start: int,
        reused: bool,
    ) -> None:
        """The tree now holds `tokens` (in `slots`), new from token `start` on, for a request
        that found a cached prefix or not (`reused`): under write-through (selective: only
        when reused), copy the pages that completes down now."""
        policy = self.write_policy
        if policy == "write_back" or (policy == "write_through_selective" and not reused):
            return
        size = self.page_size
        first, last = start // size, len(tokens) // size
        if last <= first:
            return
        hashes = self._hashes(tokens, extra_key, first, last - first)
        self.written_through_pages += self._copy_down(hashes, first, slots)

    def _copy_down(self, hashes: list[bytes], first: int, slots: Sequence[int]) -> int:
        """Pages `first` .. of a sequence whose tokens are in `slots`, into the host pool
        (those it does not hold yet; what they push out goes to storage first under
        write-back) and, but under write-back, to storage. Returns the pages copied."""
        size = self.page_size
        device: list[int] = []
        host: list[int] = []
        new: list[tuple[bytes, int]] = []
        for offset, page in enumerate(hashes):
            if page in self.index:
                continue
            stored = self.index.store(page)
            if stored is None:
                break  # every host page is pinned: nothing more goes down now
            slot, pushed = stored
            self.index.pin(page)  # not pushed out by this copy's later pages
            if pushed is not None:
                self._pushed_out(pushed, slot)
            begin = (first + offset) * size
            device += slots[begin : begin + size]
            host += range(slot * size, (slot + 1) * size)
            new.append((page, slot))
        if device:
            self._gather_to_host(device, host)
        for page, slot in new:
            self.index.unpin(page)
            if self.storage is not None and self.write_policy != "write_back":
                self._to_storage(page, slot)
        return len(new)

    def _pushed_out(self, page: bytes, slot: int) -> None:
        """`page` leaves the host pool (its slot is reused now): under write-back, storage
        gets it first (under the other policies it has it already)."""
        if self.storage is not None and self.write_policy == "write_back":
            self._to_storage(page, slot)

    def _gather_to_host(self, device: list[int], host: list[int]) -> None:
        pool = self.pool
        source = torch.tensor(device, dtype=torch.int64, device=pool.device)
        target = torch.tensor(host, dtype=torch.int64)
        for layer in range(pool.num_layers):
            for buffers, into in ((pool.k_buffers, self.host_k), (pool.v_buffers, self.host_v)):
                rows = buffers[layer].index_select(0, source).to(self.dtype)
                into[layer].index_copy_(0, target, rows.to("cpu"))

    def _page_bytes(self, slot: int) -> bytes:
        size = self.page_size
        part = slice(slot * size, (slot + 1) * size)
        both = torch.stack((self.host_k[:, part], self.host_v[:, part]))
        return both.contiguous().view(torch.uint8).numpy().tobytes()

    def _to_storage(self, page: bytes, slot: int) -> None:
        assert self.storage is not None
        if not self.storage.exists(page):
            self.storage.write(page, self._page_bytes(slot))
            self.stored_pages += 1

    # ------------------------------------------------------------------------- read-ahead

    def prefetch(self, tokens: Sequence[int], extra_key: Hashable | None) -> None:
        """A request for `tokens` arrived: read, on a thread of its own, the storage pages of
        its prompt that the host pool lacks, so that its admission copies them from memory."""
        if self.storage is None:
            return
        hashes = self._hashes(tokens, extra_key, 0, None)
        with self._read_ahead_lock:
            wanted = [h for h in hashes if h not in self.index and h not in self._read_ahead]
        if not wanted:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="radixlm-hicache-read")
        self._reader.submit(self._read_pages, wanted)

    def _read_pages(self, pages: list[bytes]) -> None:
        assert self.storage is not None
        limit = max(1, _READ_AHEAD_BYTES // self.page_bytes)
        for page in pages[:limit]:
            if page in self.index:
                continue  # taken from storage at admission already (the scheduler was first)
            data = self.storage.read(page)
            if data is None:
                return  # the prompt's run in storage ends here
            with self._read_ahead_lock:
                self._read_ahead[page] = data
                self.prefetched_pages += 1
                while len(self._read_ahead) > limit:
                    self._read_ahead.popitem(last=False)

    def _storage_has(self, page: bytes) -> bool:
        assert self.storage is not None
        with self._read_ahead_lock:
            if page in self._read_ahead:
                return True
        return self.storage.exists(page)

    def _storage_read(self, page: bytes) -> bytes | None:
        assert self.storage is not None
        with self._read_ahead_lock:
            data = self._read_ahead.pop(page, None)
        return data if data is not None else self.storage.read(page)

    def close(self) -> None:
        """Stop the read-ahead thread (pages being read are dropped)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None

    # ---------------------------------------------------------------------------- copies up

    def find(
        self, tokens: Sequence[int], matched: int, limit: int, extra_key: Hashable | None
    ) -> Found | None:
        """What the lower tiers hold of `tokens` past the tree's `matched` tokens, up to
        `limit` (page-aligned by the caller): the pages from the one `matched` falls in, the
        host pool's run first, then the storage's. None when they hold none of it. The host
        pages found stay pinned until `load` or `drop`."""
        size = self.page_size
        first = matched // size
        last = limit // size
        if last <= first:
            return None
        hashes = self._hashes(tokens, extra_key, first, last - first)
        host = self.index.match(hashes)
        storage: list[bytes] = []
        if self.storage is not None:
            for page in hashes[len(host) :]:
                if not self._storage_has(page):
                    break
                storage.append(page)
        end = (first + len(host) + len(storage)) * size
        if end <= matched:
            return None
        for page in hashes[: len(host)]:
            self.index.pin(page)  # until `load` or `drop`: room made for them demotes others
        return Found(matched, end, first, size, hashes, host)

    def drop(self, found: Found) -> None:
        """`found` will not be loaded: its host pages may leave again."""
        for page in found.hashes[: len(found.host_slots)]:
            self.index.unpin(page)

    def load(self, found: Found, slots: Sequence[int]) -> int:
        """Copy tokens `found.start` .. `found.end` into `slots` (fresh KV slots, in order):
        the host pool's pages, then the storage's (read into host pages of their own, so that
        later hits find them there). Returns how many were copied: all, or fewer (whole KV
        pages) when a storage page went missing since `find`."""
        size = self.page_size
        index = self.index
        pinned = found.hashes[: len(found.host_slots)]  # by `find`
        host_rows: list[int] = []
        for slot in found.host_slots:
            host_rows += range(slot * size, (slot + 1) * size)
        try:
            for page in found.storage_pages:
                data = self._storage_read(page) if self.storage is not None else None
                stored = index.store(page) if data is not None else None
                if data is None or stored is None:
                    break  # gone since `find` (or no host page free): computed instead
                slot, pushed = stored
                index.pin(page)
                pinned.append(page)
                if pushed is not None:
                    self._pushed_out(pushed, slot)
                both = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype)
                both = both.view(2, self.pool.num_layers, size, self.pool.num_kv_heads, -1)
                part = slice(slot * size, (slot + 1) * size)
                self.host_k[:, part] = both[0]
                self.host_v[:, part] = both[1]
                host_rows += range(slot * size, (slot + 1) * size)
            skip = found.start - found.first_page * size  # the first page's part in the tree
            rows = host_rows[skip : skip + len(slots)]
            pool = self.pool
            rows = rows[: len(rows) - len(rows) % pool.page_size]
            if not rows:
                return 0
            source = torch.tensor(rows, dtype=torch.int64)
            target = torch.tensor(list(slots[: len(rows)]), dtype=torch.int64, device=pool.device)
            for layer in range(pool.num_layers):
                for buffers, out in ((pool.k_buffers, self.host_k), (pool.v_buffers, self.host_v)):
                    values = out[layer].index_select(0, source)
                    buffers[layer].index_copy_(0, target, values.to(pool.device).to(pool.dtype))
        finally:
            for page in pinned:
                index.unpin(page)
        host = min(len(rows), found.host_tokens)
        self.host_hit_tokens += host
        self.storage_hit_tokens += len(rows) - host
        return len(rows)

    # ------------------------------------------------------------------------------- whole

    def clear(self) -> None:
        """Forget the host pool's pages (the storage keeps its files)."""
        self.index.clear()
        with self._read_ahead_lock:
            self._read_ahead.clear()

    def check_invariants(self) -> None:
        self.index.check_invariants()

    def stats(self) -> dict[str, Any]:
        index = self.index
        return {
            "hicache_host_hit_tokens": self.host_hit_tokens,
            "hicache_storage_hit_tokens": self.storage_hit_tokens,
            "hicache_host_pages": len(index),
            "hicache_host_capacity_pages": index.capacity,
            "hicache_demoted_pages": self.demoted_pages,
            "hicache_written_through_pages": self.written_through_pages,
            "hicache_storage_written_pages": self.stored_pages,
            "hicache_storage_read_pages": self.storage.reads if self.storage else 0,
            "hicache_prefetched_pages": self.prefetched_pages,
        }
