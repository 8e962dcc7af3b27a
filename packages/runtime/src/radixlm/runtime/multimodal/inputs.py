"""A prompt's images and videos as the engine core and the runner see them: plain, picklable data.

The front end (`MultimodalPreparer`) decodes each item, runs the model's processor and expands
its placeholder token into as many positions as the encoder yields embeddings. The prompt ids
the scheduler holds carry, at those positions, pseudo ids derived from the item's content hash
(`radixlm.cache.pseudo_token_ids`): they are the radix-cache key, so the same image in a later
request matches the cache through its positions and beyond, and two different images never
match past their first position. The runner never looks those ids up: it computes the item's
embeddings (or takes them from the encoder cache) and puts them in those rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from radixlm.cache import pseudo_token_ids

MediaKind = Literal["image", "video"]


@dataclass(frozen=True)
class MediaItem:
    """One image (or video) of a prompt: where its embeddings go and what makes them.

    - `offset`, `length`: its positions in the prompt (`length` embedding rows).
    - `digest`: a content hash of the decoded pixels and the processing that shapes its
      embeddings; the encoder cache and the radix-cache key use it.
    - `pixel_values`: the processor's tensor for this item (float32, CPU).
    - `extra`: other processor outputs the encoder reads (e.g. Qwen2-VL's `grid_thw`).
    - `embeddings`: precomputed embeddings [length, hidden] (SGLang's `precomputed_embedding`
      format); the encoder is then skipped.
    """

    kind: MediaKind
    offset: int
    length: int
    digest: bytes
    pixel_values: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    embeddings: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def cache_ids(self) -> list[int]:
        """The pseudo ids that stand for this item in cache keys (negative: never a token)."""
        return pseudo_token_ids(self.kind.encode() + self.digest, self.length)


@dataclass(frozen=True)
class MultimodalInputs:
    """The media of one prompt, in prompt order, and (for M-RoPE models) the prompt's
    three-axis positions [3, prompt_len] with the offset later positions take (`mrope_delta`:
    position p >= prompt_len has position p + delta on every axis)."""

    items: tuple[MediaItem, ...]
    mrope_positions: Any = None
    mrope_delta: int = 0

    def cache_key(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt ids with every item's positions replaced by its pseudo ids."""
        key = list(prompt_ids)
        for item in self.items:
            key[item.offset : item.end] = item.cache_ids
        return key

    def spans(self, start: int, count: int) -> list[MediaSpan]:
        """The parts of the items that fall in prompt positions [start, start + count)."""
        found: list[MediaSpan] = []
        end = start + count
        for item in self.items:
            first = max(start, item.offset)
            last = min(end, item.end)
            if first < last:
                found.append(MediaSpan(item, first - start, first - item.offset, last - first))
        return found


@dataclass(frozen=True)
class MediaSpan:
    """Rows `[row, row + count)` of an entry's new tokens take rows `[first, first + count)`
    of `item`'s embeddings."""

    item: MediaItem
    row: int
    first: int
    count: int
