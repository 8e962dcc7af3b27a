"""radixlm.cache: RadixAttention's radix tree over token ids and the KV slot allocator."""

from radixlm.cache._node import RadixNode
from radixlm.cache._version import __version__
from radixlm.cache.allocator import InvalidSlotError, TokenSlotAllocator
from radixlm.cache.multimodal import pseudo_token_ids
from radixlm.cache.radix_cache import (
    CacheStats,
    EvictionPolicy,
    InsertResult,
    MatchResult,
    RadixCache,
)

__all__ = [
    "CacheStats",
    "EvictionPolicy",
    "InsertResult",
    "InvalidSlotError",
    "MatchResult",
    "RadixCache",
    "RadixNode",
    "TokenSlotAllocator",
    "__version__",
    "pseudo_token_ids",
]
