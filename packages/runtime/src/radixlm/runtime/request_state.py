"""Per-request engine state and the output chunks it streams (SGLang's `/generate` shape)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.detokenizer import TextDecoder
from radixlm.runtime.hidden_states import HiddenStates
from radixlm.runtime.logprobs import TokenLogprob
from radixlm.runtime.messages import EngineRequest, LogprobOptions
from radixlm.runtime.scheduler import Req
from radixlm.runtime.stopping import SequenceOutput
from radixlm.runtime.thinking import ThinkingBudget
from radixlm.sampling import FinishReason, GenerateChunk, LogprobEntry, SamplingParams

Entries = tuple[LogprobEntry, ...]


@dataclass
class RequestHandle:
    """One user request (its `params.n` sequences) inside the engine core."""

    request: EngineRequest
    seqs: list[SequenceState] = field(default_factory=list)
    closed: bool = False

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def incremental(self) -> bool:
        return self.request.incremental

    @property
    def stream_interval(self) -> int:
        return self.request.stream_interval

    @property
    def logprobs(self) -> LogprobOptions:
        return self.request.logprobs

    @property
    def custom_logit_processor(self) -> str | None:
        return self.request.custom_logit_processor

    @property
    def input_embeds(self) -> Any:
        return self.request.input_embeds

    @property
    def return_hidden_states(self) -> bool:
        return self.request.return_hidden_states

    @property
    def created(self) -> float:
        return self.request.created

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.seqs)


def open_request(
    request: EngineRequest,
    tokenizer: Any,
    eos_token_ids: tuple[int, ...],
    grammar_future: Any,
    prefix_sharing: bool,
) -> RequestHandle:
    """The engine-side state of a prepared request: one scheduler `Req` and output per
    sequence (`n > 1` siblings wait for the first one's prefill when the cache shares it)."""
    handle = RequestHandle(request)
    params = request.params
    prompt_ids = list(request.prompt_ids)
    decoder = TextDecoder(
        tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
    )
    hidden = request.return_hidden_states
    thinking_end = request.thinking_end
    first: Req | None = None
    for index in range(params.n):
        output = SequenceOutput(params, decoder, eos_token_ids, request.max_new_tokens)
        req = Req(
            request.rid if params.n == 1 else f"{request.rid}#{index}",
            prompt_ids,
            request.max_new_tokens,
            input_logprob_start=request.logprobs.input_start,
            wait_for=first if prefix_sharing else None,
            stopper=output,
            # Every prompt position's hidden state is returned: none comes from the cache.
            reuse_prefix=not hidden,
        )
        seq = SequenceState(
            handle,
            index,
            req,
            output,
            decoder,
            seed=None if params.seed is None else params.seed + index,
            grammar_future=grammar_future,
            bad_words_ids=request.bad_words_ids,
            thinking=None
            if thinking_end is None or params.thinking_token_budget is None
            else ThinkingBudget(thinking_end, params.thinking_token_budget),
            hidden_states=HiddenStates(len(prompt_ids)) if hidden else None,
        )
        seq.record_input_logprobs([])  # the first prompt token's entry has no logprob
        req.grammar_pending = req.rewindable = grammar_future is not None
        handle.seqs.append(seq)
        first = first or req
    return handle


@dataclass
class SequenceState:
    """One of a request's sequences: its scheduler request, output text and logprobs."""

    handle: RequestHandle
    index: int
    req: Req
    output: SequenceOutput
    decoder: TextDecoder
    seed: int | None = None
    grammar_future: Any = None
    #: `meta_info["grammar"]` without the rollback count (set once the grammar compiled).
    grammar_info: dict[str, Any] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    thinking: ThinkingBudget | None = None
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top: list[Entries] = field(default_factory=list)
    output_ids_logprobs: list[Entries] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top: list[Entries | None] = field(default_factory=list)
    input_ids_logprobs: list[Entries | None] = field(default_factory=list)
    hidden_states: HiddenStates | None = None  # only when the request asked for them
    sent_hidden: int = 0
    sent_text: int = 0
    sent_ids: int = 0
    sent_logprobs: int = 0
    dirty: bool = False

    @property
    def finish(self) -> FinishReason | None:
        return self.output.finish

    @property
    def grammar(self) -> Any:
        """The structured-output matcher (owned by the scheduler's request), or None."""
        return self.req.grammar

    def _text(self, token_id: int) -> str | None:
        # A token's own text, special tokens written out (SGLang's logprob texts), so texts
        # of a prompt's tokens line up with the prompt (OpenAI echo's text_offset).
        return self.decoder.raw([token_id]) if self.handle.logprobs.with_text else None

    def _entries(self, pairs: Sequence[tuple[int, float]]) -> Entries:
        return tuple(LogprobEntry(lp, tid, self._text(tid)) for tid, lp in pairs)

    def record_output_logprob(self, logprob: TokenLogprob | None) -> None:
        if not self.handle.logprobs.enabled or logprob is None:
            return
        self.output_logprobs.append(
            LogprobEntry(logprob.logprob, logprob.token_id, self._text(logprob.token_id))
        )
        self.output_top.append(self._entries(logprob.top))
        self.output_ids_logprobs.append(self._entries(logprob.requested))

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
            self.input_logprobs.append(LogprobEntry(None, first, self._text(first)))
            self.input_top.append(None)
            self.input_ids_logprobs.append(None)
        for lp in scored:
            self.input_logprobs.append(
                LogprobEntry(lp.logprob, lp.token_id, self._text(lp.token_id))
            )
            self.input_top.append(self._entries(lp.top))
            self.input_ids_logprobs.append(self._entries(lp.requested))

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

    def chunk(self) -> GenerateChunk:
        """The sequence's output now: cumulative, or only what is new since the last chunk
        when the request streams incrementally. Marks what it returns as sent."""
        handle = self.handle
        final = self.finish is not None
        text, num_ids, num_lp = self._visible()
        if not self.detokenize:
            text = ""  # vLLM's detokenize=false: token ids only
        incremental = handle.stream and handle.incremental
        # Tokens taken back after they were sent (only when the grammar gives no committed
        # count) cannot be unsent: start from the current end rather than past it.
        start_text = min(self.sent_text, len(text)) if incremental else 0
        start_ids = min(self.sent_ids, num_ids) if incremental else 0
        # Streamed logprobs are always only the new tokens' (SGLang's), with the running count
        # in output_token_logprobs_length: resending every list each chunk is quadratic.
        start_lp = min(self.sent_logprobs, num_lp) if handle.stream else 0
        options = handle.logprobs
        out: dict[str, Any] = {}
        if self.grammar_info is not None:
            out["grammar"] = {**self.grammar_info, "rollbacks": self.req.grammar_rollbacks}
        if options.enabled:
            out["output_token_logprobs"] = tuple(self.output_logprobs[start_lp:num_lp])
            out["output_token_logprobs_length"] = num_lp
            out["output_top_logprobs"] = tuple(self.output_top[start_lp:num_lp])
            if options.token_ids is not None:
                out["output_token_ids_logprobs"] = tuple(self.output_ids_logprobs[start_lp:num_lp])
            if options.input_start is not None:
                out["input_token_logprobs"] = tuple(self.input_logprobs)
                out["input_top_logprobs"] = tuple(self.input_top)
                if options.token_ids is not None:
                    out["input_token_ids_logprobs"] = tuple(self.input_ids_logprobs)
        if self.hidden_states is not None:
            entries = self.hidden_states.entries(num_ids)
            # Streamed: only the entries not sent yet (the prompt's rows come once).
            start_hidden = min(self.sent_hidden, len(entries)) if handle.stream else 0
            out["hidden_states"] = tuple(entries[start_hidden:])
            self.sent_hidden = len(entries)
        chunk = GenerateChunk(
            rid=handle.rid,
            index=self.index,
            text=text[start_text:],
            output_ids=tuple(self.req.output_ids[start_ids:num_ids]),
            prompt_tokens=len(self.req.prompt_ids),
            completion_tokens=num_ids,
            cached_tokens=self.req.cached_tokens or 0,
            finish_reason=self.finish if final else None,
            e2e_latency=time.monotonic() - handle.created,
            flat_logprobs=options.enabled and handle.params.flat_logprobs,
            **out,  # empty unless the request asked for logprobs, hidden states, a grammar
        )
        self.sent_text = len(text)
        self.sent_ids = num_ids
        self.sent_logprobs = num_lp
        self.dirty = False
        return chunk
