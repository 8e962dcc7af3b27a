"""The transfer threads: all network I/O of prefill/decode disaggregation, off the step loop.

Each disaggregated engine runs one thread that owns its ZeroMQ sockets. The step thread hands
it commands (`send`, `expect`, `abandon`: queued, then a byte on a pipe wakes it); it hands the
step thread events (`KVArrived`, `KVDelivered`, `TransferFailed`) through `notify`, which puts
them in the engine core's inbox. Every wait is bounded by `transfer_timeout`: past it the room
is given up on both sides and the request ends with finish reason abort, the message saying
which side waited for what.

`PrefillTransfer` binds the bootstrap port (a ROUTER): decode engines register rooms there, it
sends each room's K/V to the connection that registered it once the step thread has staged
it, and reports the decode side's receipt (a replica of a data-parallel prefill server sends
the rooms of the other replicas there: `protocol`). `DecodeTransfer` connects a DEALER to each
prefill engine its requests name, registers their rooms, receives the K/V and acknowledges it.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from radixlm.runtime.disaggregation.backends import StagedKV, TransferBackend
from radixlm.runtime.disaggregation.protocol import (
    Cancel,
    Failed,
    KVLayout,
    KVSent,
    Message,
    ProtocolError,
    Received,
    Redirect,
    Register,
    Registered,
    from_frame,
    to_frame,
)

logger = logging.getLogger("radixlm.runtime.disaggregation")

#: Longest sleep of a transfer thread with nothing to do (it wakes earlier for commands,
#: messages and deadlines).
_IDLE_S = 0.5
#: How long closing a socket waits for its last messages to go out.
_LINGER_MS = 500


# ------------------------------------------------------------------- events (to the core)


@dataclass(frozen=True)
class KVArrived:
    """decode: `room`'s prompt K/V (`data`, uint8 bytes) and first token are here."""

    room: int
    header: KVSent
    data: torch.Tensor


@dataclass(frozen=True)
class KVDelivered:
    """prefill: the decode engine has `room`'s K/V."""

    room: int


@dataclass(frozen=True)
class TransferFailed:
    """Either side: `room` was given up (`message` says why and what to check)."""

    room: int
    message: str


TransferEvent = KVArrived | KVDelivered | TransferFailed
Notify = Callable[[TransferEvent], None]


# ------------------------------------------------------------- commands (from the core)


@dataclass(frozen=True)
class _Send:
    header: KVSent
    staged: StagedKV


@dataclass(frozen=True)
class _Expect:
    room: int
    host: str
    port: int


@dataclass(frozen=True)
class _Abandon:
    room: int
    message: str


_STOP = object()


