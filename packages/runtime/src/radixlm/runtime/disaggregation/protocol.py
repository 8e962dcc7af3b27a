"""The bootstrap protocol between a prefill engine and its decode engines: typed messages,
each one JSON frame on the wire (never pickles: the bootstrap port may face other machines),
the K/V bytes of a `KVSent` in the frame after it (tcp) or in shared memory (shm).

    decode -> prefill   Register(room, layout, backend)   "send room's K/V over this connection"
    prefill -> decode   Registered(room[, ports])         the registration is taken
    prefill -> decode   Redirect(room, ports)             register room at another replica's port
    prefill -> decode   KVSent(room, ...) [+ K/V bytes]   the prompt's K/V and first token
    decode -> prefill   Received(room)                    the K/V is here: the prefill finishes
    prefill -> decode   Failed(room, message)             the prefill side gave the room up
    decode -> prefill   Cancel(room, message)             the decode side gave the room up

A decode engine connects one ZeroMQ DEALER to each prefill engine's ROUTER (its bootstrap
port) and sends every message of the rooms it expects there; the prefill engine answers on
the same connection, so a decode engine listens on no port of its own.

A data-parallel prefill server (`--dp-size N`) runs N prefill engines, replica i listening on
`ports[i]` and prefilling the rooms with `room % N == i` (its router sends them there). A
decode engine registers each room at the port its request names; the replica there answers a
room of another replica with `Redirect(room, ports)`, and every `Registered` with the ports,
so that the decode engine registers later rooms of that server at their replica at once. A
lone prefill engine never sends `ports`: its frames are those of a server without replicas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlm.sampling import LogprobEntry

#: Bumped when a message changes shape; a peer speaking another version is refused.
PROTOCOL_VERSION = 1

Entries = tuple[LogprobEntry, ...]


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol (another program on the port, another
    version of radixlm)."""


