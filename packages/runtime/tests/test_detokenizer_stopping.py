"""Incremental detokenization and stop conditions on a tiny byte-level BPE tokenizer: the
core's token stops (`TokenStops`) and the front end's text stops (`SequenceOutput`), chained
as the engine chains them."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from radixlm.runtime.detokenizer import IncrementalDetokenizer, TextDecoder, backend_decode
from radixlm.runtime.fixtures import build_tiny_tokenizer
from radixlm.runtime.stopping import SequenceOutput, TokenStops
from radixlm.sampling import FinishReason, RepetitionDetection, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


class _Sequence:
    """The core's verdict on each token, then the front end's: what the engine does with one
    sequence (its core and front end in step, no tokens past a stop string)."""

    def __init__(self, params: SamplingParams, decoder: TextDecoder) -> None:
        self.stops = TokenStops(params, eos_token_ids=[0])
        self.out = SequenceOutput(params, decoder, eos_token_ids=[0])

    def append(self, token: int) -> FinishReason | None:
        return self.out.append(token, self.stops.append(token))

    def rollback(self, num_tokens: int) -> None:
        self.stops.rollback(num_tokens)
        self.out.rollback(num_tokens)

    def stream_text(self, committed: int | None = None) -> str:
        return self.out.stream_text(committed)

    @property
    def text(self) -> str:
        return self.out.text

    @property
    def finish(self) -> FinishReason | None:
        return self.out.finish


def _output(tok: Any, **params: Any) -> _Sequence:
    return _Sequence(SamplingParams(**params), TextDecoder(tok))


def test_incremental_text_equals_full_decode_across_multibyte_characters(tok: Any) -> None:
    text = "café 中文 🙂 naïve — “quotes” hello world 日本語 🚀"
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(TextDecoder(tok))
    pieces = [detok.append([token]) for token in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert detok.text == text


def test_incomplete_character_is_held_back_until_complete(tok: Any) -> None:
    ids = _encode(tok, "🙂")
    assert len(ids) > 1  # the emoji's bytes span several tokens
    detok = IncrementalDetokenizer(TextDecoder(tok))
    assert [detok.append([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.append(ids[-1:]) == "🙂"


def test_random_token_sequences_decode_like_the_tokenizer(tok: Any) -> None:
    rng = random.Random(0)
    special = set(tok.all_special_ids)
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        ids = [t for t in ids if t not in special] or [5]
        detok = IncrementalDetokenizer(TextDecoder(tok))
        for token in ids:
            detok.append([token])
        detok.flush()
        assert detok.text == tok.decode(ids, clean_up_tokenization_spaces=False)


def test_skip_special_tokens_drops_them(tok: Any) -> None:
    ids = [*_encode(tok, "hello"), tok.convert_tokens_to_ids("<|im_end|>"), *_encode(tok, " world")]
    assert TextDecoder(tok, skip_special_tokens=True)(ids) == "hello world"


def test_spaces_between_special_tokens_when_kept(tok: Any) -> None:
    ids = [*_encode(tok, "hello"), tok.convert_tokens_to_ids("<|im_end|>"), *_encode(tok, "x")]
    spaced = TextDecoder(tok, skip_special_tokens=False, spaces_between_special_tokens=True)
    tight = TextDecoder(tok, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert spaced(ids) == "hello <|im_end|> x"
    assert tight(ids) == "hello<|im_end|>x"


def test_stop_string_matched_across_token_boundaries_is_trimmed(tok: Any) -> None:
    out = _output(tok, stop=["capital of"])
    reason = None
    for token in _encode(tok, "What is the capital of France"):
        reason = out.append(token)
        if reason:
            break
    assert reason is not None and reason.type == "stop" and reason.matched == "capital of"
    assert out.text == "What is the "


def test_stop_string_kept_with_no_stop_trim(tok: Any) -> None:
    out = _output(tok, stop="capital", no_stop_trim=True)
    for token in _encode(tok, "the capital city"):
        if out.append(token):
            break
    assert out.text == "the capital"


def test_include_stop_str_in_output_keeps_it(tok: Any) -> None:
    out = _output(tok, stop="capital", include_stop_str_in_output=True)
    for token in _encode(tok, "the capital city"):
        if out.append(token):
            break
    assert out.text == "the capital"


def test_stream_text_holds_back_a_possible_stop_prefix(tok: Any) -> None:
    out = _output(tok, stop="Paris!")
    for token in _encode(tok, "hello Par"):
        out.append(token)
    assert out.text == "hello Par"
    assert out.stream_text() == "hello "


def test_stream_text_shows_only_the_committed_tokens_text(tok: Any) -> None:
    out = _output(tok)
    ids = _encode(tok, "the radix tree caches the prefix")
    for token in ids:
        out.append(token)
    for committed in range(len(ids) + 1):
        shown = out.stream_text(committed)
        assert shown == tok.decode(ids[:committed], clean_up_tokenization_spaces=False)
    assert out.stream_text() == out.text


def test_committed_text_holds_back_an_incomplete_character_and_a_stop_prefix(tok: Any) -> None:
    out = _output(tok, stop="xyz")
    ids = _encode(tok, "ok 🙂 x")
    for token in ids:
        out.append(token)
    assert out.stream_text(len(ids)) == "ok 🙂 "  # "x" may begin the stop string
    emoji = _encode(tok, "ok 🙂")
    assert not out.stream_text(len(emoji) - 1).endswith("\ufffd")


def test_rollback_forgets_the_text_of_the_tokens_taken_back(tok: Any) -> None:
    out = _output(tok)
    ids = _encode(tok, "the radix tree caches the prefix")
    for token in ids:
        out.append(token)
    out.rollback(3)
    kept = ids[:-3]
    assert out.text == tok.decode(kept, clean_up_tokenization_spaces=False)
    assert out.stream_text(len(ids)) == out.text
    assert out.stream_text(2) == tok.decode(kept[:2], clean_up_tokenization_spaces=False)


def test_stop_token_id_finishes_without_its_text(tok: Any) -> None:
    out = _output(tok, stop_token_ids=[7])
    out.append(_encode(tok, "hello")[0])
    reason = out.append(7)
    assert reason is not None and reason.matched == 7
    assert out.text == "hello"


def test_a_special_token_stop_string_stops_though_the_text_skips_it(tok: Any) -> None:
    # A chat template's end of turn, sent as a stop string (SGLang matches it on the raw text).
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = _output(tok, stop="<|im_end|>")
    for token in _encode(tok, "hello"):
        assert out.append(token) is None
    reason = out.append(end)
    assert reason is not None and reason.type == "stop" and reason.matched == "<|im_end|>"
    assert out.text == "hello"


def test_a_stop_string_spanning_a_special_token_and_text_stops(tok: Any) -> None:
    out = _output(tok, stop="<|im_end|>\n")
    assert out.append(tok.convert_tokens_to_ids("<|im_end|>")) is None
    reason = out.append(_encode(tok, "\n")[0])
    assert reason is not None and reason.matched == "<|im_end|>\n"


def test_a_kept_special_token_stop_string_is_trimmed_from_the_text(tok: Any) -> None:
    out = _Sequence(
        SamplingParams(stop="<|im_end|>", skip_special_tokens=False),
        TextDecoder(tok, skip_special_tokens=False),
    )
    out.append(_encode(tok, "hi")[0])
    reason = out.append(tok.convert_tokens_to_ids("<|im_end|>"))
    assert reason is not None and reason.matched == "<|im_end|>"
    assert "<|im_end|>" not in out.text


def test_eos_finishes_unless_ignore_eos(tok: Any) -> None:
    assert _output(tok).append(0) is not None
    assert _output(tok, ignore_eos=True).append(0) is None


def test_stops_wait_for_min_new_tokens(tok: Any) -> None:
    out = _output(tok, min_new_tokens=2, stop="a")
    assert out.append(0) is None  # EOS before min_new_tokens does not stop
    assert out.append(_encode(tok, "a")[0]) is None
    assert out.append(0) is not None


def test_max_new_tokens_finishes_with_length(tok: Any) -> None:
    out = _output(tok, max_new_tokens=2, ignore_eos=True)
    assert out.append(5) is None
    reason = out.append(6)
    assert reason is not None and reason.type == "length"


def test_stop_regex_trims_at_the_match(tok: Any) -> None:
    out = _output(tok, stop_regex=r"\d+!")
    for token in _encode(tok, "value 42! more"):
        if out.append(token):
            break
    assert out.finish is not None and out.finish.matched == "42!"
    assert out.text == "value "


def test_repetition_detection_stops_a_loop(tok: Any) -> None:
    out = _output(tok, repetition_detection=RepetitionDetection(ngram_size=2, repeats=3, window=16))
    reasons = [out.append(t) for t in [5, 6, 5, 6, 5]]
    assert reasons == [None] * 5
    reason = out.append(6)
    assert reason is not None and reason.type == "stop" and reason.message


def test_the_core_rollback_low_water_mark_tells_what_to_take_back() -> None:
    stops = TokenStops(SamplingParams(ignore_eos=True))
    for token in [5, 6, 7, 8]:
        stops.append(token)
    stops.rollback(2)
    stops.append(9)
    stops.rollback(2)  # the shortest the output was: one token
    assert stops.count == 1 and stops.rolled_back_to == 1


def test_a_stop_string_wins_over_the_length_on_the_same_token(tok: Any) -> None:
    ids = _encode(tok, "ab")
    out = _output(tok, stop="b", max_new_tokens=len(ids), ignore_eos=True)
    reasons = [out.append(t) for t in ids]
    assert reasons[-1] is not None and reasons[-1].matched == "b"
    assert out.text == "a"


def test_the_fast_tokenizers_own_decode_is_used_only_when_it_is_all_decode_does(
    tok: Any, tmp_path: Any
) -> None:
    assert backend_decode(tok) is not None
    ids = _encode(tok, "café 🙂 <|im_end|> x")
    assert TextDecoder(tok).raw(ids) == tok.decode(ids, clean_up_tokenization_spaces=False)

    class Shouting(type(tok)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return str(super()._decode(token_ids, **kwargs)).upper()

    tok.save_pretrained(tmp_path)
    loud = Shouting.from_pretrained(str(tmp_path))
    assert backend_decode(loud) is None
    assert TextDecoder(loud).raw(ids) == loud.decode(ids).upper() != TextDecoder(tok).raw(ids)
