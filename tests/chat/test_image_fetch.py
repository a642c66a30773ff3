"""chat.image_fetch against real local HTTP(S) servers (chat_requests.md, "Images").

The servers are http.server in a thread on 127.0.0.1 (or ::1); only DNS is stood in for, by the
`resolve` argument: a fake resolver maps test names to addresses and counts the questions.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from chat.image_fetch import (
    CHAT_IMAGE_FETCH_MAX_REDIRECTS,
    CHAT_IMAGE_FETCH_TIMEOUT_SECONDS,
    ImageTooLarge,
    ImageUrlInvalid,
    ImageUrlRefused,
    fetch_public_image,
)
from tests.http_fakes import QuietHandler

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
LOOPBACK = [ipaddress.ip_network("127.0.0.0/8")]

# A route answers a request: (status, headers, body). A callable body is called with the handler
# (to sleep, or to stream without Content-Length).
Route = tuple[int, dict[str, str], bytes | Callable[[BaseHTTPRequestHandler], None]]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]


@dataclass
class LocalServer:
    host: str
    port: int
    routes: dict[str, Route]
    seen: list[Seen] = field(default_factory=list)
    server_names: list[str | None] = field(default_factory=list)  # TLS SNI, when serving https

    def url(self, path: str, *, host: str | None = None, scheme: str = "http") -> str:
        netloc = host or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"{scheme}://{netloc}:{self.port}{path}"


class _Server(ThreadingHTTPServer):
    block_on_close = False  # a handler still sleeping (the timeout test) must not hold the teardown

    def handle_error(self, request, client_address) -> None:
        pass  # the client hanging up early (timeouts, too large, refused certificates) is expected


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler(state: LocalServer) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            state.seen.append(Seen(self.path, {k.lower(): v for k, v in self.headers.items()}))
            status, headers, body = state.routes.get(self.path, (404, {}, b"not found"))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            if callable(body):
                self.end_headers()
                body(self)
                return
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@contextmanager
def _serve(host: str, tls: ssl.SSLContext | None = None, port: int = 0) -> Iterator[LocalServer]:
    state = LocalServer(host=host, port=0, routes={})
    server = (_Server6 if ":" in host else _Server)((host, port), _handler(state))
    if tls is not None:
        tls.sni_callback = lambda sock, name, context: state.server_names.append(name)
        # Handshake in the handler's thread, not in accept(): a refused certificate stays there.
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with _serve("127.0.0.1") as local:
        yield local


class FakeDns:
    """Stands in for DNS: each name answers the next of its list of addresses (the last one repeats)."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def __call__(self, host: str, port: int, type: int = 0) -> list[tuple]:
        assert type == socket.SOCK_STREAM
        self.calls.append(host)
        rounds = self.answers[host]
        addresses = rounds[min(self.calls.count(host), len(rounds)) - 1]
        result = []
        for address in addresses:
            if ":" in address:
                result.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0)))
            else:
                result.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)))
        return result


def _image_route(server: LocalServer, path: str = "/cat.png") -> None:
    server.routes[path] = (200, {"Content-Type": "image/png"}, PNG)


# --- the happy path and what goes on the wire ---


def test_an_image_is_fetched_through_the_allowed_loopback(server: LocalServer) -> None:
    _image_route(server)
    assert fetch_public_image(server.url("/cat.png"), max_bytes=10_000, allowed_networks=LOOPBACK) == PNG
    assert CHAT_IMAGE_FETCH_TIMEOUT_SECONDS == 2.0 and CHAT_IMAGE_FETCH_MAX_REDIRECTS == 3


def test_the_request_names_the_url_host_and_asks_for_an_image(server: LocalServer) -> None:
    _image_route(server, "/cat.png?size=big")
    dns = FakeDns({"images.test": [["127.0.0.1"]]})
    url = server.url("/cat.png?size=big", host="images.test")
    assert fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK) == PNG
    [request] = server.seen
    assert request.path == "/cat.png?size=big"
    assert request.headers["host"] == f"images.test:{server.port}"
    assert request.headers["accept"] == "image/*"
    assert "horde" in request.headers["user-agent"].lower()
    assert "accept-encoding" not in request.headers


