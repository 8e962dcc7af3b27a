"""Vision-encoder outputs kept by content hash (LRU), so a repeated image is encoded once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixlm.runtime.multimodal.inputs import MediaItem

Encode = Callable[[Sequence[MediaItem]], list[torch.Tensor]]


@dataclass
class EncoderStats:
    """Counters (mutated by every lookup): items run through the encoder, items found here."""

    encoded: int = 0
    hits: int = 0


class EncoderCache:
    """Embeddings [length, hidden] by (kind, digest, length); at most `capacity` entries.

    The radix cache keeps an image's KV while it is cached; this keeps its embeddings for when
    that KV was evicted, or when a prompt reuses the image after different text."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, bytes, int], torch.Tensor] = OrderedDict()
        self.stats = EncoderStats()

    def __len__(self) -> int:
        return len(self._entries)

    def embeddings(self, items: Sequence[MediaItem], encode: Encode) -> list[torch.Tensor]:
        """Each item's embeddings: given ones, cached ones, and the rest encoded in one call
        (which are then cached). Raises ValueError when the encoder's output does not have
        the item's length."""
        found: list[torch.Tensor | None] = []
        missing: list[int] = []
        for index, item in enumerate(items):
            if item.embeddings is not None:
                found.append(item.embeddings)
                continue
            key: tuple[str, bytes, int] = (item.kind, item.digest, item.length)
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
            else:
                missing.append(index)
            found.append(cached)
        # One encoder call per distinct item (a prompt may repeat an image).
        distinct: dict[tuple[str, bytes, int], int] = {}
        for index in missing:
            item = items[index]
            distinct.setdefault((item.kind, item.digest, item.length), index)
        if distinct:
            fresh = encode([items[i] for i in distinct.values()])
            self.stats.encoded += len(distinct)
            by_key = dict(zip(distinct, fresh, strict=True))
            for key, value in by_key.items():
                if value.shape[0] != key[2]:
                    raise ValueError(
                        f"the encoder gave {value.shape[0]} embeddings for a {key[0]} that "
                        f"takes {key[2]} positions"
                    )
                self._put(key, value)
            for index in missing:
                item = items[index]
                found[index] = by_key[(item.kind, item.digest, item.length)]
        return [f for f in found if f is not None]

    def _put(self, key: tuple[str, bytes, int], value: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
