"""EngineCore: the engine loop — commands in, schedule -> run -> process outputs, chunks out.

Runs on one thread (the engine's background thread). Front ends talk to it only through
`post(command)`; it talks back only through each request's sink. It never waits on I/O or on
grammar compilation: a request whose grammar is compiling simply stays in the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

from radixlm.runtime.executor import EntryInputs, InputLogprobAsk, ModelExecutor
from radixlm.runtime.grammar import GrammarService
from radixlm.runtime.request_state import END, RequestHandle, SequenceState
from radixlm.runtime.sampling_batch import SamplingRequest
from radixlm.runtime.scheduler import ReqStatus, ScheduledBatch, Scheduler
from radixlm.sampling import EngineOverloaded

logger = logging.getLogger("radixlm.runtime.engine")

#: Seconds between checks of compiling grammars while nothing else can run.
_GRAMMAR_POLL_S = 0.002

#: What appending one token did: the sequence goes on, it finished, or a grammar violation
#: took tokens back (the token was not kept).
Appended = Literal["ok", "finished", "rolled_back"]


class EngineCore:
    """The loop's state and one step of it. Not thread-safe except `post`."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: ModelExecutor,
        grammar: GrammarService,
        eos_token_ids: tuple[int, ...],
        context_length: int,
        jump_forward: bool = True,
        on_close: Callable[[str], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.jump_forward = jump_forward
        self.on_close = on_close
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._pending_adds = 0  # requests posted but not queued yet (read by front ends)
        self._pending_lock = threading.Lock()
        self.handles: dict[str, RequestHandle] = {}
        self._compiling: list[SequenceState] = []
        self._stopped = False
        # Statistics.
        self.generated_tokens = 0
        self.jump_forward_tokens = 0
        self.grammar_rollbacks = 0
        self.finished_requests = 0
        self.steps = 0

    # ---------------------------------------------------------------------------- commands

    def post(self, command: str, payload: Any = None) -> None:
        """Hand a command to the loop (thread-safe): add, abort, flush, call, stop."""
        if command == "add":
            with self._pending_lock:
                self._pending_adds += len(payload.seqs)
        self.inbox.put((command, payload))

    def backlog(self, incoming: int = 0) -> int:
        """Sequences that would have to wait if `incoming` more arrived: those queued or
        posted and not queued yet, beyond what the next step can admit (read by front ends
        on other threads: an estimate; the loop's `Scheduler.add` decides)."""
        with self._pending_lock:
            return self.scheduler.backlog(self._pending_adds + incoming)

    def serve(self) -> None:
        """Run until a `stop` command; every request still open then ends with an error."""
        while not self._stopped:
            try:
                self._drain(block=not self._has_work())
                if not self._stopped:
                    self.step()
            except Exception as error:  # a bug must not leave clients hanging forever
                logger.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_running(error)
        for handle in list(self.handles.values()):
            self._close_with_error(handle, RuntimeError("the engine was shut down"))

    def _has_work(self) -> bool:
        sched = self.scheduler
        return bool(sched.running) or any(not r.blocked() for r in sched.waiting)

    def _drain(self, block: bool) -> None:
        timeout = _GRAMMAR_POLL_S if self._compiling else None
        first = True
        while True:
            try:
                if first and block:
                    command, payload = self.inbox.get(timeout=timeout)
                else:
                    command, payload = self.inbox.get_nowait()
            except queue.Empty:
                return
            first = False
            self._handle(command, payload)

    def _handle(self, command: str, payload: Any) -> None:
        if command == "add":
            with self._pending_lock:
                self._pending_adds -= len(payload.seqs)
            self.add(payload)
        elif command == "abort":
            self.abort(payload)
        elif command == "flush":
            future: Future[bool] = payload
            future.set_result(self.scheduler.flush_cache())
        elif command == "call":
            function, result = payload
            try:
                result.set_result(function(self))
            except Exception as error:  # the caller gets it
                result.set_exception(error)
        elif command == "stop":
            self._stopped = True

    def add(self, handle: RequestHandle) -> None:
        """Queue every sequence of a request (or fail it when the queue is full)."""
        added = []
        try:
            for seq in handle.seqs:
                self.scheduler.add(seq.req)
                added.append(seq)
        except EngineOverloaded as error:
            for seq in added:
                self.scheduler.abort(seq.req)
            handle.fail(error)
            self._closed(handle)
            return
        self.handles[handle.rid] = handle
        self._compiling.extend(s for s in handle.seqs if s.req.grammar_pending)

    def abort(self, rid: str) -> bool:
        """End a request: its sequences finish with `abort`, all its memory is freed."""
        handle = self.handles.get(rid)
        if handle is None:
            return False
        for seq in handle.seqs:
            if seq.finish is None:
                self.scheduler.abort(seq.req)
                seq.output.abort("aborted by request")
                seq.dirty = True
        self._emit(handle)
        return True

    # -------------------------------------------------------------------------------- step

    def step(self) -> None:
        """One scheduling step (does nothing when nothing can run)."""
        self._poll_grammars()
        batch = self.scheduler.schedule()
        touched: dict[str, RequestHandle] = {}
        for req in batch.dropped:
            seq: SequenceState = req.payload
            seq.output.abort("the request does not fit in the KV cache")
            seq.dirty = True
            touched[seq.handle.rid] = seq.handle
        if batch.entries:
            self.steps += 1
            self._run(batch, touched)
        for handle in touched.values():
            self._emit(handle)

    def _run(self, batch: ScheduledBatch, touched: dict[str, RequestHandle]) -> None:
        sampling: list[SamplingRequest | None] = []
        asks: list[InputLogprobAsk | None] = []
        grammars: list[Any] = []
        inputs: list[EntryInputs | None] = []
        for entry in batch.entries:
            seq: SequenceState = entry.req.payload
            options = seq.handle.logprobs
            inputs.append(_entry_inputs(seq.handle))
            asks.append(
                InputLogprobAsk(options.top, options.token_ids)
                if entry.logprob_targets is not None
                else None
            )
            if entry.sample:
                sampling.append(self._sampling_request(seq))
                grammars.append(seq.grammar)
            else:
                sampling.append(None)
        result = self.executor.run(
            batch,
            sampling,
            asks,
            self.grammar.bitmask(grammars),
            inputs if any(inputs) else None,
        )
        self.scheduler.after_forward(batch)
        hidden = result.hidden_states or [None] * len(batch.entries)
        for entry, token, logprob, scored, rows in zip(
            batch.entries,
            result.tokens,
            result.logprobs,
            result.input_logprobs,
            hidden,
            strict=True,
        ):
            req = entry.req
            seq = req.payload
            if req.status is not ReqStatus.RUNNING:
                continue
            if rows is not None and seq.hidden_states is not None:
                seq.hidden_states.record(entry.prefix_len, rows)
            if entry.logprob_targets is not None:
                seq.record_input_logprobs(scored or [])
            if not entry.sample or token is None:
                continue
            touched[seq.handle.rid] = seq.handle
            seq.dirty = True
            if req.max_new_tokens == 0:  # prompt scoring: nothing is generated
                seq.output.finish_length()
            elif self._append(seq, token, logprob) == "ok" and self._can_jump(seq):
                self._jump_forward(seq)
            if seq.finish is not None:
                self._finish(seq)

    def _sampling_request(self, seq: SequenceState) -> SamplingRequest:
        handle = seq.handle
        return SamplingRequest(
            params=handle.params,
            prompt_ids=seq.req.prompt_ids,
            output_ids=seq.req.output_ids,
            eos_token_ids=self.eos_token_ids,
            bad_words_ids=seq.bad_words_ids,
            return_logprob=handle.logprobs.enabled,
            top_logprobs_num=handle.logprobs.top,
            token_ids_logprob=handle.logprobs.token_ids,
            custom_logit_processor=handle.custom_logit_processor,
            seed=seq.seed,
            forced_token_id=(
                None if seq.thinking is None else seq.thinking.forced_token(seq.req.output_ids)
            ),
        )

    def _append(self, seq: SequenceState, token: int, logprob: Any = None) -> Appended:
        """Add one token to a sequence (sampled or forced by the grammar)."""
        seq.record_output_logprob(logprob)
        grammar = seq.grammar
        if grammar is not None:
            if not grammar.accept_token(token):
                # A grammar that ran into its own limits says why (llguidance's lexer fuel).
                check = getattr(grammar, "violation", None)
                reason = check() if check is not None else None
                seq.output.abort(
                    reason.message
                    if reason is not None
                    else f"the grammar does not allow token {token}"
                )
                return "finished"
            check = getattr(grammar, "violation", None)
            violation = check() if check is not None else None
            if violation is not None:
                return self._violated(seq, violation)
        reason = seq.output.append(token)
        self.generated_tokens += 1
        if reason is None and seq.req.seq_len >= self.context_length:
            reason = seq.output.finish_length("the context length is reached")
        if reason is None and grammar is not None and grammar.is_terminated():
            seq.output.stop(matched=token)
        return "ok" if seq.finish is None else "finished"

    def _violated(self, seq: SequenceState, violation: Any) -> Appended:
        """A completed value broke a keyword the grammar validates: take back
        `violation.rollback` tokens (the one just accepted, which never reached the output, and
        those before it) and decode on from there; end the sequence when the grammar's retries
        are used up or the tokens cannot be taken back."""
        req = seq.req
        count = int(violation.rollback)
        earlier = count - 1  # output tokens to take back besides the one just accepted
        if violation.fatal:
            seq.output.abort(violation.message)
            return "finished"
        if count < 1 or not self.scheduler.can_rewind(req, earlier):
            seq.output.abort(
                f"{violation.message} (the output cannot be taken back {count} tokens to retry)"
            )
            return "finished"
        seq.grammar.rollback(count)
        seq.output.rollback(earlier)
        seq.truncate_logprobs(len(req.output_ids))
        # The last token kept is computed again: its logits choose the next token anew.
        self.scheduler.trim_kv(req, recompute_last=True)
        self.generated_tokens -= earlier
        self.grammar_rollbacks += 1
        seq.grammar_rollbacks += 1
        return "rolled_back"

    def _can_jump(self, seq: SequenceState) -> bool:
        return (
            self.jump_forward
            and seq.grammar is not None
            and not seq.handle.logprobs.enabled
            and seq.finish is None
        )

    def _jump_forward(self, seq: SequenceState) -> None:
        """Append the tokens the grammar forces; the next step computes them in one extend."""
        jump = seq.grammar.jump_forward()
        if jump is None or not jump.token_ids:
            return
        req = seq.req
        if jump.rollback:
            if not self.scheduler.can_rollback(req, jump.rollback):
                return
            seq.grammar.rollback(jump.rollback)
            seq.output.rollback(jump.rollback)
            self.scheduler.trim_kv(req)
            self.generated_tokens -= jump.rollback
        for token in jump.token_ids:
            self.jump_forward_tokens += 1
            if self._append(seq, token) != "ok":
                return

    def _finish(self, seq: SequenceState) -> None:
        finish = seq.finish
        if finish is not None and finish.type == "abort":
            self.scheduler.abort(seq.req)
        else:
            self.scheduler.finish(seq.req)

    # ------------------------------------------------------------------------------ grammar

    def _poll_grammars(self) -> None:
        if not self._compiling:
            return
        still: list[SequenceState] = []
        for seq in self._compiling:
            future = seq.grammar_future
            if seq.finish is not None:
                continue
            if not future.done():
                still.append(seq)
                continue
            try:
                compiled = future.result()
            except Exception as error:  # a GrammarError (InvalidRequest) for this request only
                self._close_with_error(seq.handle, self.grammar.explain(error))
                continue
            seq.grammar = self.grammar.matcher(compiled)
            seq.grammar_info = self.grammar.describe(compiled)
            seq.req.grammar_pending = False
        self._compiling = still

    # ------------------------------------------------------------------------------ output

    def _emit(self, handle: RequestHandle) -> None:
        """Send the request's new chunks; close it once every sequence finished."""
        if handle.closed:
            return
        for seq in handle.seqs:
            if not seq.dirty:
                continue
            if handle.stream or seq.finish is not None:
                due = seq.has_news(handle.stream_interval)
                if handle.stream and seq.finish is None and not due:
                    continue
                handle.sink(seq.chunk())
        if handle.finished:
            handle.closed = True
            handle.sink(END)
            self.finished_requests += 1
            self._closed(handle)

    def _close_with_error(self, handle: RequestHandle, error: BaseException) -> None:
        for seq in handle.seqs:
            if seq.finish is None:
                self.scheduler.abort(seq.req)
                seq.output.abort(str(error))
        handle.fail(error)
        self._closed(handle)

    def _closed(self, handle: RequestHandle) -> None:
        self.handles.pop(handle.rid, None)
        if self.on_close is not None:
            self.on_close(handle.rid)

    def _fail_running(self, error: BaseException) -> None:
        """After a failed step: end every running request with the error, free their memory."""
        failed = {req.payload.handle.rid: req.payload.handle for req in self.scheduler.running}
        for handle in failed.values():
            self._close_with_error(handle, RuntimeError(f"the engine step failed: {error}"))


def _entry_inputs(handle: RequestHandle) -> EntryInputs | None:
    """What the executor needs besides ids (None for a plain token request: no cost)."""
    if handle.input_embeds is None and not handle.return_hidden_states:
        return None
    return EntryInputs(handle.input_embeds, handle.return_hidden_states)
