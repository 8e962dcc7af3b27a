"""Stop and finish conditions of one sequence's output (torch-free): those of its token ids
(stop tokens, repetition, lengths) in the engine core, those of its text (stop strings,
regexes) on the front end, which detokenizes."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from radixlm.runtime.detokenizer import IncrementalDetokenizer, TextDecoder
from radixlm.sampling import FinishReason, SamplingParams


def _longest_partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


def _repeats(ids: Sequence[int], ngram: int, repeats: int, window: int) -> bool:
    span = ngram * repeats
    if len(ids) < span:
        return False
    tail = list(ids[-min(window, len(ids)) :])
    last = tail[-ngram:]
    return all(
        tail[len(tail) - (k + 1) * ngram : len(tail) - k * ngram] == last for k in range(repeats)
    )


class TokenStops:
    """The stop conditions of one sequence that need only its token ids (the engine core's
    side; the scheduler's `Stopper`): a stop token id or EOS (unless `ignore_eos`), a
    repetition loop, `max_new_tokens`, and the stops decided outside (the context, the grammar,
    an abort). A stop token does not fire before `min_new_tokens` tokens.

    Text stops (stop strings, regexes) belong to the front end's `SequenceOutput`, which
    detokenizes. `rolled_back_to` is the shortest the output was since the core last told the
    front end (which resets it; None: nothing was taken back), so it can say what to take back.
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        max_new_tokens: int | None = None,
    ) -> None:
        self.params = params
        self.max_new_tokens = (
            max_new_tokens if max_new_tokens is not None else params.max_new_tokens
        )
        self.stop_ids = stop_token_ids(params, eos_token_ids)
        self._detection = params.repetition_detection
        #: The output's ids, kept only for repetition detection (else only counted).
        self._ids: list[int] | None = [] if self._detection is not None else None
        self.count = 0
        self.finish: FinishReason | None = None
        self.rolled_back_to: int | None = None

    def append(self, token_id: int) -> FinishReason | None:
        """Count one generated token; return the finish reason if the sequence ends here."""
        if self.finish is not None:
            raise RuntimeError("append() after the sequence finished")
        self.count += 1
        count = self.count
        if self._ids is not None:
            self._ids.append(token_id)
        past_min = count > self.params.min_new_tokens
        if past_min and token_id in self.stop_ids:
            return self._finished(FinishReason("stop", matched=token_id))
        detection = self._detection
        if (
            detection is not None
            and self._ids is not None
            and _repeats(self._ids, detection.ngram_size, detection.repeats, detection.window)
        ):
            return self._finished(FinishReason("stop", message="repetition detected"))
        if self.max_new_tokens is not None and count >= self.max_new_tokens:
            return self.finish_length()
        return None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens (jump-forward re-tokenization, a grammar retry)."""
        if num_tokens <= 0:
            return
        self.count -= num_tokens
        if self._ids is not None:
            del self._ids[self.count :]
        low = self.rolled_back_to
        self.rolled_back_to = self.count if low is None else min(low, self.count)

    def finish_length(self, message: str | None = None) -> FinishReason:
        """End the sequence for its length (max_new_tokens or the context)."""
        return self._finished(FinishReason("length", message=message))

    def stop(self, matched: int | str | None = None, message: str | None = None) -> FinishReason:
        """End the sequence with a stop decided outside (e.g. the grammar terminated)."""
        return self._finished(FinishReason("stop", matched=matched, message=message))

    def abort(self, message: str | None = None) -> FinishReason:
        """End the sequence as aborted."""
        return self._finished(FinishReason("abort", message=message))

    def _finished(self, reason: FinishReason) -> FinishReason:
        self.finish = reason
        return reason


def stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The ids that end a sequence: `stop_token_ids`, and EOS unless `ignore_eos`."""
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids.update(eos_token_ids)
    return frozenset(stop_ids)


