"""The engine core's side of prefill/decode disaggregation: which of its requests wait for
what, and the hooks its step loop calls (all on the step thread).

A prefill engine runs a disaggregated request as usual, its prefix cache and chunked prefill
included, limited to one output token (the preparer's doing). In the step that samples that
token its prompt's K/V is copied out of the pool (`capture`, before the update phase ends the
request and caches its prompt), then handed with the token and its logprobs to the transfer
thread (`after_update`). The request's last chunk is held back (`holds`) until the decode
engine confirms the K/V; a failure ends it with finish reason abort instead.

A decode engine does not queue a disaggregated request: it registers the request's room at
its prefill engine (`take`) and keeps it aside until the K/V comes (`on_event`). Then, between
steps (`admit`), the request gets a running place and KV slots, the K/V is written into them,
and its first token is appended as the update phase appends a sampled one: from the next step
on it decodes like any request, and its first chunk carries that token.

Each hook returns the requests it settled as `(handle, None)` (emit what it has) or
`(handle, message)` (abort it with the message); the core does that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from radixlm.runtime.config import DisaggregationConfig
from radixlm.runtime.disaggregation.backends import StagedKV, create_backend
from radixlm.runtime.disaggregation.kv import kv_nbytes, pool_layout, read_kv, write_kv
from radixlm.runtime.disaggregation.protocol import (
    FirstToken,
    KVLayout,
    KVSent,
    prompt_digest,
)
from radixlm.runtime.disaggregation.transfer import (
    DecodeTransfer,
    KVArrived,
    KVDelivered,
    Notify,
    PrefillTransfer,
    TransferEvent,
    TransferFailed,
)
from radixlm.runtime.memory import KVPool
from radixlm.runtime.messages import EngineRequest
from radixlm.runtime.request_state import RequestHandle, SequenceState
from radixlm.runtime.scheduler import ScheduledBatch, Scheduler
from radixlm.sampling import InvalidRequest

#: What a hook settled: a request to emit (None) or to abort with the message.
Outcome = tuple[RequestHandle, str | None]


class Disaggregation(Protocol):
    """The hooks of the engine core (see the module); the prefill and the decode side each
    do their part and nothing in the other's."""

    @property
    def mode(self) -> str: ...

    def check(self, request: EngineRequest) -> None:
        """Raise InvalidRequest when the request's room is in use on this engine."""
        ...

    def take(self, handle: RequestHandle) -> bool:
        """A disaggregated request opens: True when the side keeps it out of the queue (the
        decode side, until its K/V comes)."""
        ...

    def capture(self, batch: ScheduledBatch, tokens: Sequence[int | None]) -> None:
        """After the forward, before the update phase: copy out what it computed."""
        ...

    def after_update(self) -> None:
        """After the update phase: hand on what `capture` copied."""
        ...

    def holds(self, handle: RequestHandle) -> bool:
        """Whether the request's last chunk waits for its transfer."""
        ...

    def on_event(self, event: TransferEvent) -> list[Outcome]:
        """Take an event of the transfer thread."""
        ...

    def admit(self) -> list[Outcome]:
        """Before a step: start what can start now."""
        ...

    def abort(self, handle: RequestHandle, message: str) -> None:
        """The request is aborted (the core ends its unfinished sequences)."""
        ...

    def forget(self, handle: RequestHandle) -> None:
        """The request is closed: drop it, and tell the peer if it still counts on it."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]:
        """The static server info's `disaggregation` entry."""
        ...

    def close(self) -> None:
        """Stop the transfer thread."""
        ...


def _room(handle: RequestHandle) -> int:
    bootstrap = handle.request.bootstrap
    assert bootstrap is not None, "a disaggregated request has its bootstrap fields"
    return bootstrap.room


def _room_in_use(room: int) -> InvalidRequest:
    return InvalidRequest(
        "bootstrap_room",
        f"bootstrap_room {room} is in use by another request on this server; a router gives "
        "each request a fresh random room",
    )