def test_a_raw_ipv6_literal_host_is_fetched() -> None:
    with _serve("::1") as server:
        _image_route(server)
        url = server.url("/cat.png")
        assert url.startswith("http://[::1]:")
        allowed = [ipaddress.ip_network("::1/128")]
        assert fetch_public_image(url, max_bytes=10_000, allowed_networks=allowed) == PNG
        assert server.seen[0].headers["host"] == f"[::1]:{server.port}"


# --- addresses that are not public ---


def test_loopback_is_refused_without_the_allowance(server: LocalServer) -> None:
    _image_route(server)
    with pytest.raises(ImageUrlRefused, match="127.0.0.1"):
        fetch_public_image(server.url("/cat.png"), max_bytes=10_000)
    assert server.seen == []


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.1",
        "192.168.1.20",
        "172.16.5.5",
        "169.254.169.254",  # the cloud metadata address
        "224.0.0.1",
        "0.0.0.0",
        "240.0.0.1",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "100.100.100.200",  # carrier-grade NAT (a cloud metadata service), not counted private by Python
        "::ffff:100.64.0.1",
        "2001:db8::1",
        "2002:a00:1::1",  # 6to4 around 10.0.0.1
    ],
)
def test_a_name_resolving_to_a_private_address_is_refused(address: str) -> None:
    dns = FakeDns({"images.test": [[address]]})
    with pytest.raises(ImageUrlRefused, match="not public") as refused:
        fetch_public_image("http://images.test/cat.png", max_bytes=10_000, resolve=dns)
    assert "'images.test'" in str(refused.value)
    assert address not in str(refused.value)  # the refusal names no internal address (ADR 0092)
    assert dns.calls == ["images.test"]


def test_a_mapped_ipv6_address_is_allowed_by_its_ipv4_network(server: LocalServer) -> None:
    _image_route(server)
    # ::ffff:127.0.0.1 is checked as 127.0.0.1, so the IPv4 allowance covers it too (the
    # connection goes to the first answer).
    dns = FakeDns({"images.test": [["127.0.0.1", "::ffff:127.0.0.1"]]})
    url = server.url("/cat.png", host="images.test")
    assert fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK) == PNG


def test_one_private_address_among_public_ones_refuses_the_name() -> None:
    dns = FakeDns({"images.test": [["93.184.215.14", "10.0.0.1"]]})
    with pytest.raises(ImageUrlRefused, match="'images.test'") as refused:
        fetch_public_image("http://images.test/cat.png", max_bytes=10_000, resolve=dns)
    assert "10.0.0.1" not in str(refused.value)


def test_the_connection_goes_to_the_checked_address_without_resolving_again(server: LocalServer) -> None:
    _image_route(server)
    # Rebinding: the second answer would be private. It is never asked for.
    dns = FakeDns({"images.test": [["127.0.0.1"], ["10.0.0.1"]]})
    url = server.url("/cat.png", host="images.test")
    assert fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK) == PNG
    assert dns.calls == ["images.test"]
    assert len(server.seen) == 1


def test_every_hop_resolves_its_host_exactly_once(server: LocalServer) -> None:
    _image_route(server)
    server.routes["/moved"] = (302, {"Location": server.url("/cat.png", host="cdn.test")}, b"")
    dns = FakeDns({"images.test": [["127.0.0.1"], ["10.0.0.1"]], "cdn.test": [["127.0.0.1"], ["10.0.0.1"]]})
    url = server.url("/moved", host="images.test")
    assert fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK) == PNG
    assert dns.calls == ["images.test", "cdn.test"]
    assert [seen.headers["host"] for seen in server.seen] == [
        f"images.test:{server.port}",
        f"cdn.test:{server.port}",
    ]


# --- a name with several addresses: each checked one is tried in turn ---
# A URL carries one port, so every address a test name resolves to is that port on another
# loopback address: a live server on one, a dead address (below) on the others.