class SequenceOutput:
    """One sequence's output text, on the front end: the token ids the engine core sent, their
    incremental detokenization, and the stops that need the text.

    `append(token, finish)` adds a generated token with the core's verdict on it (`finish`:
    a stop token, the length, the grammar...) and returns a FinishReason when the sequence
    ends: the core's, or a stop string (matched across token boundaries; the text is cut
    before it unless `no_stop_trim` / `include_stop_str_in_output`) or a stop regex, checked
    first (so a token that completes a stop string and reaches the length stops on the
    string) and not before `min_new_tokens` tokens. A stop token's text is left out unless the
    stop string is kept. `text` is the output text, final once finished.
    """

    def __init__(
        self,
        params: SamplingParams,
        decoder: TextDecoder,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(decoder)
        self.output_ids: list[int] = []
        self.stop_ids = stop_token_ids(params, eos_token_ids)
        self.stop_strings = params.stop_strings
        self._max_stop = max((len(s) for s in self.stop_strings), default=0)
        self.stop_regexes = [re.compile(p) for p in params.stop_regexes]
        # Stop strings holding a special token's text (a chat template's "<|im_end|>") never
        # appear in a text that skips special tokens: like SGLang, match them on the raw text
        # of the last tokens instead (the output text is not trimmed: they are not in it).
        specials = decoder.hidden_special_texts() if self.stop_strings else ()
        self._special_stops = [s for s in self.stop_strings if any(t in s for t in specials)]
        # Enough tokens to spell the longest of them, even one byte per token.
        self._special_window = 4 * max((len(s) for s in self._special_stops), default=0) + 1
        self.finish: FinishReason | None = None
        self._text_end: int | None = None  # where the final text is cut (stop string or regex)

    @property
    def text(self) -> str:
        text = self.detokenizer.text
        return text if self._text_end is None else text[: self._text_end]

    def stream_text(self, committed: int | None = None) -> str:
        """Text that is safe to show now: without a tail that may still become a stop string,
        and with `committed`, no more than the text of the first `committed` output tokens
        (the rest may still be taken back)."""
        text = self.text
        if self.finish is not None:
            return text
        if committed is not None:
            text = text[: self.detokenizer.text_end(committed)]
        if not self.stop_strings:
            return text
        return text[: len(text) - _longest_partial_stop(text, self.stop_strings)]

    def append(self, token_id: int, finish: FinishReason | None = None) -> FinishReason | None:
        """Add one generated token and the core's `finish` for it (None: it goes on); return
        the finish reason if the sequence ends here."""
        if self.finish is not None:
            raise RuntimeError("append() after the sequence finished")
        self.output_ids.append(token_id)
        if (
            finish is not None
            and finish.type == "stop"
            and finish.matched == token_id
            and token_id in self.stop_ids
        ):
            if self.params.keeps_stop_string:
                self.detokenizer.append([token_id])
            return self.end(finish)
        before = len(self.detokenizer.text)
        self.detokenizer.append([token_id])
        past_min = len(self.output_ids) > self.params.min_new_tokens
        if past_min and (self._check_text(before) or self._check_special_stops()):
            return self.finish
        if finish is not None:
            return self.end(finish)
        return None

    def end(self, reason: FinishReason) -> FinishReason:
        """End the sequence with a reason decided by the core (its length, an abort, the
        grammar): the text settles, a trailing incomplete character included."""
        self.detokenizer.flush()
        return self._finished(reason)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens (jump-forward re-tokenization)."""
        if num_tokens > 0:
            del self.output_ids[len(self.output_ids) - num_tokens :]
            self.detokenizer.rollback(num_tokens)

    def _finished(self, reason: FinishReason) -> FinishReason:
        self.finish = reason
        return reason

    def _check_special_stops(self) -> bool:
        if not self._special_stops:
            return False
        decoder = self.detokenizer.decoder
        tail = self.output_ids[-self._special_window :]
        if decoder.special_ids.isdisjoint(tail):
            return False
        raw = decoder.raw(tail)
        for stop in self._special_stops:
            if stop in raw:
                self.detokenizer.flush()
                self._finished(FinishReason("stop", matched=stop))
                return True
        return False

    def _check_text(self, before: int) -> bool:
        text = self.detokenizer.text
        if self.stop_strings and len(text) > before:
            start = max(0, before - self._max_stop + 1)
            found: tuple[int, str] | None = None
            for stop in self.stop_strings:
                at = text.find(stop, start)
                if at >= 0 and (found is None or at < found[0]):
                    found = (at, stop)
            if found is not None:
                at, stop = found
                keep = self.params.keeps_stop_string
                self._text_end = at + len(stop) if keep else at
                self._finished(FinishReason("stop", matched=stop))
                return True
        for pattern in self.stop_regexes:
            match = pattern.search(text)
            if match is not None:
                keep = self.params.keeps_stop_string
                self._text_end = match.end() if keep else match.start()
                self._finished(FinishReason("stop", matched=match.group(0)))
                return True
        return False