def tcp_address(host: str, port: int | None = None) -> str:
    """A ZeroMQ TCP address (an IPv6 host in brackets); without a port, the host's."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}" if port is None else f"tcp://{host}:{port}"


class _TransferThread(abc.ABC):
    """The loop both sides share: wait for a command, a message or the next deadline."""

    def __init__(self, name: str, backend: TransferBackend, timeout: float, notify: Notify):
        self.backend = backend
        self.timeout = timeout
        self._notify = notify
        self._context = zmq.Context()
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._sockets: list[zmq.Socket[Any]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (what is in flight is dropped) and free its sockets."""
        if self._thread.is_alive():
            self._post(_STOP)
            self._thread.join(timeout=10)
        self._close_pipe()
        if not self._thread.is_alive():  # (a hung thread keeps its sockets)
            for socket in self._sockets:
                socket.close(linger=_LINGER_MS)  # the last messages (cancellations) go out
            self._context.term()

    def _close_pipe(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _post(self, command: Any) -> None:
        self._commands.put(command)
        with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
            os.write(self._wake_write, b"\0")

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        self._sockets.append(socket)
        self._poller.register(socket, zmq.POLLIN)
        return socket

    def _run(self) -> None:
        try:
            while self._serve_once():
                pass
        except Exception:
            logger.exception("the disaggregation transfer thread failed")
            self._fail_all("the K/V transfer thread of this server failed (see its log)")

    def _serve_once(self) -> bool:
        wait = self._next_deadline() - time.monotonic()
        ready = dict(self._poller.poll(math.ceil(max(0.0, min(wait, _IDLE_S)) * 1000)))
        if self._wake_read in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_read, 4096)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is _STOP:  # what is left is given up (a staged file removed)
                self._fail_all("the server shut down")
                return False
            self._command(command)
        for socket in list(ready):
            if isinstance(socket, zmq.Socket):
                self._drain(socket)
        self._expire(time.monotonic())
        return True

    def _drain(self, socket: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._receive(socket, frames)
            except ProtocolError as error:
                logger.warning("ignored a message on the bootstrap connection: %s", error)

    def _event(self, event: TransferEvent) -> None:
        self._notify(event)

    # Each side's own part.

    @abc.abstractmethod
    def _command(self, command: Any) -> None:
        """Carry out a command of the step thread."""

    @abc.abstractmethod
    def _receive(self, socket: zmq.Socket[Any], frames: list[zmq.Frame]) -> None:
        """Take one message of a peer (ProtocolError: it is not one)."""

    @abc.abstractmethod
    def _expire(self, now: float) -> None:
        """Give up the rooms that waited longer than the timeout."""

    @abc.abstractmethod
    def _next_deadline(self) -> float:
        """When the next room times out (time.monotonic())."""

    @abc.abstractmethod
    def _fail_all(self, message: str) -> None:
        """Give up every room (the thread cannot go on)."""


# ----------------------------------------------------------------------------- prefill


@dataclass
class _Outgoing:
    """A room's staged K/V and when it was staged (then sent)."""

    header: KVSent
    staged: StagedKV
    since: float
    peer: bytes | None = None


@dataclass
class _Registration:
    peer: bytes
    since: float


class PrefillTransfer(_TransferThread):
    """The prefill side: the bootstrap listener and the K/V sender (see the module)."""

    def __init__(
        self,
        host: str,
        port: int,
        layout: KVLayout,
        backend: TransferBackend,
        timeout: float,
        notify: Notify,
        replica_ports: tuple[int, ...] = (),
    ) -> None:
        """`replica_ports`: the bootstrap ports of every replica of a data-parallel prefill
        server, `port` among them (empty: this engine serves alone)."""
        super().__init__("radixlm-kv-prefill", backend, timeout, notify)
        self.layout = layout
        self.replica_ports = replica_ports
        self._rank = replica_ports.index(port) if replica_ports else 0
        self._router = self._socket(zmq.ROUTER)
        # Sending to a decode engine that went away fails at once instead of vanishing.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if port == 0:
                self.port = self._router.bind_to_random_port(tcp_address(host))
            else:
                self._router.bind(tcp_address(host, port))
                self.port = port
        except zmq.ZMQError as error:
            self._context.destroy(linger=0)
            self._close_pipe()
            raise OSError(
                f"cannot listen for decode servers on {host}:{port} ({error}): another "
                "server may hold the port; pick another --disaggregation-bootstrap-port"
            ) from None
        self.host = host
        self._registered: dict[int, _Registration] = {}
        self._waiting: dict[int, _Outgoing] = {}  # staged, no registration yet
        self._in_flight: dict[int, _Outgoing] = {}  # sent, no receipt yet
        #: Rooms given up (message, when): a late registration or K/V hears why at once.
        self._gone: dict[int, tuple[str, float]] = {}
        self.start()

    # The step thread's side.

    @property
    def unregistered(self) -> int:
        """Rooms whose K/V is staged while no decode engine has registered them (read from
        the step thread: the length of a dict the transfer thread changes, a snapshot)."""
        return len(self._waiting)

    def send(self, header: KVSent, staged: StagedKV) -> None:
        """Send `header.room`'s staged K/V to the decode engine that registers the room (now,
        or when it does); `KVDelivered` or `TransferFailed` follows."""
        self._post(_Send(header, staged))

    def abandon(self, room: int, message: str) -> None:
        """The prefill side's request for `room` ended without its K/V delivered: drop what
        is staged, tell the decode engine (now, or when it registers)."""
        self._post(_Abandon(room, message))

    # The thread's side.

    def _command(self, command: Any) -> None:
        match command:
            case _Send(header, staged):
                room = header.room
                gone = self._gone.get(room)
                if gone is not None:
                    self.backend.discard(staged)
                    self._event(TransferFailed(room, gone[0]))
                    return
                self._waiting[room] = _Outgoing(header, staged, time.monotonic())
                if room in self._registered:
                    self._transmit(room)
            case _Abandon(room, message):
                self._give_up(room, message, notify=False)

    def _receive(self, socket: zmq.Socket[Any], frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            raise ProtocolError("a message without a header frame")
        peer = frames[0].bytes
        message = from_frame(frames[1].bytes)
        match message:
            case Register(room, layout, backend):
                self._register(peer, room, layout, backend)
            case Received(room):
                outgoing = self._in_flight.pop(room, None)
                self._registered.pop(room, None)
                if outgoing is not None:
                    self.backend.discard(outgoing.staged)
                    self._event(KVDelivered(room))
            case Cancel(room, reason):
                self._registered.pop(room, None)
                self._give_up(room, f"the decode server gave up bootstrap_room {room}: {reason}")
            case _:
                raise ProtocolError(f"a prefill server does not take {type(message).__name__}")

    def _register(self, peer: bytes, room: int, layout: KVLayout, backend: str) -> None:
        ports = self.replica_ports or None
        if ports is not None and room % len(ports) != self._rank:
            self._reply(peer, Redirect(room, ports))  # another replica prefills it
            return
        refusal = None
        if backend != self.backend.name:
            refusal = (
                f"the decode server uses transfer backend {backend} and the prefill server "
                f"{self.backend.name}: start both with the same --disaggregation-transfer-backend"
            )
        elif (differences := self.layout.mismatch(layout)) is not None:
            refusal = (
                f"the prefill and decode servers' K/V differ ({differences}, prefill vs "
                "decode): both must serve the same model with the same --kv-cache-dtype"
            )
        elif room in self._gone:
            refusal = self._gone[room][0]
        elif room in self._registered and self._registered[room].peer != peer:
            self._reply(peer, Failed(room, f"bootstrap_room {room} is registered already"))
            return
        if refusal is not None:
            self._reply(peer, Failed(room, refusal))
            self._give_up(room, refusal)
            return
        self._registered[room] = _Registration(peer, time.monotonic())
        self._reply(peer, Registered(room, ports))
        if room in self._waiting:
            self._transmit(room)

    def _reply(self, peer: bytes, message: Message) -> bool:
        try:
            self._router.send_multipart([peer, to_frame(message)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # it went away (or stopped reading): it learns nothing more
            return False

    def _transmit(self, room: int) -> None:
        outgoing = self._waiting.pop(room)
        registration = self._registered[room]
        payload = self.backend.frames(outgoing.staged)
        frames = [registration.peer, to_frame(outgoing.header), *payload]
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as error:
            self._waiting[room] = outgoing  # given up just below, with the rest of the room
            self._give_up(
                room,
                f"the decode server that registered bootstrap_room {room} is gone (sending its "
                f"K/V failed: {error})",
            )
            return
        outgoing.since = time.monotonic()
        outgoing.peer = registration.peer
        self._in_flight[room] = outgoing

    def _give_up(self, room: int, message: str, notify: bool = True) -> None:
        """Drop everything of `room` and remember why (the decode engine hears it if it is
        registered or registers later; the step thread unless `notify` is False)."""
        for table in (self._waiting, self._in_flight):
            outgoing = table.pop(room, None)
            if outgoing is not None:
                self.backend.discard(outgoing.staged)
        registration = self._registered.pop(room, None)
        if registration is not None:
            self._reply(registration.peer, Failed(room, message))
        self._gone[room] = (message, time.monotonic())
        if notify:
            self._event(TransferFailed(room, message))

    def _expire(self, now: float) -> None:
        limit = self.timeout
        for room, outgoing in list(self._waiting.items()):
            if now - outgoing.since > limit:
                self._give_up(
                    room,
                    f"no decode server registered bootstrap_room {room} at this prefill "
                    f"server's bootstrap port {self.port} within {limit:g} s: the router must "
                    "send the request to a decode server too, with the same bootstrap_room and "
                    "bootstrap_host/bootstrap_port naming this server",
                )
        for room, outgoing in list(self._in_flight.items()):
            if now - outgoing.since > limit:
                self._give_up(
                    room,
                    f"the decode server did not confirm receiving bootstrap_room {room}'s K/V "
                    f"within {limit:g} s (it may have stopped)",
                )
        for room, registration in list(self._registered.items()):
            # The decode side cancels after its own timeout; this only clears what it left.
            if room not in self._in_flight and now - registration.since > 2 * limit:
                self._give_up(
                    room,
                    f"this prefill server got no request with bootstrap_room {room} within "
                    f"{2 * limit:g} s of its registration",
                    notify=False,
                )
        for room, (_message, since) in list(self._gone.items()):
            if now - since > 2 * limit:
                del self._gone[room]

    def _next_deadline(self) -> float:
        times = [o.since for o in self._waiting.values()]
        times += [o.since for o in self._in_flight.values()]
        return min(times, default=time.monotonic() + _IDLE_S) + self.timeout

    def _fail_all(self, message: str) -> None:
        for room in [*self._waiting, *self._in_flight]:
            self._give_up(room, message)


# ------------------------------------------------------------------------------ decode


@dataclass
class _Expected:
    """A room this decode engine waits for: the prefill server its request names (`server`),
    where it registered (that server, or the replica that prefills it), since when, and
    whether the prefill engine took the registration."""

    server: str
    endpoint: str
    since: float
    registered: bool = False
    socket: Any = field(default=None, repr=False)


class DecodeTransfer(_TransferThread):
    """The decode side: registrations at prefill engines and the K/V receiver (see the
    module)."""

    def __init__(
        self, layout: KVLayout, backend: TransferBackend, timeout: float, notify: Notify
    ) -> None:
        super().__init__("radixlm-kv-decode", backend, timeout, notify)
        self.layout = layout
        self._dealers: dict[str, zmq.Socket[Any]] = {}
        self._endpoints: dict[zmq.Socket[Any], str] = {}
        #: Each dealer's monitor: a closed connection fails the rooms registered over it.
        self._monitors: dict[zmq.Socket[Any], str] = {}
        self._expected: dict[int, _Expected] = {}
        #: The replicas' bootstrap ports of each data-parallel prefill server met (by the
        #: `host:port` requests name it with).
        self._replicas: dict[str, tuple[int, ...]] = {}
        self.start()

    # The step thread's side.

    def expect(self, room: int, host: str, port: int) -> None:
        """Register `room` at the prefill engine `host:port`; `KVArrived` or `TransferFailed`
        follows."""
        self._post(_Expect(room, host, port))

    def abandon(self, room: int, message: str) -> None:
        """The decode side's request for `room` ended before its K/V arrived: tell the
        prefill engine."""
        self._post(_Abandon(room, message))

    # The thread's side.

    def _dealer(self, endpoint: str) -> zmq.Socket[Any]:
        socket = self._dealers.get(endpoint)
        if socket is None:
            host, _, port = endpoint.rpartition(":")
            socket = self._socket(zmq.DEALER)
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._sockets.append(monitor)
            self._poller.register(monitor, zmq.POLLIN)
            self._monitors[monitor] = endpoint
            socket.connect(tcp_address(host, int(port)))
            self._dealers[endpoint] = socket
            self._endpoints[socket] = endpoint
        return socket

    def _command(self, command: Any) -> None:
        match command:
            case _Expect(room, host, port):
                server = f"{host}:{port}"
                ports = self._replicas.get(server)
                if ports is not None:  # straight to the replica that prefills it
                    port = ports[room % len(ports)]
                endpoint = f"{host}:{port}"
                socket = self._dealer(endpoint)
                self._expected[room] = _Expected(server, endpoint, time.monotonic(), socket=socket)
                self._send(socket, Register(room, self.layout, self.backend.name))
            case _Abandon(room, message):
                expected = self._expected.pop(room, None)
                if expected is not None:
                    self._send(expected.socket, Cancel(room, message))

    @staticmethod
    def _send(socket: zmq.Socket[Any], message: Message) -> None:
        # (Queued until connected; a full queue drops it: the timeout then speaks.)
        with contextlib.suppress(zmq.ZMQError):
            socket.send(to_frame(message), zmq.NOBLOCK)

    def _receive(self, socket: zmq.Socket[Any], frames: list[zmq.Frame]) -> None:
        if socket in self._monitors:
            event = parse_monitor_message([frame.bytes for frame in frames])
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected(self._monitors[socket])
            return
        endpoint = self._endpoints[socket]
        message = from_frame(frames[0].bytes)
        match message:
            case Registered(room, ports):
                expected = self._expected.get(room)
                if expected is not None:
                    expected.registered = True
                    if ports is not None:
                        self._replicas[expected.server] = ports
            case Redirect(room, ports):
                self._redirect(room, ports)
            case KVSent(room):
                self._arrived(socket, message, frames[1:])
            case Failed(room, reason):
                if self._expected.pop(room, None) is not None:
                    self._event(
                        TransferFailed(
                            room,
                            f"the prefill server at {endpoint} gave up bootstrap_room {room}: "
                            f"{reason}",
                        )
                    )
            case _:
                raise ProtocolError(f"a decode server does not take {type(message).__name__}")

    def _redirect(self, room: int, ports: tuple[int, ...]) -> None:
        """Another replica of the prefill server prefills `room`: register it there, and
        the server's later rooms at their replicas at once."""
        expected = self._expected.get(room)
        if expected is None:
            return
        self._replicas[expected.server] = ports
        host = expected.endpoint.rpartition(":")[0]
        endpoint = f"{host}:{ports[room % len(ports)]}"
        if endpoint == expected.endpoint:  # (a replica that disowns its own rooms)
            del self._expected[room]
            self._event(
                TransferFailed(
                    room,
                    f"the prefill server at {endpoint} sent bootstrap_room {room} back to "
                    "itself: its replicas disagree on their bootstrap ports (restart it)",
                )
            )
            return
        expected.endpoint = endpoint
        expected.socket = self._dealer(endpoint)
        self._send(expected.socket, Register(room, self.layout, self.backend.name))

    def _disconnected(self, endpoint: str) -> None:
        """The connection to `endpoint` closed: the rooms it took are lost there (a new
        connection is another peer to it), and what its server said of its replicas is
        forgotten (it may come back with others)."""
        host, _, port = endpoint.rpartition(":")
        for server, ports in list(self._replicas.items()):
            if server.rpartition(":")[0] == host and int(port) in ports:
                del self._replicas[server]
        for room, expected in list(self._expected.items()):
            if expected.endpoint == endpoint and expected.registered:
                del self._expected[room]
                self._event(
                    TransferFailed(
                        room,
                        f"the prefill server at {endpoint} closed the connection before sending "
                        f"bootstrap_room {room}'s K/V (it stopped or restarted)",
                    )
                )

    def _arrived(self, socket: zmq.Socket[Any], header: KVSent, frames: list[zmq.Frame]) -> None:
        room = header.room
        if self._expected.pop(room, None) is None:
            self._send(socket, Cancel(room, "no request waits for it on the decode server"))
            return
        try:
            data = self.backend.open(header.location, frames, header.nbytes)
        except (OSError, ValueError) as error:
            message = f"the decode server could not take bootstrap_room {room}'s K/V: {error}"
            self._send(socket, Cancel(room, message))
            self._event(TransferFailed(room, message))
            return
        self._send(socket, Received(room))
        self._event(KVArrived(room, header, data))

    def _expire(self, now: float) -> None:
        limit = self.timeout
        for room, expected in list(self._expected.items()):
            if now - expected.since <= limit:
                continue
            del self._expected[room]
            port = expected.endpoint.rpartition(":")[2]
            if expected.registered:
                message = (
                    f"the prefill server at {expected.endpoint} took the registration of "
                    f"bootstrap_room {room} but sent no K/V within {limit:g} s: check that the "
                    "router sent the request to that prefill server, and its log"
                )
            else:
                message = (
                    f"the prefill server's bootstrap endpoint {expected.endpoint} did not answer "
                    f"within {limit:g} s: check that a server runs there with "
                    f"--disaggregation-mode prefill and --disaggregation-bootstrap-port {port}, "
                    f"reachable from this decode server"
                )
            self._send(expected.socket, Cancel(room, f"it waited {limit:g} s for the K/V"))
            self._event(TransferFailed(room, message))

    def _next_deadline(self) -> float:
        times = [e.since for e in self._expected.values()]
        return min(times, default=time.monotonic() + _IDLE_S) + self.timeout

    def _fail_all(self, message: str) -> None:
        for room in list(self._expected):
            del self._expected[room]
            self._event(TransferFailed(room, message))