def _refusing(host: str, port: int = 0) -> socket.socket:
    """A dead address whose connect is refused at once: bound, not listening (the port stays held)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, port))
    return sock


@contextmanager
def _blackholed(host: str, port: int = 0) -> Iterator[socket.socket]:
    """A dead address whose connect times out, as a firewall that drops packets: a listener whose
    accept queue is full, so the kernel drops every further handshake."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.bind((host, port))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname()[:2], timeout=1)
    try:
        yield listener
    finally:
        filler.close()
        listener.close()


@contextmanager
def _live_beside(dead: socket.socket) -> Iterator[LocalServer]:
    """A live server on 127.0.0.1 at the port of `dead` (an address other than 127.0.0.1)."""
    with _serve("127.0.0.1", port=dead.getsockname()[1]) as live:
        _image_route(live)
        yield live


def _nobody_connected(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        connection, _ = listener.accept()
    except BlockingIOError:
        return True
    connection.close()
    return False


def test_a_dead_ipv6_address_falls_back_to_the_live_ipv4_one() -> None:
    """The common case browsers, curl and requests get through: the AAAA answer refuses, the A works."""
    with _refusing("::1") as dead, _live_beside(dead) as live:
        dns = FakeDns({"images.test": [["::1", "127.0.0.1"]]})
        allowed = [*LOOPBACK, ipaddress.ip_network("::1/128")]
        url = live.url("/cat.png", host="images.test")
        assert fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=allowed) == PNG
        assert dns.calls == ["images.test"]  # the fallback does not ask DNS again
        assert [seen.headers["host"] for seen in live.seen] == [f"images.test:{live.port}"]


def test_an_address_that_does_not_answer_falls_back_after_the_connect_timeout() -> None:
    with _blackholed("127.0.0.2") as dead, _live_beside(dead) as live:
        dns = FakeDns({"images.test": [["127.0.0.2", "127.0.0.1"]]})
        url = live.url("/cat.png", host="images.test")
        started = time.monotonic()
        fetched = fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK, timeout=0.3)
        assert fetched == PNG
        assert 0.3 <= time.monotonic() - started < 2.0
        assert len(live.seen) == 1


def test_addresses_are_tried_in_the_order_dns_gave_them() -> None:
    with _refusing("127.0.0.2") as dead, _live_beside(dead) as live:
        port = live.port
        with _serve("127.0.0.3", port=port) as second:
            _image_route(second)
            dns = FakeDns({"images.test": [["127.0.0.2", "127.0.0.3", "127.0.0.1"]]})
            url = live.url("/cat.png", host="images.test")
            assert fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK) == PNG
            assert len(second.seen) == 1 and live.seen == []


def test_a_redirect_hop_falls_back_to_its_next_address_too() -> None:
    with _refusing("::1") as dead, _live_beside(dead) as live:
        live.routes["/moved"] = (302, {"Location": live.url("/cat.png", host="cdn.test")}, b"")
        dns = FakeDns({"images.test": [["127.0.0.1"]], "cdn.test": [["::1", "127.0.0.1"]]})
        allowed = [*LOOPBACK, ipaddress.ip_network("::1/128")]
        url = live.url("/moved", host="images.test")
        assert fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=allowed) == PNG
        assert [seen.path for seen in live.seen] == ["/moved", "/cat.png"]
        assert dns.calls == ["images.test", "cdn.test"]


def test_https_after_a_fallback_still_verifies_the_url_host(pki: Pki) -> None:
    with _refusing("::1") as dead:
        port = dead.getsockname()[1]
        with _serve("127.0.0.1", tls=pki.server_context("images.test"), port=port) as live:
            _image_route(live)
            dns = FakeDns({"images.test": [["::1", "127.0.0.1"]]})
            allowed = [*LOOPBACK, ipaddress.ip_network("::1/128")]
            url = live.url("/cat.png", host="images.test", scheme="https")
            fetched = fetch_public_image(
                url, max_bytes=10_000, resolve=dns, allowed_networks=allowed, ssl_context=pki.client_context()
            )
            assert fetched == PNG
            assert live.server_names == ["images.test"]


