"""Fetching a chat message's image URL without letting it reach the server's own network.

chat_requests.md, "Images": every hop (the URL and each redirect) resolves its host once, is refused
when any resolved address is not public, and connects to the checked address itself, sending the
URL's host as the Host header and, over https, as the TLS server name. Resolving only once closes
the DNS-rebinding gap: a name that answers a public address to the check and a private one to the
connection never gets that second question. A name with several addresses (AAAA and A, or several
A) is connected to at each of them in DNS order until one connects, as browsers, curl and requests
do: every one was checked, and a single one that is not public refuses the whole name (ADR 0129).

Standard library only (socket, ssl, http.client): a third-party client resolves the name itself
when it connects, which is exactly the second lookup this module must not make.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import string
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import SplitResult, quote, urljoin, urlsplit

from contract.chat_limits import CHAT_IMAGE_FETCH_TOTAL_SECONDS

CHAT_IMAGE_FETCH_TIMEOUT_SECONDS = 2.0
CHAT_IMAGE_FETCH_MAX_REDIRECTS = 3
# Not the spec's: a whole fetch's bound (contract.chat_limits.CHAT_IMAGE_FETCH_TOTAL_SECONDS), so a
# server that drips a byte before each read timeout cannot hold a submit (docs/adr/0062).

USER_AGENT = "AI-Horde-chat-image-fetch/1.0 (+https://aihorde.net)"
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
_HOST_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-._")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# socket.getaddrinfo's shape: (family, type, proto, canonname, sockaddr).
Resolver = Callable[..., Sequence[tuple[Any, ...]]]


class ImageUrlRefused(Exception):
    """The URL (or a redirect) leads to an address that is not public: 400 SourceImageUrlRefused."""


class ImageUrlInvalid(Exception):
    """The URL cannot give an image: 400 SourceImageUrlInvalid. str() says why."""


class ImageTooLarge(Exception):
    """More than max_bytes arrived (or Content-Length announced more). .size is that count."""

    def __init__(self, size: int, max_bytes: int) -> None:
        super().__init__(f"the image is larger than {max_bytes} bytes (at least {size})")
        self.size = size
        self.max_bytes = max_bytes


def fetch_public_image(
    url: str,
    *,
    max_bytes: int,
    resolve: Resolver = socket.getaddrinfo,
    allowed_networks: Sequence[IPNetwork] = (),
    ssl_context: ssl.SSLContext | None = None,
    timeout: float = CHAT_IMAGE_FETCH_TIMEOUT_SECONDS,
    total_timeout: float = CHAT_IMAGE_FETCH_TOTAL_SECONDS,
) -> bytes:
    """GET an image over http(s), following at most CHAT_IMAGE_FETCH_MAX_REDIRECTS redirects.

    `resolve` stands in for DNS (socket.getaddrinfo's signature); `allowed_networks` lets an
    operator (or a test) reach addresses that would otherwise be refused. Raises ImageUrlRefused,
    ImageUrlInvalid or ImageTooLarge; returns the body of the 200 answer.
    """
    deadline = time.monotonic() + total_timeout
    for hop in range(CHAT_IMAGE_FETCH_MAX_REDIRECTS + 1):
        parts = _parse(url)
        host = _ascii_host(parts)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = _resolve_public(host, port, resolve, allowed_networks)
        tls = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        connection = _PinnedConnection(host, port, addresses, timeout, tls, deadline=deadline)
        # The per-read timeout restarts with every byte: the watchdog bounds the whole hop.
        watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), connection.abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            try:
                response = _get(connection, parts)
                if time.monotonic() >= deadline:  # the watchdog ended it: what arrived is cut short
                    raise ImageUrlInvalid(f"the image took longer than {total_timeout:g} seconds to arrive")
                if response.status in REDIRECT_STATUSES and response.getheader("Location"):
                    if hop == CHAT_IMAGE_FETCH_MAX_REDIRECTS:
                        raise ImageUrlInvalid(f"more than {CHAT_IMAGE_FETCH_MAX_REDIRECTS} redirects")
                    url = _redirect_target(url, response.getheader("Location", ""))
                    continue
                if response.status != 200:
                    raise ImageUrlInvalid(f"the image URL answered {response.status} {response.reason}")
                return _read_bounded(response, max_bytes, deadline, total_timeout)
            except (OSError, http.client.HTTPException) as error:
                # Timeouts, refused connections, TLS verification failures, malformed answers.
                if time.monotonic() >= deadline:
                    raise ImageUrlInvalid(
                        f"the image took longer than {total_timeout:g} seconds to arrive"
                    ) from error
                raise ImageUrlInvalid(f"fetching {host!r} failed: {error or type(error).__name__}") from error
        finally:
            watchdog.cancel()
            connection.close()
    raise AssertionError("unreachable: the last hop returns or raises")


def _parse(url: str) -> SplitResult:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
    except ValueError as error:
        raise ImageUrlInvalid(f"malformed URL: {error}") from error
    if parts.scheme not in ("http", "https"):
        raise ImageUrlInvalid(f"only http and https URLs are fetched, not {parts.scheme or 'no scheme'!r}")
    if "@" in parts.netloc:
        # user:password@ in an image URL is either a mistake or an attempt to confuse the host check.
        raise ImageUrlInvalid("a URL with credentials (user@host) is not fetched")
    if not parts.hostname:
        raise ImageUrlInvalid("the URL has no host")
    return parts


def _ascii_host(parts: SplitResult) -> str:
    """The host as it goes on the wire (Host header, SNI): IDNA-encoded when it is not ASCII."""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal; http.client adds the brackets to the Host header
        try:
            ipaddress.IPv6Address(host)
        except ValueError as error:
            raise ImageUrlInvalid(f"malformed host {host!r}") from error
        return host
    try:
        encoded = host.encode("idna").decode("ascii")
    except UnicodeError as error:
        raise ImageUrlInvalid(f"malformed host {host!r}") from error
    # urlsplit keeps spaces and control characters in the host; they must not reach a header.
    if not set(encoded) <= _HOST_CHARACTERS:
        raise ImageUrlInvalid(f"malformed host {host!r}")
    return encoded


Address = tuple[int, tuple[Any, ...]]  # (family, sockaddr): one checked answer to connect to


def _resolve_public(
    host: str, port: int, resolve: Resolver, allowed_networks: Sequence[IPNetwork]
) -> list[Address]:
    """Resolve once; refuse when any answer is not public. Returns every answer, in DNS order."""
    try:
        answers = list(resolve(host, port, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError) as error:
        raise ImageUrlInvalid(f"the host {host!r} cannot be resolved: {error}") from error
    if not answers:
        raise ImageUrlInvalid(f"the host {host!r} resolves to no address")
    # Every answer, not only the first: a client elsewhere (or a retry) may pick another one.
    for _family, _type, _proto, _canonname, sockaddr in answers:
        address = _checked_form(ipaddress.ip_address(sockaddr[0]))
        if _is_internal(address) and not any(address in network for network in allowed_networks):
            # Not the address itself: the horde's resolver may know internal names, and a refusal
            # that named their addresses would map the horde's network for anyone (docs/adr/0092).
            raise ImageUrlRefused(f"the host {host!r} resolves to an address that is not public")
    return [(family, sockaddr) for family, _type, _proto, _canonname, sockaddr in answers]


def _checked_form(address: IPAddress) -> IPAddress:
    # ::ffff:10.0.0.1 reaches 10.0.0.1; Python 3.11 does not call it private, so check the IPv4.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_internal(address: IPAddress) -> bool:
    # Beyond the spec's list: any address not globally reachable, such as carrier-grade NAT's
    # 100.64.0.0/10 (a cloud's metadata service, a mesh VPN), which Python counts as not private,
    # and a 6to4 address (2002::/16) whose embedded IPv4 address is internal.
    embedded = address.sixtofour if isinstance(address, ipaddress.IPv6Address) else None
    if embedded is not None and _is_internal(embedded):
        return True
    return (
        not address.is_global
        or address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to addresses already checked: the name is never resolved again.

    `host` stays the URL's host, so http.client writes it into the Host header, and the TLS
    handshake sends it as the server name and verifies the certificate against it.
    """

    def __init__(
        self,
        host: str,
        port: int,
        addresses: Sequence[Address],
        timeout: float,
        tls: ssl.SSLContext | None,
        *,
        deadline: float,
    ) -> None:
        super().__init__(host, port, timeout=timeout)
        self._addresses = addresses
        self._deadline = deadline
        self._tls = tls
        self._raw: socket.socket | None = None
        # The Host header leaves out the port only when it is the scheme's default.
        self.default_port = 443 if tls is not None else 80

    def abort(self) -> None:
        """End a fetch past its deadline from another thread: a blocked read returns at once."""
        raw = self._raw
        if raw is not None:
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)

    def connect(self) -> None:
        sock = self._connect_first()
        try:
            sock.settimeout(self.timeout)  # covers the handshake and every read
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def _connect_first(self) -> socket.socket:
        """A socket connected to the first address, in DNS order, that accepts the connection.

        Each attempt is bounded by the connect timeout and by what is left of the whole fetch, so
        the addresses together never take longer than one fetch may. Only the connect falls back:
        once one address answered, its TLS or HTTP failure is the fetch's (as in browsers and curl).
        All dead: the last address's error, which for a single address is the error it always gave.
        """
        failure: OSError | None = None
        for family, sockaddr in self._addresses:
            left = self._deadline - time.monotonic()
            if left <= 0:
                break
            try:
                # Inside the try: a host without IPv6 refuses the socket itself, and that address
                # is as dead as one that does not answer.
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError as error:
                failure = error
                continue
            self._raw = sock
            try:
                sock.settimeout(min(self.timeout, left) if self.timeout is not None else left)
                sock.connect(sockaddr)
            except OSError as error:
                sock.close()
                failure = error
                continue
            except BaseException:
                sock.close()
                raise
            return sock
        raise failure or TimeoutError("timed out")


