"""radixlm.cache: RadixAttention's radix tree over token ids, the KV slot allocator, and the
page index of the tiers below the pool (a hierarchical cache)."""

from radixlm.cache._node import RadixNode
from radixlm.cache._version import __version__
from radixlm.cache.allocator import InvalidSlotError, TokenSlotAllocator
from radixlm.cache.multimodal import pseudo_token_ids
from radixlm.cache.radix_cache import (
    CacheStats,
    Demoted,
    EvictionPolicy,
    InsertResult,
    MatchResult,
    RadixCache,
)
from radixlm.cache.tiers import PageIndex, TierStats, namespace_hash, page_hashes

__all__ = [
    "CacheStats",
    "Demoted",
    "EvictionPolicy",
    "InsertResult",
    "InvalidSlotError",
    "MatchResult",
    "PageIndex",
    "RadixCache",
    "RadixNode",
    "TierStats",
    "TokenSlotAllocator",
    "__version__",
    "namespace_hash",
    "page_hashes",
    "pseudo_token_ids",
]