class PrefillSide:
    """A prefill engine's part (see the module)."""

    mode = "prefill"

    def __init__(
        self, config: DisaggregationConfig, pool: KVPool, layout: KVLayout, notify: Notify
    ) -> None:
        self.config = config
        self.pool = pool
        self.layout = layout
        self.backend = create_backend(config.transfer_backend)
        self.transfer = PrefillTransfer(
            config.bootstrap_host,
            config.bootstrap_port,
            layout,
            self.backend,
            config.transfer_timeout,
            notify,
            config.bootstrap_ports,
        )
        self._open: dict[int, SequenceState] = {}  # room -> its sequence, while it is open
        self._rooms: dict[str, int] = {}  # rid -> room
        self._staged: list[tuple[int, StagedKV]] = []  # copied out in this step
        self._sending: set[int] = set()  # handed to the transfer thread, no outcome yet
        self._delivered: set[int] = set()

    def check(self, request: EngineRequest) -> None:
        if request.bootstrap is None:
            return
        room = request.bootstrap.room
        if room in self._open:
            raise _room_in_use(room)
        ports = self.config.bootstrap_ports
        if ports and room % len(ports) != ports.index(self.transfer.port):
            # Decode engines register the room at replica room % N: it would wait there.
            raise InvalidRequest(
                "bootstrap_room",
                f"bootstrap_room {room} belongs to replica {room % len(ports)} of this "
                f"data-parallel prefill server (this is replica "
                f"{ports.index(self.transfer.port)} of {len(ports)}): send requests to the "
                "server, whose router picks the replica",
            )

    def take(self, handle: RequestHandle) -> bool:
        room = _room(handle)
        self._open[room] = handle.seqs[0]
        self._rooms[handle.rid] = room
        return False

    def capture(self, batch: ScheduledBatch, tokens: Sequence[int | None]) -> None:
        for entry, token in zip(batch.entries, tokens, strict=True):
            room = self._rooms.get(entry.req.rid)
            if room is None or token is None or not entry.sample:
                continue
            prompt = len(entry.req.prompt_ids)
            staged = self.backend.stage(room, kv_nbytes(self.pool, prompt))
            read_kv(self.pool, entry.req.kv_slots[:prompt], staged.data)
            self._staged.append((room, staged))

    def after_update(self) -> None:
        staged, self._staged = self._staged, []
        for room, data in staged:
            seq = self._open.get(room)
            finish = seq.finish if seq is not None else None
            # Not finished: a grammar took the token back (it samples again); aborted: the
            # core closes it and `forget` tells the decode side.
            if seq is None or finish is None or finish.type == "abort" or not seq.req.output_ids:
                self.backend.discard(data)
                continue
            prompt = seq.req.prompt_ids
            header = KVSent(
                room=room,
                layout=self.layout,
                prompt_len=len(prompt),
                prompt_digest=prompt_digest(prompt),
                nbytes=data.data.numel(),
                first=_first_token(seq),
                location=data.location,
            )
            self.transfer.send(header, data)
            self._sending.add(room)

    def holds(self, handle: RequestHandle) -> bool:
        room = self._rooms.get(handle.rid)
        return room is not None and room in self._sending

    def on_event(self, event: TransferEvent) -> list[Outcome]:
        seq = self._open.get(event.room)
        if seq is None:
            return []
        match event:
            case KVDelivered(room):
                if room not in self._sending:
                    return []
                self._sending.discard(room)
                self._delivered.add(room)
                return [(seq.handle, None)]
            case TransferFailed(room, message):
                return [(seq.handle, f"prefill server: {message}")]
        return []

    def admit(self) -> list[Outcome]:
        return []

    def abort(self, handle: RequestHandle, message: str) -> None:
        room = self._rooms.get(handle.rid)
        if room is not None and room in self._sending:
            # Its token is computed but the decode side never got it: it did not finish.
            self._sending.discard(room)
            seq = self._open[room]
            seq.stops.abort(message)
            seq.dirty = True

    def forget(self, handle: RequestHandle) -> None:
        room = self._rooms.pop(handle.rid, None)
        if room is None:
            return
        seq = self._open.pop(room)
        self._sending.discard(room)
        if room in self._delivered:
            self._delivered.discard(room)
            return
        finish = seq.finish
        reason = (
            finish.message
            if finish is not None and finish.message
            else "the request ended on the prefill server before its K/V was sent"
        )
        self.transfer.abandon(room, reason)

    def stats(self) -> dict[str, Any]:
        # SGLang's names: requests prefilled whose decode engine has not registered them yet
        # (SGLang keeps them from the prefill until then; this engine from the sending),
        # and requests whose K/V is on its way or waits for the decode engine's receipt.
        unregistered = min(self.transfer.unregistered, len(self._sending))
        return {
            "num_prefill_prealloc_queue_reqs": unregistered,
            "num_prefill_inflight_queue_reqs": len(self._sending) - unregistered,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "transfer_backend": self.backend.name,
            "bootstrap_host": self.transfer.host,
            "bootstrap_port": self.transfer.port,
            # Every replica's, in replica order (this engine's alone without replicas).
            "bootstrap_ports": list(self.config.bootstrap_ports or (self.transfer.port,)),
            "transfer_timeout": self.config.transfer_timeout,
        }

    def close(self) -> None:
        self.transfer.close()


