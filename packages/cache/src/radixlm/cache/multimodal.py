"""Pseudo-token ids that stand for non-text inputs (images, audio) in cache keys."""

from __future__ import annotations

import hashlib


def pseudo_token_ids(digest: bytes | str, num_tokens: int) -> list[int]:
    """The cache-key ids for a non-text input that fills `num_tokens` positions of a prompt.

    Convention: the runtime builds the cache key from the prompt's token ids and replaces the
    placeholder positions of each image (or other non-text input) with these ids, while the
    model itself still receives the real placeholder tokens and the embeddings. `digest` is a
    content hash of the input *and* of everything that changes its embeddings (processor
    settings, resolution), e.g. `hashlib.sha256(pixels + config).digest()`.

    The ids are negative, so they never collide with a vocabulary id, and they are derived
    from both the digest and `num_tokens`: the same input encoded to a different length gets
    different ids and shares no KV slot with the other encoding.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    raw = digest.encode() if isinstance(digest, str) else bytes(digest)
    mixed = hashlib.blake2b(raw + num_tokens.to_bytes(8, "little"), digest_size=8).digest()
    return [-1 - (int.from_bytes(mixed, "little") >> 1)] * num_tokens
