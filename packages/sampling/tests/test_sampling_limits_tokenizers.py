"""max_token_chars against real tokenizers (byte-level BPE, with and without NFC, and
sentencepiece's layout): no text needs fewer tokens than its length over the bound."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.sampling import max_token_chars

pytest.importorskip("tokenizers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "def f(x):\n    return x  # comment\n" * 20,
    "naïve café façade résumé " * 20,
    "日本語のテキストと絵文字 🙂🚀 " * 20,
    " " * 64 + "=" * 64 + "-" * 64,
]
# Characters and the sequences NFC composes (alpha, psili, varia, ypogegrammeni: U+1F82).
PIECES = [*"ab =-\n\tçé日🙂", "\u0301", "\u0308", "\u0304", "\u1f82", "\u03b1\u0313\u0300\u0345"]
TRICKY = st.lists(st.sampled_from(PIECES), max_size=200).map("".join)


class Wrapped:
    """A `tokenizers.Tokenizer` as max_token_chars sees a Hugging Face fast tokenizer."""

    def __init__(self, backend: Any) -> None:
        self.backend_tokenizer = backend

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def count(self, text: str) -> int:
        return len(self.backend_tokenizer.encode(text, add_special_tokens=False).ids)


@functools.cache
def trained_byte_level(normalizer: str | None = None) -> Wrapped:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    if normalizer == "NFC":
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    return Wrapped(backend)


@functools.cache
def sentencepiece_style() -> Wrapped:
    """Llama 2's layout: spaces as U+2581, byte fallback, fused unknown tokens."""
    from tokenizers import Tokenizer, models, normalizers

    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "=", "▁a", "▁ab", "=="]
    pieces += ["▁▁", "▁▁▁▁", "▁▁▁▁▁▁▁▁"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [("▁", "a"), ("▁a", "b"), ("=", "="), ("▁", "▁"), ("▁▁", "▁▁"), ("▁▁▁▁", "▁▁▁▁")]
    model = models.BPE(
        vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True, ignore_merges=False
    )
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    return Wrapped(backend)


@pytest.fixture(scope="module", params=["byte-level", "byte-level NFC", "sentencepiece"])
def real(request: pytest.FixtureRequest) -> Wrapped:
    if request.param == "sentencepiece":
        return sentencepiece_style()
    return trained_byte_level("NFC" if request.param.endswith("NFC") else None)


def test_real_tokenizers_have_a_bound(real: Wrapped) -> None:
    assert 1 < max_token_chars(real) < 1000


def test_the_longest_pieces_repeated_fit_the_bound(real: Wrapped) -> None:
    bound = max_token_chars(real)
    for text in [*CORPUS, " " * 5000, "=" * 5000, "ab " * 2000, "<|endoftext|>" * 100]:
        assert len(text) <= real.count(text) * bound


@settings(max_examples=200, deadline=None)
@given(text=TRICKY)
def test_no_text_needs_fewer_tokens_than_the_bound_says(text: str) -> None:
    for tokenizer in (trained_byte_level(), trained_byte_level("NFC"), sentencepiece_style()):
        assert len(text) <= tokenizer.count(text) * max_token_chars(tokenizer)
