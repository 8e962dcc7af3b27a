"""The pseudo-token convention for images and other non-text inputs in cache keys."""

from __future__ import annotations

import hashlib

import pytest

from radixlm.cache import RadixCache, pseudo_token_ids


def test_pseudo_tokens_are_negative_and_fill_the_requested_length() -> None:
    ids = pseudo_token_ids(b"image-a", 5)
    assert len(ids) == 5
    assert all(i < 0 for i in ids)


def test_the_same_input_gives_the_same_pseudo_tokens() -> None:
    digest = hashlib.sha256(b"pixels").digest()
    assert pseudo_token_ids(digest, 4) == pseudo_token_ids(digest, 4)
    assert pseudo_token_ids("abc", 2) == pseudo_token_ids(b"abc", 2)


def test_different_inputs_give_different_pseudo_tokens() -> None:
    assert pseudo_token_ids(b"image-a", 3)[0] != pseudo_token_ids(b"image-b", 3)[0]


def test_the_same_input_at_another_length_gives_different_pseudo_tokens() -> None:
    assert pseudo_token_ids(b"image-a", 3)[0] != pseudo_token_ids(b"image-a", 4)[0]


def test_prompts_with_different_images_share_only_the_text_before_them() -> None:
    cache = RadixCache()
    text = [101, 102, 103]
    first = [*text, *pseudo_token_ids(b"cat.png", 4), 7]
    second = [*text, *pseudo_token_ids(b"dog.png", 4), 7]
    cache.insert(first, list(range(8)))
    assert cache.match_prefix(second).length == 3
    assert cache.match_prefix(first).length == 8


def test_a_negative_length_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        pseudo_token_ids(b"x", -1)
