"""max_token_chars / check_text_fits: a text longer than context x the longest token cannot fit,
and is refused without tokenizing it; where no such bound holds, nothing is refused."""

from __future__ import annotations

import json
import sys
import unicodedata
from typing import Any

import pytest

from radixlm.sampling import InvalidRequest, check_text_fits, max_token_chars
from radixlm.sampling.limits import NFC_MAX_COMPOSED, UNBOUNDED

BYTE_LEVEL_BPE = {
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
    "model": {"type": "BPE", "unk_token": None, "fuse_unk": False, "byte_fallback": False},
    "added_tokens": [{"content": "<|im_start|>", "lstrip": False, "rstrip": False}],
}


class StubTokenizer:
    """What max_token_chars reads of a Hugging Face fast tokenizer: the vocabulary and the
    tokenizer.json of its backend."""

    def __init__(self, vocab: list[str], spec: dict[str, Any]) -> None:
        self.vocab = {piece: i for i, piece in enumerate(vocab)}
        self.backend_tokenizer = self
        self.spec = spec

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def to_str(self) -> str:
        return json.dumps(self.spec)


def stub(**changes: Any) -> StubTokenizer:
    return StubTokenizer(["a", "ĠĠĠĠĠĠ", "hello"], {**BYTE_LEVEL_BPE, **changes})


# check_text_fits


def test_a_text_longer_than_context_times_the_longest_token_is_refused() -> None:
    with pytest.raises(InvalidRequest) as raised:
        check_text_fits("x" * 1001, context_length=100, max_token_chars=10, field="text")
    assert raised.value.field == "text"
    message = raised.value.message
    assert "1,001 characters" in message and "1,000 characters" in message
    assert "100 tokens" in message and "shorten it" in message


def test_a_text_at_the_bound_passes() -> None:
    check_text_fits("x" * 1000, context_length=100, max_token_chars=10, field="text")


def test_a_length_may_stand_for_the_text() -> None:
    check_text_fits(1000, 100, 10, "messages")
    with pytest.raises(InvalidRequest, match="1,001 characters"):
        check_text_fits(1001, 100, 10, "messages")


def test_nothing_is_refused_without_a_bound() -> None:
    check_text_fits(10**12, 100, UNBOUNDED, "text")
    check_text_fits(10**12, 0, 10, "text")


# max_token_chars


def test_the_bound_is_the_longest_piece_added_tokens_included() -> None:
    assert max_token_chars(stub()) == len("<|im_start|>")
    assert max_token_chars(stub(added_tokens=[])) == 6


def test_composing_normalizers_multiply_the_bound() -> None:
    assert max_token_chars(stub(added_tokens=[], normalizer={"type": "NFC"})) == 6 * 4
    sequence = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}
    assert max_token_chars(stub(added_tokens=[], normalizer=sequence)) == 6 * 4


def test_sentencepiece_style_normalizers_keep_the_bound() -> None:
    normalizer = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    model = {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True}
    tokenizer = stub(added_tokens=[], normalizer=normalizer, pre_tokenizer=None, model=model)
    assert max_token_chars(tokenizer) == 6


def test_a_shortening_replace_multiplies_the_bound_by_its_ratio() -> None:
    replace = {"type": "Replace", "pattern": {"String": "    "}, "content": "\t"}
    assert max_token_chars(stub(added_tokens=[], normalizer=replace)) == 6 * 4


@pytest.mark.parametrize(
    "changes",
    [
        {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
        {"normalizer": {"type": "StripAccents"}},
        {"normalizer": {"type": "BertNormalizer", "clean_text": True}},
        {"normalizer": {"type": "Precompiled", "precompiled_charsmap": ""}},
        {"normalizer": {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}},
        {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}},
        {"pre_tokenizer": {"type": "WhitespaceSplit"}},
        {"pre_tokenizer": {"type": "BertPreTokenizer"}},
        {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}},
        {"model": {"type": "WordPiece", "unk_token": "[UNK]", "max_input_chars_per_word": 100}},
        {"model": {"type": "WordLevel", "unk_token": "[UNK]"}},
        {"model": {"type": "Unigram", "unk_id": 0, "byte_fallback": False}},
        {"model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": False}},
        {"added_tokens": [{"content": "<mask>", "lstrip": True, "rstrip": False}]},
    ],
    ids=lambda changes: json.dumps(changes)[:60],
)
def test_no_bound_where_a_text_can_shrink_without_limit(changes: dict[str, Any]) -> None:
    assert max_token_chars(stub(**changes)) == UNBOUNDED


def test_no_bound_for_tokenizers_whose_pipeline_cannot_be_read() -> None:
    class Slow:
        def get_vocab(self) -> dict[str, int]:
            return {"hello": 0}

    assert max_token_chars(None) == UNBOUNDED
    assert max_token_chars(Slow()) == UNBOUNDED
    assert max_token_chars(object()) == UNBOUNDED


def test_nfc_composes_at_most_nfc_max_composed_characters_into_one() -> None:
    most = 0
    for point in range(sys.maxunicode + 1):
        char = chr(point)
        if 0xD800 <= point < 0xE000 or unicodedata.normalize("NFC", char) != char:
            continue
        most = max(most, len(unicodedata.normalize("NFD", char)))
        if unicodedata.normalize("NFKC", char) == char:
            most = max(most, len(unicodedata.normalize("NFKD", char)))
    assert most == NFC_MAX_COMPOSED