def test_when_every_address_is_dead_the_error_is_that_of_one_dead_address() -> None:
    """What the client reads (400 SourceImageUrlInvalid, "fetching 'images.test' failed: ...") is
    the same for a name with one dead address and a name with several."""
    with _refusing("127.0.0.2") as dead:
        port = dead.getsockname()[1]
        with _refusing("127.0.0.3", port), _refusing("::1", port):
            allowed = [*LOOPBACK, ipaddress.ip_network("::1/128")]
            url = f"http://images.test:{port}/cat.png"
            errors = []
            for addresses in (["127.0.0.2"], ["::1", "127.0.0.2", "127.0.0.3"]):
                dns = FakeDns({"images.test": [addresses]})
                with pytest.raises(ImageUrlInvalid) as failed:
                    fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=allowed)
                errors.append(str(failed.value))
    assert errors[0] == errors[1] == "fetching 'images.test' failed: [Errno 111] Connection refused"


def test_addresses_that_do_not_answer_stay_within_the_whole_fetch_bound() -> None:
    """Three addresses that would each take the connect timeout (2.4 s in all): the whole fetch
    still ends at its bound, with the message a fetch past its bound always gives."""
    with _blackholed("127.0.0.2") as dead:
        port = dead.getsockname()[1]
        with _blackholed("127.0.0.3", port), _blackholed("127.0.0.4", port):
            dns = FakeDns({"images.test": [["127.0.0.2", "127.0.0.3", "127.0.0.4"]]})
            started = time.monotonic()
            with pytest.raises(ImageUrlInvalid, match="^the image took longer than 1 seconds to arrive$"):
                fetch_public_image(
                    f"http://images.test:{port}/cat.png",
                    max_bytes=10_000,
                    resolve=dns,
                    allowed_networks=LOOPBACK,
                    timeout=0.8,
                    total_timeout=1.0,
                )
            assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("order", ["refused first", "refused last"])
def test_a_refused_address_beside_allowed_ones_refuses_the_name_and_is_never_connected_to(order: str) -> None:
    """The guard is not a filter the fallback steps around: a name with any address that is not
    public is refused whole (chat_requests.md, docs/adr/0129), and nothing is connected to."""
    with _refusing("127.0.0.2") as dead:
        port = dead.getsockname()[1]
        with socket.create_server(("127.0.0.3", port)) as refused_but_live:
            addresses = ["127.0.0.3", "127.0.0.2"] if order == "refused first" else ["127.0.0.2", "127.0.0.3"]
            dns = FakeDns({"images.test": [addresses]})
            only_two = [ipaddress.ip_network("127.0.0.2/32")]  # 127.0.0.3 stays refused
            url = f"http://images.test:{port}/cat.png"
            with pytest.raises(ImageUrlRefused, match="'images.test' resolves to an address that is not public"):
                fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=only_two)
            assert _nobody_connected(refused_but_live)


# --- answers ---


def test_a_404_is_invalid_and_says_so(server: LocalServer) -> None:
    with pytest.raises(ImageUrlInvalid, match="404"):
        fetch_public_image(server.url("/missing.png"), max_bytes=10_000, allowed_networks=LOOPBACK)


def _redirect_chain(server: LocalServer, length: int) -> str:
    _image_route(server, "/hop/0")
    for hop in range(1, length + 1):
        server.routes[f"/hop/{hop}"] = (302, {"Location": server.url(f"/hop/{hop - 1}")}, b"")
    return server.url(f"/hop/{length}")


def test_three_redirects_are_followed(server: LocalServer) -> None:
    url = _redirect_chain(server, 3)
    assert fetch_public_image(url, max_bytes=10_000, allowed_networks=LOOPBACK) == PNG
    assert [seen.path for seen in server.seen] == ["/hop/3", "/hop/2", "/hop/1", "/hop/0"]


def test_a_fourth_redirect_is_invalid(server: LocalServer) -> None:
    url = _redirect_chain(server, 4)
    with pytest.raises(ImageUrlInvalid, match="redirects"):
        fetch_public_image(url, max_bytes=10_000, allowed_networks=LOOPBACK)
    assert [seen.path for seen in server.seen] == ["/hop/4", "/hop/3", "/hop/2", "/hop/1"]


