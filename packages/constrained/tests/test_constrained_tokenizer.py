"""TokenizerInfo: vocabularies decoded to bytes locally (byte-level BPE and SentencePiece)."""

from __future__ import annotations

from typing import Any

import pytest

from radixlm.constrained import TokenizerInfo

TEXTS = ["Hello, world!", '{"name":"Zoë","city":"東京"}', "tabs\tand\nnewlines 🙂 ", "  two spaces"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_spell_the_text(hf_tokenizer: Any, info: Any, text: str) -> None:
    token_ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert info.decode_bytes(token_ids) == text.encode("utf-8")


def test_byte_level_vocabulary_is_detected(info: Any) -> None:
    assert info.vocab_type == "byte_level"
    assert info.add_prefix_space is False


def test_special_tokens_and_padding_have_no_bytes(hf_tokenizer: Any, info: Any) -> None:
    assert info.vocab_size == 1024
    for special in hf_tokenizer.all_special_ids:
        assert info.token_bytes[special] is None
    assert all(info.token_bytes[i] is None for i in range(len(hf_tokenizer), 1024))


def test_stop_tokens_default_to_eos(hf_tokenizer: Any, info: Any) -> None:
    assert info.stop_token_ids == (hf_tokenizer.eos_token_id,)


def test_stop_tokens_can_be_given(hf_tokenizer: Any) -> None:
    custom = TokenizerInfo.from_hf(hf_tokenizer, stop_token_ids=[0, 1])
    assert custom.stop_token_ids == (0, 1)


def test_model_vocab_smaller_than_the_tokenizer_drops_the_rest(hf_tokenizer: Any) -> None:
    small = TokenizerInfo.from_hf(hf_tokenizer, vocab_size=500)
    assert small.vocab_size == 500 and len(small.token_bytes) == 500


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_tokens_spell_the_text_after_the_prefix_space(
    sp_tokenizer: Any, sp_info: Any, text: str
) -> None:
    token_ids = sp_tokenizer.encode(text, add_special_tokens=False)
    # Metaspace adds no second space to text that starts with one.
    spaced = text if text.startswith(" ") else " " + text
    assert sp_info.decode_bytes(token_ids) == spaced.encode("utf-8")


def test_sentencepiece_marks_and_byte_fallback_are_decoded(sp_tokenizer: Any, sp_info: Any) -> None:
    vocab = sp_tokenizer.get_vocab()
    assert sp_info.vocab_type == "byte_fallback"
    assert sp_info.add_prefix_space is True
    assert sp_info.token_bytes[vocab["<0x0A>"]] == b"\n"
    spaced = next(token for token in vocab if token.startswith("▁") and len(token) > 2)
    assert sp_info.token_bytes[vocab[spaced]] == spaced.replace("▁", " ").encode("utf-8")
    for special in ("<s>", "</s>", "<unk>"):
        assert sp_info.token_bytes[vocab[special]] is None


@pytest.mark.parametrize("text", ['"name":"', "abc", " def", "\n{", "東京"])
def test_encode_exact_spells_running_text_without_a_prefix_space(
    info: Any, sp_info: Any, text: str
) -> None:
    for tokenizer_info in (info, sp_info):
        token_ids = tokenizer_info.encode_exact(text)
        assert token_ids is not None
        assert tokenizer_info.decode_bytes(token_ids) == text.encode("utf-8")


def test_encode_exact_refuses_text_that_would_become_a_special_token(info: Any) -> None:
    # No exact ordinary tokenization: jump-forward then leaves this text to the model.
    assert info.encode_exact("a<|endoftext|>b") is None


def test_extensions_are_the_longer_tokens_with_that_prefix(info: Any) -> None:
    quote = info.encode_exact('"')[0]
    longer = info.extensions(quote)
    assert longer
    assert all(
        info.token_bytes[t].startswith(b'"') and len(info.token_bytes[t]) > 1 for t in longer
    )
    expected = {i for i, b in enumerate(info.token_bytes) if b and b.startswith(b'"') and b != b'"'}
    assert set(longer) == expected


def test_from_vocab_builds_a_synthetic_vocabulary() -> None:
    built = TokenizerInfo.from_vocab(["a", b"b", None, "ab"], stop_token_ids=[2], vocab_size=8)
    assert built.vocab_size == 8
    assert built.token_bytes[:4] == (b"a", b"b", None, b"ab")
    assert built.can_encode is False and built.encode_exact("ab") is None
    assert built.extensions(0) == [3]


def test_stop_token_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        TokenizerInfo.from_vocab(["a"], stop_token_ids=[5])


@pytest.mark.parametrize("prefix", [b"", b"a", b"ab", b"\xff", b"a\xff", b"\xff\xff", b"zz", b"b"])
def test_tokens_starting_with_are_exactly_those_with_the_prefix(prefix: bytes) -> None:
    vocab = [
        b"a",
        b"ab",
        b"abc",
        b"a\xff",
        b"a\xff\x00",
        b"b",
        b"\xff",
        b"\xff\xff",
        b"\xffa",
        b"ba",
    ]
    built = TokenizerInfo.from_vocab([*vocab, None], stop_token_ids=[len(vocab)])
    expected = {i for i, b in enumerate(vocab) if b.startswith(prefix)}
    assert set(built.tokens_starting_with(prefix)) == expected
