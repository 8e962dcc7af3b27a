"""Per-request state in the engine core, and the deltas it sends the front end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.hidden_states import HiddenStates
from radixlm.runtime.logprobs import TokenLogprob
from radixlm.runtime.messages import EngineRequest, LogprobOptions, SeqDelta
from radixlm.runtime.pooling import PooledRows
from radixlm.runtime.routed_experts import RoutedTape
from radixlm.runtime.sampling_batch import SamplingRequest
from radixlm.runtime.scheduler import Req
from radixlm.runtime.stopping import TokenStops
from radixlm.runtime.thinking import ThinkingBudget
from radixlm.sampling import FinishReason, LogprobEntry, SamplingParams

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
    eos_token_ids: tuple[int, ...],
    grammar_future: Any,
    prefix_sharing: bool,
    lora: tuple[str, str] | None = None,
    default_seed: int | None = None,
) -> RequestHandle:
    """The engine-side state of a prepared request: one scheduler `Req` and stop conditions
    per sequence (`n > 1` siblings wait for the first one's prefill when the cache shares it).
    Sequence i samples from seed + i: the request's seed, else `default_seed` (deterministic
    inference), else none (a draw from the engine's generator, shared by the batch)."""
    handle = RequestHandle(request)
    params = request.params
    seed = params.seed if params.seed is not None else default_seed
    prompt_ids = list(request.prompt_ids)
    # Outputs go to the front end every step while it watches for stop strings.
    watch_text = bool(params.stop_strings or params.stop_regexes)
    hidden = request.return_hidden_states
    pooling = request.pooling
    # Every position is returned or pooled: none comes from the cache.
    every_row = hidden or (pooling is not None and pooling.method != "last")
    thinking_end = request.thinking_end
    first: Req | None = None
    for index in range(params.n):
        stops = TokenStops(params, eos_token_ids, request.max_new_tokens)
        req = Req(
            request.rid if params.n == 1 else f"{request.rid}#{index}",
            prompt_ids,
            request.max_new_tokens,
            input_logprob_start=request.logprobs.input_start,
            wait_for=first if prefix_sharing else None,
            stopper=stops,
            reuse_prefix=not every_row,
            # KV computed under an adapter is cached under its uid, apart from other adapters'.
            extra_key=lora[0] if lora is not None else None,
            lora=lora,
            priority=request.priority,
        )
        seq = SequenceState(
            handle,
            index,
            req,
            stops,
            watch_text=watch_text,
            seed=None if seed is None else seed + index,
            grammar_future=grammar_future,
            bad_words_ids=request.bad_words_ids,
            thinking=None
            if thinking_end is None or params.thinking_token_budget is None
            else ThinkingBudget(thinking_end, params.thinking_token_budget),
            hidden_states=HiddenStates(len(prompt_ids)) if hidden else None,
            routed=RoutedTape() if request.routed_experts_start is not None else None,
            pooled=None if pooling is None else PooledRows(pooling.method, len(prompt_ids)),  # type: ignore[arg-type]
        )
        seq.record_input_logprobs([])  # the first prompt token's entry has no logprob
        req.grammar_pending = req.rewindable = grammar_future is not None
        handle.seqs.append(seq)
        first = first or req
    return handle


@dataclass
class SequenceState:
    """One of a request's sequences in the core: its scheduler request, stop conditions and
    what the forward passes recorded for it (logprobs, hidden states), and how much of that
    the front end has."""

    handle: RequestHandle
    index: int
    req: Req
    stops: TokenStops
    #: Send a delta every step (the front end checks stop strings), not only as it streams.
    watch_text: bool = False
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
    routed: RoutedTape | None = None  # only when the request asked for its routed experts
    #: A pooling request's rows so far, then its result (`embedding`, sent once).
    pooled: PooledRows | None = None
    embedding: tuple[float, ...] | None = None
    sent_ids: int = 0
    sent_logprobs: int = 0
    sent_input: int = 0
    sent_hidden: int = 0
    #: The front end ended it (a stop string): nothing more is sent for it.
    quiet: bool = False
    dirty: bool = False
    #: Its sampling inputs, built once and reused every step while they hold (the output ids
    #: are the request's own list, so the object stays current as tokens are appended).
    sampling: SamplingRequest | None = None
    #: `time.monotonic()` of the step that first ran it, and of the steps that produced its
    #: first and (so far) last output token (the front end's timestamps and trace spans).
    scheduled_at: float | None = None
    #: What the executor needs besides its ids (prompt embeddings, hidden states, images,
    #: pooling; None for a plain token request), set when the request is opened.
    inputs: Any = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def finish(self) -> FinishReason | None:
        return self.stops.finish

    @property
    def grammar(self) -> Any:
        """The structured-output matcher (owned by the scheduler's request), or None."""
        return self.req.grammar

    @staticmethod
    def _entries(pairs: Sequence[tuple[int, float]]) -> Entries:
        return tuple(LogprobEntry(lp, tid) for tid, lp in pairs)

    def record_output_logprob(self, logprob: TokenLogprob | None) -> None:
        if not self.handle.logprobs.enabled or logprob is None:
            return
        self.output_logprobs.append(LogprobEntry(logprob.logprob, logprob.token_id))
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
            self.input_logprobs.append(LogprobEntry(None, self.req.prompt_ids[0]))
            self.input_top.append(None)
            self.input_ids_logprobs.append(None)
        for lp in scored:
            self.input_logprobs.append(LogprobEntry(lp.logprob, lp.token_id))
            self.input_top.append(self._entries(lp.top))
            self.input_ids_logprobs.append(self._entries(lp.requested))

    def _committed(self) -> int | None:
        """Output tokens that can no longer be taken back, when the grammar says (a grammar
        that validates completed values); None: every token is final once appended."""
        if self.grammar is None or self.finish is not None:
            return None
        committed = getattr(self.grammar, "committed", None)
        return None if committed is None else max(0, int(committed))

    def delta(self, weight_version: str = "default") -> SeqDelta:
        """What the front end does not have yet; marks it sent."""
        ids = self.req.output_ids
        stops = self.stops
        base = self.sent_ids
        if stops.rolled_back_to is not None:
            base = min(base, stops.rolled_back_to)
            stops.rolled_back_to = None
        extra: dict[str, Any] = {}
        if self.handle.logprobs.enabled:
            start = min(self.sent_logprobs, base)
            extra["output_logprobs"] = tuple(self.output_logprobs[start:])
            extra["output_top"] = tuple(self.output_top[start:])
            extra["output_ids_logprobs"] = tuple(self.output_ids_logprobs[start:])
            self.sent_logprobs = len(self.output_logprobs)
        if len(self.input_logprobs) > self.sent_input:
            start = self.sent_input
            extra["input_logprobs"] = tuple(self.input_logprobs[start:])
            extra["input_top"] = tuple(self.input_top[start:])
            extra["input_ids_logprobs"] = tuple(self.input_ids_logprobs[start:])
            self.sent_input = len(self.input_logprobs)
        if self.hidden_states is not None:
            entries = self.hidden_states.entries(len(ids))
            if len(entries) > self.sent_hidden:
                extra["hidden_states"] = tuple(entries[self.sent_hidden :])
                self.sent_hidden = len(entries)
        if self.routed is not None:
            extra["routed_experts"] = self.routed.take_new()
        if self.embedding is not None and self.finish is not None:
            extra["embedding"] = self.embedding
        if self.grammar_info is not None:
            extra["grammar"] = {**self.grammar_info, "rollbacks": self.req.grammar_rollbacks}
        if self.finish is not None or self.watch_text:
            extra["times"] = (self.scheduled_at, self.first_token_at, self.last_token_at)
        delta = SeqDelta(
            rid=self.handle.rid,
            index=self.index,
            new_ids=tuple(ids[base:]),
            rollback=self.sent_ids - base,
            finish=self.finish,
            cached_tokens=self.req.cached_tokens or 0,
            cached_tiers=(self.req.host_cached_tokens, self.req.storage_cached_tokens),
            weight_version=weight_version,
            committed=self._committed(),
            **extra,
        )
        self.sent_ids = len(ids)
        self.dirty = False
        return delta