@pytest.mark.parametrize("status", [301, 303, 307, 308])
def test_a_relative_location_is_resolved_against_the_current_url(server: LocalServer, status: int) -> None:
    _image_route(server, "/images/cat.png")
    server.routes["/images/old/cat.png"] = (status, {"Location": "../cat.png"}, b"")
    url = server.url("/images/old/cat.png")
    assert fetch_public_image(url, max_bytes=10_000, allowed_networks=LOOPBACK) == PNG
    assert server.seen[-1].path == "/images/cat.png"


def test_a_path_and_query_outside_ascii_are_sent_percent_encoded_as_utf8(server: LocalServer) -> None:
    """What a browser (and requests) sends for such a URL: the image is fetched, not a 500."""
    _image_route(server, "/photos/caf%C3%A9%20au%20lait.png?q=%C3%BC&x=%2F")
    url = server.url("/photos/café au lait.png?q=ü&x=%2F")
    assert fetch_public_image(url, max_bytes=10_000, allowed_networks=LOOPBACK) == PNG
    assert server.seen[-1].path == "/photos/caf%C3%A9%20au%20lait.png?q=%C3%BC&x=%2F"


def test_a_redirect_to_a_utf8_location_is_followed(server: LocalServer) -> None:
    """A Location header's bytes are UTF-8 as servers send them (http.client reads them as Latin-1)."""
    _image_route(server, "/caf%C3%A9.png")
    server.routes["/moved"] = (302, {"Location": "/café.png".encode().decode("latin-1")}, b"")
    assert fetch_public_image(server.url("/moved"), max_bytes=10_000, allowed_networks=LOOPBACK) == PNG
    assert server.seen[-1].path == "/caf%C3%A9.png"


@pytest.mark.parametrize("location", ["http://[::1", "//[::1/cat.png", "http://[zz]/cat.png", "http://h:99999/"])
def test_a_malformed_location_is_invalid(server: LocalServer, location: str) -> None:
    """400 SourceImageUrlInvalid at the route, not a 500: urljoin raises on a bracketed host that
    does not parse."""
    server.routes["/moved"] = (302, {"Location": location}, b"")
    with pytest.raises(ImageUrlInvalid, match="malformed"):
        fetch_public_image(server.url("/moved"), max_bytes=10_000, allowed_networks=LOOPBACK)


def test_a_redirect_to_a_private_address_is_refused(server: LocalServer) -> None:
    server.routes["/moved"] = (302, {"Location": "http://10.1.2.3/secret"}, b"")
    with pytest.raises(ImageUrlRefused, match="10.1.2.3"):
        fetch_public_image(server.url("/moved"), max_bytes=10_000, allowed_networks=LOOPBACK)


def test_a_redirect_to_a_name_resolving_privately_is_refused(server: LocalServer) -> None:
    server.routes["/moved"] = (302, {"Location": "http://metadata.test/latest"}, b"")
    dns = FakeDns({"images.test": [["127.0.0.1"]], "metadata.test": [["169.254.169.254"]]})
    url = server.url("/moved", host="images.test")
    with pytest.raises(ImageUrlRefused, match="'metadata.test'") as refused:
        fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK)
    assert "169.254.169.254" not in str(refused.value)


def test_a_server_slower_than_the_timeout_is_invalid(server: LocalServer) -> None:
    answered = threading.Event()  # the server answers once the test is done, or after 10 s
    server.routes["/slow.png"] = (200, {"Content-Type": "image/png"}, lambda handler: answered.wait(10))
    started = time.monotonic()
    try:
        with pytest.raises(ImageUrlInvalid, match="timed out"):
            fetch_public_image(server.url("/slow.png"), max_bytes=10_000, allowed_networks=LOOPBACK, timeout=0.3)
        assert time.monotonic() - started < 5  # ended by the 0.3 s timeout, not by the answer
    finally:
        answered.set()