@dataclass(frozen=True)
class KVLayout:
    """What a prompt's K/V looks like in an engine's KV pool: both sides must agree on it for
    the bytes of one to mean the same in the other."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def mismatch(self, other: KVLayout) -> str | None:
        """What differs from `other`, in words (None: they agree)."""
        differences = [
            f"{spec.name} {getattr(self, spec.name)} vs {getattr(other, spec.name)}"
            for spec in dataclasses.fields(self)
            if getattr(self, spec.name) != getattr(other, spec.name)
        ]
        return ", ".join(differences) or None


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    """A short hash of a prompt's token ids: the decode side checks that the K/V it gets is
    that of the prompt it has."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class FirstToken:
    """What the prefill computed besides the K/V: the first output token and the logprobs the
    request asked for (the decode side reports them as its own), and the prompt tokens its
    prefix cache held."""

    token_id: int
    cached_tokens: int = 0
    output_logprob: LogprobEntry | None = None
    output_top: Entries = ()
    output_ids_logprobs: Entries = ()
    input_logprobs: Entries = ()
    input_top: tuple[Entries | None, ...] = ()
    input_ids_logprobs: tuple[Entries | None, ...] = ()

    def to_json(self) -> dict[str, Any]:
        def entries(values: Entries | None) -> list[Any] | None:
            return None if values is None else [[e.logprob, e.token_id] for e in values]

        lp = self.output_logprob
        return {
            "token_id": self.token_id,
            "cached_tokens": self.cached_tokens,
            "output_logprob": None if lp is None else [lp.logprob, lp.token_id],
            "output_top": entries(self.output_top),
            "output_ids_logprobs": entries(self.output_ids_logprobs),
            "input_logprobs": entries(self.input_logprobs),
            "input_top": [entries(e) for e in self.input_top],
            "input_ids_logprobs": [entries(e) for e in self.input_ids_logprobs],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FirstToken:
        def entry(pair: Sequence[Any]) -> LogprobEntry:
            logprob, token_id = pair
            return LogprobEntry(None if logprob is None else float(logprob), int(token_id))

        def entries(values: list[Any] | None) -> Entries | None:
            return None if values is None else tuple(entry(p) for p in values)

        lp = data["output_logprob"]
        return cls(
            token_id=int(data["token_id"]),
            cached_tokens=int(data["cached_tokens"]),
            output_logprob=None if lp is None else entry(lp),
            output_top=entries(data["output_top"]) or (),
            output_ids_logprobs=entries(data["output_ids_logprobs"]) or (),
            input_logprobs=entries(data["input_logprobs"]) or (),
            input_top=tuple(entries(e) for e in data["input_top"]),
            input_ids_logprobs=tuple(entries(e) for e in data["input_ids_logprobs"]),
        )


# ------------------------------------------------------------------------------ messages


@dataclass(frozen=True)
class Register:
    """decode -> prefill: send `room`'s K/V over this connection when it is ready."""

    room: int
    layout: KVLayout
    backend: str


#: A field added to a message after version 1: left out of the frame while it is None, so
#: that the frames of a server that does not use it are what they were.
_LATER = {"later": True}


@dataclass(frozen=True)
class Registered:
    """prefill -> decode: the registration of `room` is taken; `bootstrap_ports` are the
    ports of the prefill server's replicas (None: it has none)."""

    room: int
    bootstrap_ports: tuple[int, ...] | None = field(default=None, metadata=_LATER)


@dataclass(frozen=True)
class Redirect:
    """prefill -> decode: `room` is prefilled by another replica of this data-parallel
    prefill server: register it at `bootstrap_ports[room % len(bootstrap_ports)]`, on the same
    host."""

    room: int
    bootstrap_ports: tuple[int, ...]


@dataclass(frozen=True)
class KVSent:
    """prefill -> decode: `room`'s prompt K/V (`nbytes` bytes, laid out `[K|V, layer, token,
    kv_head, head_dim bytes]`) follow in the next frame, or are at `location` (shm), with the
    first token."""

    room: int
    layout: KVLayout
    prompt_len: int
    prompt_digest: str
    nbytes: int
    first: FirstToken
    location: str | None = None


@dataclass(frozen=True)
class Received:
    """decode -> prefill: `room`'s K/V arrived whole; the prefill side's request finishes."""

    room: int


@dataclass(frozen=True)
class Failed:
    """prefill -> decode: the prefill side gave `room` up (the message says why)."""

    room: int
    message: str


@dataclass(frozen=True)
class Cancel:
    """decode -> prefill: the decode side gave `room` up (the message says why)."""

    room: int
    message: str


Message = Register | Registered | Redirect | KVSent | Received | Failed | Cancel

_TYPES: dict[str, type[Any]] = {
    "register": Register,
    "registered": Registered,
    "redirect": Redirect,
    "kv_sent": KVSent,
    "received": Received,
    "failed": Failed,
    "cancel": Cancel,
}
_NAMES = {kind: name for name, kind in _TYPES.items()}


def to_frame(message: Message) -> bytes:
    """One message as its JSON frame."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": _NAMES[type(message)]}
    for spec in dataclasses.fields(message):
        value = getattr(message, spec.name)
        if value is None and spec.metadata.get("later"):
            continue
        if isinstance(value, KVLayout):
            value = dataclasses.asdict(value)
        elif isinstance(value, FirstToken):
            value = value.to_json()
        elif isinstance(value, tuple):
            value = list(value)
        body[spec.name] = value
    return json.dumps(body, separators=(",", ":")).encode()


def _ports(value: Any) -> tuple[int, ...]:
    """A list of replicas' bootstrap ports, checked."""
    if not isinstance(value, list) or not value:
        raise ValueError("bootstrap_ports must be a non-empty list")
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in value):
        raise ValueError("bootstrap_ports must hold TCP ports")
    return tuple(value)


def from_frame(frame: bytes) -> Message:
    """The message of a JSON frame; raises ProtocolError for anything else."""
    try:
        body = json.loads(frame)
        if body.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"bootstrap protocol version {body.get('v')!r}; this server speaks "
                f"{PROTOCOL_VERSION} (run the same radixlm version on both servers)"
            )
        kind = _TYPES[body.pop("type")]
        del body["v"]
        if "layout" in body:
            body["layout"] = KVLayout(**body["layout"])
        if "first" in body:
            body["first"] = FirstToken.from_json(body["first"])
        if body.get("bootstrap_ports") is not None:
            body["bootstrap_ports"] = _ports(body["bootstrap_ports"])
        message: Message = kind(**body)
    except ProtocolError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ProtocolError(f"not a bootstrap message: {error}") from None
    if not isinstance(message.room, int):
        raise ProtocolError("not a bootstrap message: room must be an integer")
    return message
