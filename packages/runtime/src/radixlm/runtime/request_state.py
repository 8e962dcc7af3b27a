"""Per-request engine state and the output chunks it streams (SGLang's `/generate` shape)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.detokenizer import TextDecoder
from radixlm.runtime.hidden_states import HiddenStates
from radixlm.runtime.logprobs import TokenLogprob, flatten_logprobs
from radixlm.runtime.scheduler import Req
from radixlm.runtime.stopping import FinishReason, SequenceOutput
from radixlm.runtime.thinking import ThinkingBudget
from radixlm.sampling import SamplingParams

#: What a request's sink receives: an output chunk, an exception (raised by the reader), or
#: END once every sequence has finished.
END = object()
Sink = Callable[[Any], None]

Triple = list[Any]  # [logprob | None, token_id, text | None]


@dataclass(frozen=True)
class LogprobOptions:
    """What a request asked for: output logprobs with `top` alternatives and `token_ids`;
    prompt logprobs from `input_start` (None: none); token texts in the triples."""

    enabled: bool = False
    top: int = 0
    token_ids: tuple[int, ...] | None = None
    input_start: int | None = None
    with_text: bool = False


@dataclass
class RequestHandle:
    """One user request (n sequences). Created by the engine's front end, driven by the loop.

    `sink` is called from the engine loop's thread; it must only hand the item over (put it
    on a queue), never block.
    """

    rid: str
    params: SamplingParams
    prompt_ids: list[int]
    sink: Sink
    stream: bool = False
    incremental: bool = False
    stream_interval: int = 1  # output tokens per streamed chunk after the first
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    custom_logit_processor: str | None = None
    #: The prompt as embeddings (a float32 CPU tensor [prompt_len, hidden]) when it was given
    #: as `input_embeds`; `prompt_ids` then hold its cache-key pseudo ids.
    input_embeds: Any = None
    return_hidden_states: bool = False
    created: float = field(default_factory=time.monotonic)
    seqs: list[SequenceState] = field(default_factory=list)
    closed: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.seqs)

    def fail(self, error: BaseException) -> None:
        """End the request with an error (delivered to the reader instead of chunks)."""
        if not self.closed:
            self.closed = True
            self.sink(error)
            self.sink(END)


@dataclass
class SequenceState:
    """One of a request's sequences: its scheduler request, output text and logprobs."""

    handle: RequestHandle
    index: int
    req: Req
    output: SequenceOutput
    decoder: TextDecoder
    seed: int | None = None
    grammar: Any = None
    grammar_future: Any = None
    #: `meta_info["grammar"]` without the rollback count (set once the grammar compiled).
    grammar_info: dict[str, Any] | None = None
    grammar_rollbacks: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    thinking: ThinkingBudget | None = None
    output_logprobs: list[Triple] = field(default_factory=list)
    output_top: list[list[Triple]] = field(default_factory=list)
    output_ids_logprobs: list[list[Triple]] = field(default_factory=list)
    input_logprobs: list[Triple] = field(default_factory=list)
    input_top: list[list[Triple] | None] = field(default_factory=list)
    input_ids_logprobs: list[list[Triple] | None] = field(default_factory=list)
    hidden_states: HiddenStates | None = None  # only when the request asked for them
    sent_hidden: int = 0
    sent_text: int = 0
    sent_ids: int = 0
    sent_logprobs: int = 0
    dirty: bool = False

    @property
    def finish(self) -> FinishReason | None:
        return self.output.finish

    def _text(self, token_id: int) -> str | None:
        # A token's own text, special tokens written out (SGLang's logprob texts), so texts
        # of a prompt's tokens line up with the prompt (OpenAI echo's text_offset).
        return self.decoder.raw([token_id]) if self.handle.logprobs.with_text else None

    def _triples(self, pairs: Sequence[tuple[int, float]]) -> list[Triple]:
        return [[lp, tid, self._text(tid)] for tid, lp in pairs]

    def record_output_logprob(self, logprob: TokenLogprob | None) -> None:
        if not self.handle.logprobs.enabled or logprob is None:
            return
        self.output_logprobs.append(
            [logprob.logprob, logprob.token_id, self._text(logprob.token_id)]
        )
        self.output_top.append(self._triples(logprob.top))
        self.output_ids_logprobs.append(self._triples(logprob.requested))

    def truncate_logprobs(self, num_tokens: int) -> None:
        """Keep the output logprobs of the first `num_tokens` output tokens only (after tokens
        were taken back)."""
        del self.output_logprobs[num_tokens:]
        del self.output_top[num_tokens:]
        del self.output_ids_logprobs[num_tokens:]

    def record_input_logprobs(self, scored: Sequence[TokenLogprob]) -> None:
        options = self.handle.logprobs
        if options.input_start is None:
            return
        if not self.input_logprobs and options.input_start == 0:
            first = self.req.prompt_ids[0]
            self.input_logprobs.append([None, first, self._text(first)])
            self.input_top.append(None)
            self.input_ids_logprobs.append(None)
        for lp in scored:
            self.input_logprobs.append([lp.logprob, lp.token_id, self._text(lp.token_id)])
            self.input_top.append(self._triples(lp.top))
            self.input_ids_logprobs.append(self._triples(lp.requested))

    def _committed(self) -> int | None:
        """Output tokens that can no longer be taken back, when the grammar says (a grammar
        that validates completed values); None: every token is final once appended."""
        if self.grammar is None or self.finish is not None:
            return None
        committed = getattr(self.grammar, "committed", None)
        return None if committed is None else max(0, int(committed))

    def _visible(self) -> tuple[str, int, int]:
        """What may be shown now: the text, and how many output ids and logprob entries. A
        finished sequence shows everything; a running one holds back the tail that may still
        become a stop string and the tokens its grammar may still take back."""
        if self.finish is not None:
            return self.output.text, len(self.req.output_ids), len(self.output_logprobs)
        committed = self._committed()
        ids = len(self.req.output_ids)
        if committed is not None:
            ids = min(ids, committed)
        return self.output.stream_text(committed), ids, min(ids, len(self.output_logprobs))

    def has_news(self, interval: int = 1) -> bool:
        """Whether a streamed chunk is due: it would carry text or ids not sent yet, and (after
        the first chunk) at least `interval` new output ids."""
        text, ids, _ = self._visible()
        if not self.detokenize:
            text = ""
        if self.sent_ids == 0 and self.sent_text == 0:
            return ids > 0 or len(text) > 0
        if interval > 1:
            return ids - self.sent_ids >= interval
        return ids > self.sent_ids or len(text) > self.sent_text

    @property
    def detokenize(self) -> bool:
        return self.handle.params.detokenize

    def chunk(self) -> dict[str, Any]:
        """The sequence's output now: cumulative, or only what is new since the last chunk
        when the request streams incrementally. Marks what it returns as sent."""
        handle = self.handle
        final = self.finish is not None
        text, num_ids, num_lp = self._visible()
        if not self.detokenize:
            text = ""  # vLLM's detokenize=false: token ids only
        ids = self.req.output_ids[:num_ids]
        incremental = handle.stream and handle.incremental
        # Tokens taken back after they were sent (only when the grammar gives no committed
        # count) cannot be unsent: start from the current end rather than past it.
        start_text = min(self.sent_text, len(text)) if incremental else 0
        start_ids = min(self.sent_ids, num_ids) if incremental else 0
        # Streamed logprobs are always only the new tokens' (SGLang's), with the running count
        # in output_token_logprobs_length: resending every list each chunk is quadratic.
        start_lp = min(self.sent_logprobs, num_lp) if handle.stream else 0
        meta: dict[str, Any] = {
            "id": handle.rid,
            "prompt_tokens": len(self.req.prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": self.req.cached_tokens or 0,
            "finish_reason": self.finish.to_dict() if final and self.finish else None,
            "e2e_latency": time.monotonic() - handle.created,
        }
        if self.grammar_info is not None:
            meta["grammar"] = {**self.grammar_info, "rollbacks": self.grammar_rollbacks}
        if handle.logprobs.enabled:
            meta["output_token_logprobs"] = self.output_logprobs[start_lp:num_lp]
            meta["output_token_logprobs_length"] = num_lp
            meta["output_top_logprobs"] = self.output_top[start_lp:num_lp]
            if handle.logprobs.token_ids is not None:
                meta["output_token_ids_logprobs"] = self.output_ids_logprobs[start_lp:num_lp]
            if handle.logprobs.input_start is not None:
                meta["input_token_logprobs"] = self.input_logprobs
                meta["input_top_logprobs"] = self.input_top
                if handle.logprobs.token_ids is not None:
                    meta["input_token_ids_logprobs"] = self.input_ids_logprobs
        if self.hidden_states is not None:
            entries = self.hidden_states.entries(num_ids)
            # Streamed: only the entries not sent yet (the prompt's rows come once).
            start_hidden = min(self.sent_hidden, len(entries)) if handle.stream else 0
            meta["hidden_states"] = entries[start_hidden:]
            self.sent_hidden = len(entries)
        if handle.logprobs.enabled and handle.params.flat_logprobs:
            flatten_logprobs(meta)
        out = {
            "index": self.index,
            "text": text[start_text:],
            "output_ids": list(ids[start_ids:]),
            "meta_info": meta,
        }
        self.sent_text = len(text)
        self.sent_ids = num_ids
        self.sent_logprobs = num_lp
        self.dirty = False
        return out
