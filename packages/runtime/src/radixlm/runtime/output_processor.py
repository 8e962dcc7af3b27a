"""The front end's half of each request's output: the core's `SeqDelta`s in, detokenized
`GenerateChunk`s (SGLang's `/generate` shape) out (torch-free).

The engine core sends token ids, logprobs and its own stop verdicts; here the ids become text
(incrementally), the stops that need the text (stop strings, regexes) are checked, logprob
entries get their token texts, and the chunks a reader sees are built: cumulative or
incremental, every `stream_interval` tokens, holding back what a stop string or a grammar may
still take back. A stop found here ends the sequence at once for the reader; the caller tells
the core (`StopSequence`), whose tokens past the stop are dropped.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from radixlm.runtime import routed_experts
from radixlm.runtime.detokenizer import TextDecoder
from radixlm.runtime.messages import EngineRequest, Entries, SeqDelta
from radixlm.runtime.stopping import SequenceOutput
from radixlm.sampling import FinishReason, GenerateChunk, LogprobEntry


class RequestOutput:
    """One request's output, its `params.n` sequences, as the front end sees it."""

    def __init__(
        self, request: EngineRequest, tokenizer: Any, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.request = request
        params = request.params
        decoder = TextDecoder(
            tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self.seqs = [SequenceView(request, k, decoder, eos_token_ids) for k in range(params.n)]

    def apply(self, delta: SeqDelta) -> tuple[GenerateChunk | None, bool]:
        """Take one delta of the core: the chunk it makes due for the reader (None: nothing
        to send yet), and whether the core must stop the sequence (a stop string ended it
        here)."""
        seq = self.seqs[delta.index]
        if seq.finish is not None:
            return None, False  # ended here already: the core's later tokens are dropped
        seq.apply(delta)
        stop_core = seq.finish is not None and delta.finish is None
        request = self.request
        if seq.finish is not None:
            return seq.chunk(), stop_core
        if not request.stream:
            return None, stop_core
        visible = seq.visible()
        if not seq.has_news(request.stream_interval, visible):
            return None, stop_core
        return seq.chunk(visible), stop_core


class SequenceView:
    """One sequence's output on the front end: ids and text (`SequenceOutput`), logprobs,
    hidden states, and how much of them the reader has."""

    def __init__(
        self,
        request: EngineRequest,
        index: int,
        decoder: TextDecoder,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.request = request
        self.index = index
        self.decoder = decoder
        self.output = SequenceOutput(request.params, decoder, eos_token_ids)
        self.with_text = request.logprobs.with_text
        self.cached_tokens = 0
        self.cached_tiers = (0, 0)
        self.weight_version = "default"
        self.committed: int | None = None
        self.grammar: dict[str, Any] | None = None
        self.output_logprobs: list[LogprobEntry] = []
        self.output_top: list[Entries] = []
        self.output_ids_logprobs: list[Entries] = []
        self.input_logprobs: list[LogprobEntry] = []
        self.input_top: list[Entries | None] = []
        self.input_ids_logprobs: list[Entries | None] = []
        self.hidden_states: list[Any] = []
        #: The routed experts of the positions computed so far (when asked).
        self.routed: Any = None
        #: A pooling request's result (its last delta brings it).
        self.embedding: tuple[float, ...] | None = None
        #: The core's monotonic times: first scheduled, first and last output token.
        self.times: tuple[float | None, float | None, float | None] = (None, None, None)
        self.sent_text = 0
        self.sent_ids = 0
        self.sent_logprobs = 0
        self.sent_hidden = 0

    @property
    def finish(self) -> FinishReason | None:
        return self.output.finish

    # ------------------------------------------------------------------------- updates

    def apply(self, delta: SeqDelta) -> None:
        """Take back, append and finish as the core says, checking the text stops on each
        appended token (the first one found ends the sequence; later tokens are dropped)."""
        output = self.output
        self.cached_tokens = delta.cached_tokens
        self.cached_tiers = delta.cached_tiers
        self.weight_version = delta.weight_version
        self.committed = delta.committed
        if delta.grammar is not None:
            self.grammar = delta.grammar
        if delta.rollback:
            output.rollback(delta.rollback)
        if self.request.logprobs.enabled:
            base = len(output.output_ids)
            del self.output_logprobs[base:]
            del self.output_top[base:]
            del self.output_ids_logprobs[base:]
            self.output_logprobs.extend(self._texted(delta.output_logprobs))
            self.output_top.extend(self._texted(e) for e in delta.output_top)
            self.output_ids_logprobs.extend(self._texted(e) for e in delta.output_ids_logprobs)
        if delta.input_logprobs:
            self.input_logprobs.extend(self._texted(delta.input_logprobs))
            self.input_top.extend(None if e is None else self._texted(e) for e in delta.input_top)
            self.input_ids_logprobs.extend(
                None if e is None else self._texted(e) for e in delta.input_ids_logprobs
            )
        self.hidden_states.extend(delta.hidden_states)
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.times is not None:
            self.times = delta.times
        if delta.routed_experts is not None:
            start, rows = delta.routed_experts
            self.routed = rows if self.routed is None else torch.cat([self.routed[:start], rows])
        new = delta.new_ids
        last = len(new) - 1
        for k, token in enumerate(new):
            if output.append(token, delta.finish if k == last else None) is not None:
                break
        if not new and delta.finish is not None:
            output.end(delta.finish)
        if output.finish is not None:
            # A stop string may end it before the core did: drop what came after.
            num = len(output.output_ids)
            del self.output_logprobs[num:]
            del self.output_top[num:]
            del self.output_ids_logprobs[num:]

    def _texted(self, entries: Entries) -> Entries:
        """The entries with their tokens' texts, special tokens written out (SGLang's logprob
        texts), when the request asked for them: they line up with the prompt (OpenAI echo's
        text_offset)."""
        if not self.with_text:
            return entries
        raw = self.decoder.raw
        return tuple(LogprobEntry(e.logprob, e.token_id, raw([e.token_id])) for e in entries)

    # -------------------------------------------------------------------------- chunks

    def visible(self) -> tuple[str, int, int]:
        """What may be shown now: the text, and how many output ids and logprob entries. A
        finished sequence shows everything; a running one holds back the tail that may still
        become a stop string and the tokens its grammar may still take back."""
        output = self.output
        ids = len(output.output_ids)
        if output.finish is not None:
            return output.text, ids, len(self.output_logprobs)
        committed = self.committed
        if committed is not None:
            ids = min(ids, committed)
        return output.stream_text(committed), ids, min(ids, len(self.output_logprobs))

    def has_news(self, interval: int = 1, visible: tuple[str, int, int] | None = None) -> bool:
        """Whether a streamed chunk is due: it would carry text or ids not sent yet, and (after
        the first chunk) at least `interval` new output ids. `visible`: `visible()`, when the
        caller has it."""
        text, ids, _ = visible or self.visible()
        if not self.request.params.detokenize:
            text = ""
        if self.sent_ids == 0 and self.sent_text == 0:
            return ids > 0 or len(text) > 0
        if interval > 1:
            return ids - self.sent_ids >= interval
        return ids > self.sent_ids or len(text) > self.sent_text

    def _hidden(self, num_ids: int) -> list[Any]:
        """SGLang's hidden states of the first `num_ids` output tokens: the prompt's rows,
        then one vector per output token fed back to the model (all but the last)."""
        if not self.hidden_states:
            return []
        return self.hidden_states[: 1 + max(num_ids - 1, 0)]

    def _timestamps(self) -> dict[str, float | None]:
        """`meta_info["timestamps"]` of the final chunk: when the request arrived (prepared),
        was first scheduled, produced its first and last output token, and when its output
        was detokenized (now), in seconds since the epoch (None: it never got there). The
        core's times are `time.monotonic()`, one clock for every process of the machine."""
        now = time.time()
        offset = now - time.monotonic()
        scheduled, first, last = self.times
        return {
            "arrival": self.request.created + offset,
            "scheduled": None if scheduled is None else scheduled + offset,
            "first_token": None if first is None else first + offset,
            "last_token": None if last is None else last + offset,
            "detokenized": now,
        }

    def chunk(self, visible: tuple[str, int, int] | None = None) -> GenerateChunk:
        """The sequence's output now: cumulative, or only what is new since the last chunk
        when the request streams incrementally. Marks what it returns as sent."""
        request = self.request
        final = self.finish is not None
        text, num_ids, num_lp = visible or self.visible()
        if not request.params.detokenize:
            text = ""  # vLLM's detokenize=false: token ids only
        incremental = request.stream and request.incremental
        # Tokens taken back after they were sent (only when the grammar gives no committed
        # count) cannot be unsent: start from the current end rather than past it.
        start_text = min(self.sent_text, len(text)) if incremental else 0
        start_ids = min(self.sent_ids, num_ids) if incremental else 0
        # Streamed logprobs are always only the new tokens' (SGLang's), with the running count
        # in output_token_logprobs_length: resending every list each chunk is quadratic.
        start_lp = min(self.sent_logprobs, num_lp) if request.stream else 0
        options = request.logprobs
        out: dict[str, Any] = {}
        if self.grammar is not None:
            out["grammar"] = self.grammar
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
        if request.return_hidden_states:
            entries = self._hidden(num_ids)
            # Streamed: only the entries not sent yet (the prompt's rows come once).
            start_hidden = min(self.sent_hidden, len(entries)) if request.stream else 0
            out["hidden_states"] = tuple(entries[start_hidden:])
            self.sent_hidden = len(entries)
        start_routed = request.routed_experts_start
        if start_routed is not None and final:
            # Every position the model ran on: the prompt and the output but its last token.
            end = len(request.prompt_ids) + num_ids - 1
            rows = self.routed[start_routed:end] if self.routed is not None else None
            out["extra"] = {
                "routed_experts": None if rows is None else routed_experts.encode(rows),
                "routed_experts_start_len": start_routed,
            }
        extra = dict(out.get("extra") or {})
        if self.embedding is not None:
            extra["embedding"] = self.embedding
        extra["weight_version"] = self.weight_version  # SGLang's: which weights answered
        host, storage = self.cached_tiers
        if host or storage:  # part of the prefix came back from the hierarchical cache's tiers
            extra["cached_tokens_details"] = {
                "device": self.cached_tokens - host - storage,
                "host": host,
                "storage": storage,
            }
        if final:
            extra["timestamps"] = self._timestamps()
        out["extra"] = extra
        chunk = GenerateChunk(
            rid=request.rid,
            index=self.index,
            text=text[start_text:],
            output_ids=tuple(self.output.output_ids[start_ids:num_ids]),
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=num_ids,
            cached_tokens=self.cached_tokens,
            finish_reason=self.finish if final else None,
            e2e_latency=time.monotonic() - request.created,
            flat_logprobs=options.enabled and request.params.flat_logprobs,
            **out,  # empty unless the request asked for logprobs, hidden states, a grammar
        )
        self.sent_text = len(text)
        self.sent_ids = num_ids
        self.sent_logprobs = num_lp
        return chunk