def test_a_server_that_never_answers_times_out() -> None:
    # A listening socket nobody accepts from: the connect succeeds (backlog), the read waits.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ImageUrlInvalid, match="timed out"):
            fetch_public_image(
                f"http://127.0.0.1:{port}/", max_bytes=10, allowed_networks=LOOPBACK, timeout=0.3
            )
        assert time.monotonic() - started < 5  # the given 0.3 s, not the whole fetch's bound (15 s)


def test_a_server_that_drips_its_headers_is_cut_off_at_the_whole_fetch_bound() -> None:
    """Each byte restarts the per-read timeout; the whole fetch is still bounded."""
    stop = threading.Event()

    def drip(listener: socket.socket) -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.is_set():
                try:
                    connection.sendall(b"X-Slow: a\r\n")
                except OSError:
                    return
                time.sleep(0.1)

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        thread = threading.Thread(target=drip, args=(listener,), daemon=True)
        thread.start()
        started = time.monotonic()
        try:
            with pytest.raises(ImageUrlInvalid, match="took longer than 1 seconds"):
                fetch_public_image(
                    f"http://127.0.0.1:{port}/", max_bytes=10, allowed_networks=LOOPBACK, timeout=0.5, total_timeout=1.0
                )
        finally:
            stop.set()
        assert time.monotonic() - started < 5  # the drip goes on until the fetch ends
        thread.join(2)


def test_a_refused_connection_is_invalid() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(ImageUrlInvalid, match="failed"):
        fetch_public_image(f"http://127.0.0.1:{port}/", max_bytes=10, allowed_networks=LOOPBACK)


# --- size ---


def test_a_declared_length_over_the_limit_is_too_large(server: LocalServer) -> None:
    _image_route(server)
    with pytest.raises(ImageTooLarge) as too_large:
        fetch_public_image(server.url("/cat.png"), max_bytes=100, allowed_networks=LOOPBACK)
    assert too_large.value.size == len(PNG) > 100


def test_a_declared_length_of_non_ascii_digits_is_read_as_undeclared(server: LocalServer) -> None:
    """`Content-Length: ²` (byte 0xb2, a digit to str.isdigit, not to int) was a ValueError."""
    headers = {"Content-Type": "image/png", "Content-Length": "\u00b2"}
    server.routes["/cat.png"] = (200, headers, lambda handler: handler.wfile.write(PNG))
    assert fetch_public_image(server.url("/cat.png"), max_bytes=10_000, allowed_networks=LOOPBACK) == PNG


def test_an_undeclared_length_over_the_limit_is_too_large(server: LocalServer) -> None:
    server.routes["/cat.png"] = (200, {"Content-Type": "image/png"}, lambda handler: handler.wfile.write(PNG))
    with pytest.raises(ImageTooLarge) as too_large:
        fetch_public_image(server.url("/cat.png"), max_bytes=100, allowed_networks=LOOPBACK)
    assert too_large.value.size > 100


def test_an_endless_body_stops_just_past_the_limit(server: LocalServer) -> None:
    def endless(handler: BaseHTTPRequestHandler) -> None:
        chunk = b"\0" * 65536
        for _ in range(16 * 1024):  # up to 1 GiB, cut short when the client hangs up
            handler.wfile.write(chunk)

    server.routes["/endless"] = (200, {"Content-Type": "image/png"}, endless)
    with pytest.raises(ImageTooLarge) as too_large:
        fetch_public_image(server.url("/endless"), max_bytes=200_000, allowed_networks=LOOPBACK)
    assert 200_000 < too_large.value.size <= 200_001


def test_a_body_of_exactly_the_limit_is_fetched(server: LocalServer) -> None:
    _image_route(server)
    assert fetch_public_image(server.url("/cat.png"), max_bytes=len(PNG), allowed_networks=LOOPBACK) == PNG


