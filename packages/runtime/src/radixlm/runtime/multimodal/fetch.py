"""Fetching an image or video URL for a request without letting it reach the server's own network.

A URL is fetched only when `MediaConfig.allow_urls` is set, and only over http or https. Each
hop (the URL and every redirect, at most `max_redirects`) is checked the same way: its host is
resolved once with `socket.getaddrinfo`, and the fetch is refused when any of the addresses is
loopback, link-local, private, multicast, reserved, unspecified or otherwise not globally
routable (IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry), unless
`url_allowlist` names the host or holds an address or CIDR block containing the address.

DNS rebinding: the connection goes to one of the addresses that were checked, never to a second
lookup of the name, so a resolver that answers differently on the next query cannot slip an
internal address in. The request still carries the URL's host in its Host header, and https
verifies the certificate against that host name (SNI), so virtual hosts and TLS work as usual.
Proxies from the environment are not used, because they would do their own lookup.

Limits: the whole fetch, all hops together, takes at most `fetch_timeout` seconds (a timer
shuts the socket at the deadline, so a server that sends a byte at a time cannot stretch it),
except the name lookup itself, which the system resolver bounds; the body is streamed and
refused past `max_bytes`, and a larger Content-Length is refused before reading.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from radixlm.runtime.config import MediaConfig
from radixlm.sampling import InvalidRequest

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
_HEADERS = {"User-Agent": "radixlm", "Accept": "image/*, video/*;q=0.9, */*;q=0.5"}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def short_url(url: str, limit: int = 100) -> str:
    """`url` cut to `limit` characters for error messages."""
    return url if len(url) <= limit else url[: limit - 1] + "…"


def fetch_url(url: str, config: MediaConfig, field: str) -> bytes:
    """GET `url` and return its body, within `config`'s limits.

    Raises InvalidRequest naming `field` when URLs are off, the URL or a redirect is refused
    (scheme, internal address, too many hops), the body is too large, or the fetch fails or
    times out. Mutates nothing; the bytes are the caller's.
    """
    if not config.allow_urls:
        raise InvalidRequest(
            field,
            f"is a URL ({short_url(url)}), and this server does not fetch URLs: send the "
            "media inline as base64 or a data URL, or start the server with --allow-media-urls",
        )
    allowlist = _Allowlist.parse(config.url_allowlist)
    deadline = time.monotonic() + config.fetch_timeout
    current = url
    for _ in range(config.max_redirects + 1):
        target = _Target.parse(current, field)
        addresses = _checked_addresses(target, allowlist, field)
        try:
            location, body = _get(target, addresses, config, deadline, field)
        except InvalidRequest:
            raise
        except (OSError, http.client.HTTPException, ValueError) as error:
            if isinstance(error, TimeoutError) or time.monotonic() >= deadline:
                raise InvalidRequest(
                    field,
                    f"fetching {short_url(url)} timed out after {config.fetch_timeout:g} s "
                    "(--media-fetch-timeout)",
                ) from None
            raise InvalidRequest(field, f"fetching {short_url(current)} failed: {error}") from None
        if location is None:
            return body
        current = urllib.parse.urljoin(current, location)
    raise InvalidRequest(
        field,
        f"{short_url(url)} redirects more than {config.max_redirects} times "
        "(--max-media-redirects); send the final URL or the media inline",
    )


@dataclass(frozen=True)
class _Target:
    """One hop: where to connect and what to ask for."""

    url: str
    https: bool
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str, field: str) -> _Target:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise InvalidRequest(
                field,
                f"{short_url(url)}: only http and https URLs are fetched, not "
                f"{parts.scheme or 'a relative URL'}",
            )
        try:
            port = parts.port
        except ValueError:
            raise InvalidRequest(field, f"{short_url(url)} has an invalid port") from None
        if not parts.hostname:
            raise InvalidRequest(field, f"{short_url(url)} names no host")
        https = parts.scheme == "https"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(url, https, parts.hostname, port or (443 if https else 80), path)


@dataclass(frozen=True)
class _Allowlist:
    """`url_allowlist` split into host names and networks (an address is a one-address network)."""

    names: frozenset[str]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @classmethod
    def parse(cls, entries: Sequence[str]) -> _Allowlist:
        names: set[str] = set()
        networks = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                names.add(entry.strip().lower().rstrip("."))
        return cls(frozenset(names), tuple(networks))

    def admits(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks)


def _internal_kind(address: IPAddress) -> str | None:
    """What makes `address` internal to the server's network, or None for a public address."""
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if address.is_global else "not globally routable"