def _first_token(seq: SequenceState) -> FirstToken:
    """What the decode side needs of a prefill's output besides the K/V."""
    logprob = seq.output_logprobs[0] if seq.output_logprobs else None
    return FirstToken(
        token_id=seq.req.output_ids[0],
        cached_tokens=seq.req.cached_tokens or 0,
        output_logprob=logprob,
        output_top=seq.output_top[0] if seq.output_top else (),
        output_ids_logprobs=seq.output_ids_logprobs[0] if seq.output_ids_logprobs else (),
        input_logprobs=tuple(seq.input_logprobs),
        input_top=tuple(seq.input_top),
        input_ids_logprobs=tuple(seq.input_ids_logprobs),
    )


class DecodeSide:
    """A decode engine's part (see the module)."""

    mode = "decode"

    def __init__(
        self,
        config: DisaggregationConfig,
        scheduler: Scheduler,
        pool: KVPool,
        layout: KVLayout,
        notify: Notify,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.pool = pool
        self.layout = layout
        self.backend = create_backend(config.transfer_backend)
        self.transfer = DecodeTransfer(layout, self.backend, config.transfer_timeout, notify)
        self._rooms: dict[str, int] = {}  # rid -> room, while the request is open
        self._waiting: dict[int, SequenceState] = {}  # registered, no K/V yet
        self._arrived: dict[int, tuple[SequenceState, KVArrived]] = {}  # first come, first in

    def check(self, request: EngineRequest) -> None:
        room = request.bootstrap.room if request.bootstrap is not None else None
        if room is not None and (room in self._waiting or room in self._arrived):
            raise _room_in_use(room)

    def take(self, handle: RequestHandle) -> bool:
        bootstrap = handle.request.bootstrap
        assert bootstrap is not None and bootstrap.host is not None and bootstrap.port is not None
        self._rooms[handle.rid] = bootstrap.room
        self._waiting[bootstrap.room] = handle.seqs[0]
        self.transfer.expect(bootstrap.room, bootstrap.host, bootstrap.port)
        return True

    def capture(self, batch: ScheduledBatch, tokens: Sequence[int | None]) -> None:
        return None

    def after_update(self) -> None:
        return None

    def holds(self, handle: RequestHandle) -> bool:
        return False

    def on_event(self, event: TransferEvent) -> list[Outcome]:
        match event:
            case KVArrived(room, header):
                seq = self._waiting.pop(room, None)
                if seq is None:
                    return []
                problem = self._refusal(seq, header)
                if problem is not None:
                    return [(seq.handle, f"decode server: {problem}")]
                self._arrived[room] = (seq, event)
            case TransferFailed(room, message):
                seq = self._waiting.get(room)
                if seq is not None:
                    return [(seq.handle, f"decode server: {message}")]
        return []

    def _refusal(self, seq: SequenceState, header: KVSent) -> str | None:
        """Why the K/V that came cannot serve the request (None: it can)."""
        prompt = seq.req.prompt_ids
        differences = self.layout.mismatch(header.layout)
        if differences is not None:
            return (
                f"the prefill and decode servers' K/V differ ({differences}, decode vs "
                "prefill): both must serve the same model with the same --kv-cache-dtype"
            )
        if header.prompt_len != len(prompt) or header.prompt_digest != prompt_digest(prompt):
            return (
                f"the prefill server computed another prompt for bootstrap_room {header.room} "
                f"({header.prompt_len} tokens; {len(prompt)} here): both servers must get the "
                "same request and tokenize it alike (same model, tokenizer and chat template)"
            )
        if header.nbytes != kv_nbytes(self.pool, len(prompt)):
            return f"the K/V holds {header.nbytes} bytes, not {kv_nbytes(self.pool, len(prompt))}"
        return None

    def admit(self) -> list[Outcome]:
        settled: list[Outcome] = []
        for room, (seq, event) in list(self._arrived.items()):
            req = seq.req
            if req.grammar_pending:
                continue  # it joins once its grammar is compiled
            slots = self.scheduler.admit_prefilled(req)
            if slots is None:
                if not self.scheduler.running:  # nothing to wait for: it never fits
                    del self._arrived[room]
                    settled.append(
                        (
                            seq.handle,
                            f"decode server: the prompt's K/V ({len(req.prompt_ids)} tokens) "
                            "does not fit in this server's KV cache; give it more "
                            "(--max-total-tokens, --mem-fraction-static) or send shorter prompts",
                        )
                    )
                    continue
                break  # first come, first in: the others wait too
            del self._arrived[room]
            write_kv(self.pool, slots, event.data)
            self._join(seq, event.header.first)
            settled.append((seq.handle, None))
        return settled

    def _join(self, seq: SequenceState, first: FirstToken) -> None:
        """The request's prompt is in its slots: report what the prefill computed as its own
        and append its first token."""
        req = seq.req
        req.cached_tokens = first.cached_tokens  # the prefill server's prefix hit
        if seq.handle.logprobs.input_start is not None:
            seq.input_logprobs[:] = first.input_logprobs
            seq.input_top[:] = first.input_top
            seq.input_ids_logprobs[:] = first.input_ids_logprobs
        if seq.handle.logprobs.enabled and first.output_logprob is not None:
            seq.output_logprobs.append(first.output_logprob)
            seq.output_top.append(first.output_top)
            seq.output_ids_logprobs.append(first.output_ids_logprobs)
        now = time.monotonic()
        seq.scheduled_at = seq.first_token_at = seq.last_token_at = now
        self.scheduler.append_prefilled(req, first.token_id)
        if len(seq.output_logprobs) > len(req.output_ids):  # a grammar took it back
            seq.truncate_logprobs(len(req.output_ids))
        seq.dirty = True

    def abort(self, handle: RequestHandle, message: str) -> None:
        return None

    def forget(self, handle: RequestHandle) -> None:
        room = self._rooms.pop(handle.rid, None)
        if room is None:
            return
        self._arrived.pop(room, None)
        seq = self._waiting.pop(room, None)
        if seq is not None:  # the prefill side still counts on it
            finish = seq.finish
            reason = finish.message if finish is not None and finish.message else "it ended"
            self.transfer.abandon(room, reason)

    def stats(self) -> dict[str, Any]:
        # SGLang's names: waiting for their K/V, and arrived but waiting for KV slots.
        return {
            "num_decode_transfer_queue_reqs": len(self._waiting),
            "num_decode_prealloc_queue_reqs": len(self._arrived),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "transfer_backend": self.backend.name,
            "transfer_timeout": self.config.transfer_timeout,
        }

    def close(self) -> None:
        self.transfer.close()


def create_side(
    config: DisaggregationConfig,
    scheduler: Scheduler,
    pool: KVPool,
    architecture: str,
    notify: Notify,
) -> Disaggregation:
    """The side `config.mode` names, its transfer thread started (a prefill side listens on
    its bootstrap port: OSError when it cannot)."""
    layout = pool_layout(pool, architecture)
    if config.mode == "prefill":
        return PrefillSide(config, pool, layout, notify)
    if config.mode == "decode":
        return DecodeSide(config, scheduler, pool, layout, notify)
    raise ValueError(f"disaggregation_mode {config.mode!r} has no side")
