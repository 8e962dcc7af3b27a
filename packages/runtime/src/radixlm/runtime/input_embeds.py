"""Prompts given as embeddings (`input_embeds`): validation and their radix-cache key."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from radixlm.cache import pseudo_token_ids
from radixlm.sampling import InvalidRequest

# Tells embeddings rows apart from other inputs hashed into pseudo ids (images, audio).
_DOMAIN = b"radixlm.input_embeds.v1"


def parse_input_embeds(rows: Sequence[Sequence[float]], hidden_size: int) -> torch.Tensor:
    """The prompt's embeddings as a float32 CPU tensor [seq, hidden]; raises InvalidRequest
    (naming `input_embeds`) unless they are a non-empty [seq, hidden_size] list of finite
    numbers."""
    if not rows:
        raise InvalidRequest("input_embeds", "the prompt is empty; give at least one row")
    try:
        embeds = torch.tensor(rows, dtype=torch.float32)
    except (TypeError, ValueError):
        raise InvalidRequest(
            "input_embeds", "must be a list of rows of numbers, all of the same length"
        ) from None
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        got = "x".join(str(d) for d in embeds.shape)
        raise InvalidRequest(
            "input_embeds",
            f"has shape [{got}] but this model takes [seq, {hidden_size}] (one row of "
            f"{hidden_size} numbers per prompt position)",
        )
    if not bool(torch.isfinite(embeds).all()):
        raise InvalidRequest("input_embeds", "holds a NaN or infinite value")
    return embeds


def input_embeds_cache_ids(embeds: torch.Tensor) -> list[int]:
    """One cache-key id per embeddings row: a pseudo id (negative, so never a vocabulary id)
    derived from a hash of the row's float32 bytes.

    The radix tree compares whole prefixes, so two prompts share the KV of their first k
    positions exactly when their first k rows are equal, the KV of a position depending only
    on the rows up to it; an embeddings prompt never shares a slot with a token prompt."""
    ids: list[int] = []
    data = embeds.to(torch.float32).contiguous().numpy()
    for row in data:
        digest = hashlib.blake2b(_DOMAIN + row.tobytes(), digest_size=16).digest()
        ids.extend(pseudo_token_ids(digest, 1))
    return ids