def _as_ip(address: str) -> IPAddress:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _checked_addresses(target: _Target, allowlist: _Allowlist, field: str) -> list[str]:
    """The host's addresses, all of them allowed; raises InvalidRequest for a refused one."""
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise InvalidRequest(
            field,
            f"fetching {short_url(target.url)} failed: cannot resolve {target.host} ({error})",
        ) from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if target.host.rstrip(".") in allowlist.names:
        return addresses
    for address in addresses:
        ip = _as_ip(address)
        kind = _internal_kind(ip)
        if kind is not None and not allowlist.admits(ip):
            raise InvalidRequest(
                field,
                f"{short_url(target.url)} resolves to {ip}, a {kind} address, and this server "
                "fetches only public addresses unless --media-url-allowlist names the host or "
                "its network",
            )
    return addresses


class _PinnedConnection(http.client.HTTPConnection):
    """Connects to checked addresses only, while Host and TLS still name the URL's host."""

    def __init__(self, target: _Target, addresses: list[str], deadline: float) -> None:
        super().__init__(target.host, target.port)
        self.default_port = 443 if target.https else 80  # no ":443" in the Host header
        self._addresses = addresses
        self._deadline = deadline
        self._tls = ssl.create_default_context() if target.https else None
        self.opened: socket.socket | None = None

    def connect(self) -> None:
        last_error: OSError = OSError("no address to connect to")
        for address in self._addresses:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out")
            try:
                self.sock = socket.create_connection((address, self.port), remaining)
                break
            except OSError as error:
                last_error = error
        else:
            raise last_error
        if self._tls is not None:
            self.sock = self._tls.wrap_socket(self.sock, server_hostname=self.host)
        # getresponse() drops self.sock when the server closes after the body; keep it for _shut.
        self.opened = self.sock


def _shut(connection: _PinnedConnection) -> None:
    """At the deadline: wake whatever read is blocked on the connection's socket."""
    if connection.opened is not None:
        with contextlib.suppress(OSError):  # already closed
            # The plain socket's shutdown, also under TLS: the reader then sees the end.
            socket.socket.shutdown(connection.opened, socket.SHUT_RDWR)


def _get(
    target: _Target, addresses: list[str], config: MediaConfig, deadline: float, field: str
) -> tuple[str | None, bytes]:
    """One GET: (the redirect's Location, b"") or (None, the body)."""
    connection = _PinnedConnection(target, addresses, deadline)
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (connection,))
    timer.daemon = True
    timer.start()
    try:
        connection.request("GET", target.path, headers=_HEADERS)
        response = connection.getresponse()
        if response.status in _REDIRECT_STATUSES:
            location = response.getheader("Location")
            if not location:
                raise InvalidRequest(
                    field, f"{short_url(target.url)} redirects ({response.status}) to nowhere"
                )
            return location, b""
        if response.status // 100 != 2:
            raise InvalidRequest(
                field,
                f"fetching {short_url(target.url)} failed: HTTP {response.status} "
                f"{response.reason}",
            )
        body = _read_body(response, target, config, field)
        if time.monotonic() >= deadline:  # the timer cut the body short
            raise TimeoutError("timed out")
        return None, body
    finally:
        timer.cancel()
        connection.close()


def _read_body(
    response: http.client.HTTPResponse, target: _Target, config: MediaConfig, field: str
) -> bytes:
    too_large = (
        f"{short_url(target.url)} is larger than {config.max_bytes} bytes (--max-media-bytes); "
        "send a smaller file"
    )
    length = response.getheader("Content-Length", "")
    if length.isdigit() and int(length) > config.max_bytes:
        raise InvalidRequest(field, too_large)
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read1(_CHUNK_BYTES):
        size += len(chunk)
        if size > config.max_bytes:
            raise InvalidRequest(field, too_large)
        chunks.append(chunk)
    return b"".join(chunks)