# What a request target keeps as it is when it is percent-encoded (requests' requote_uri keeps the
# same): the delimiters, and % so that escapes already there are not escaped again.
_TARGET_SAFE = "!#$%&'()*+,/:;=?@[]~"


def _redirect_target(url: str, location: str) -> str:
    try:
        return urljoin(url, _location(location))
    except ValueError as error:  # a bracketed host that does not parse ("http://[::1")
        raise ImageUrlInvalid(f"malformed redirect: {error}") from error


def _location(value: str) -> str:
    """A Location header as its sender wrote it: http.client reads header bytes as Latin-1, and a
    server that puts a path outside ASCII there sends it as UTF-8 (as requests reads it)."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _get(connection: _PinnedConnection, parts: SplitResult) -> http.client.HTTPResponse:
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # A path or query outside ASCII (or with spaces) goes on the wire percent-encoded as UTF-8, as
    # a browser sends it; http.client would refuse it (docs/adr/0121).
    target = quote(target, safe=_TARGET_SAFE)
    # No Accept-Encoding (http.client would add "identity"): the body is the image bytes.
    connection.putrequest("GET", target, skip_accept_encoding=True)
    connection.putheader("Accept", "image/*")
    connection.putheader("User-Agent", USER_AGENT)
    connection.endheaders()
    return connection.getresponse()


def _read_bounded(response: http.client.HTTPResponse, max_bytes: int, deadline: float, total: float) -> bytes:
    """Read at most max_bytes + 1 bytes (one byte more proves the image too large), by then."""
    declared_text = (response.getheader("Content-Length") or "").strip()
    declared = int(declared_text) if declared_text.isascii() and declared_text.isdigit() else None
    if declared is not None and declared > max_bytes:
        raise ImageTooLarge(declared, max_bytes)
    body = bytearray()
    while chunk := response.read1(min(_CHUNK_BYTES, max_bytes + 1 - len(body))):
        body += chunk
        if time.monotonic() > deadline:
            raise ImageUrlInvalid(f"the image took longer than {total:g} seconds to arrive")
        if len(body) > max_bytes:
            raise ImageTooLarge(len(body), max_bytes)
    if time.monotonic() >= deadline:  # ended by the watchdog, not by the server
        raise ImageUrlInvalid(f"the image took longer than {total:g} seconds to arrive")
    if declared is not None and len(body) < declared:  # read1 ends at the close, short or not
        raise ImageUrlInvalid(f"the image host closed the connection after {len(body)} of its {declared} bytes")
    return bytes(body)