def test_a_body_cut_short_of_its_declared_length_is_invalid_not_an_image_to_decode(server: LocalServer) -> None:
    """The host closed the connection early: the fetch failed, which the requester is told, rather
    than "could not be read as an image" of the bytes that came."""
    headers = {"Content-Type": "image/png", "Content-Length": str(len(PNG))}
    server.routes["/cat.png"] = (200, headers, lambda handler: handler.wfile.write(PNG[:20]))
    with pytest.raises(ImageUrlInvalid) as invalid:
        fetch_public_image(server.url("/cat.png"), max_bytes=10_000, allowed_networks=LOOPBACK)
    assert str(invalid.value) == f"the image host closed the connection after 20 of its {len(PNG)} bytes"


# --- malformed URLs ---


@pytest.mark.parametrize(
    "url",
    [
        "ftp://images.test/cat.png",
        "file:///etc/passwd",
        "images.test/cat.png",
        "http://user:secret@images.test/cat.png",
        "http://user@images.test/cat.png",
        "http:///cat.png",
        "http://images.test:99999/cat.png",
        "http://images test/cat.png",
        "http://[::1/cat.png",
    ],
)
def test_a_malformed_url_or_another_scheme_is_invalid(url: str) -> None:
    dns = FakeDns({})  # never asked: the URL is refused before any lookup
    with pytest.raises(ImageUrlInvalid):
        fetch_public_image(url, max_bytes=10_000, resolve=dns)
    assert dns.calls == []


def test_a_name_that_does_not_resolve_is_invalid() -> None:
    def nxdomain(host: str, port: int, type: int = 0) -> list[tuple]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(ImageUrlInvalid, match="cannot be resolved"):
        fetch_public_image("http://nowhere.test/cat.png", max_bytes=10_000, resolve=nxdomain)


# --- https ---


@dataclass
class Pki:
    ca_pem: bytes
    folder: Path
    ca_key: ec.EllipticCurvePrivateKey
    ca_cert: x509.Certificate

    def server_context(self, name: str) -> ssl.SSLContext:
        """A server context whose certificate, signed by the test CA, names `name` only."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()), critical=False
            )
            .sign(self.ca_key, hashes.SHA256())
        )
        cert_file, key_file = self.folder / f"{name}.pem", self.folder / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_file, key_file)
        return context

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cadata=self.ca_pem.decode("ascii"))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "image fetch test CA")])
    now = datetime.datetime.now(datetime.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Pki(ca.public_bytes(serialization.Encoding.PEM), tmp_path, key, ca)


def test_https_verifies_the_certificate_against_the_url_host(pki: Pki) -> None:
    with _serve("127.0.0.1", tls=pki.server_context("images.test")) as server:
        _image_route(server)
        dns = FakeDns({"images.test": [["127.0.0.1"]]})
        url = server.url("/cat.png", host="images.test", scheme="https")
        fetched = fetch_public_image(
            url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK, ssl_context=pki.client_context()
        )
        assert fetched == PNG
        assert server.server_names == ["images.test"]  # SNI is the URL's host, not the address
        assert server.seen[0].headers["host"] == f"images.test:{server.port}"


def test_https_with_a_certificate_for_another_name_is_invalid(pki: Pki) -> None:
    with _serve("127.0.0.1", tls=pki.server_context("other.test")) as server:
        _image_route(server)
        dns = FakeDns({"images.test": [["127.0.0.1"]]})
        url = server.url("/cat.png", host="images.test", scheme="https")
        with pytest.raises(ImageUrlInvalid, match="certificate"):
            fetch_public_image(
                url,
                max_bytes=10_000,
                resolve=dns,
                allowed_networks=LOOPBACK,
                ssl_context=pki.client_context(),
            )
        assert server.seen == []


def test_https_without_trusting_the_test_ca_is_invalid(pki: Pki) -> None:
    with _serve("127.0.0.1", tls=pki.server_context("images.test")) as server:
        _image_route(server)
        dns = FakeDns({"images.test": [["127.0.0.1"]]})
        url = server.url("/cat.png", host="images.test", scheme="https")
        with pytest.raises(ImageUrlInvalid, match="certificate"):
            fetch_public_image(url, max_bytes=10_000, resolve=dns, allowed_networks=LOOPBACK)
