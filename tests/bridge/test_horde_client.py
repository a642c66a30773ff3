"""The reference worker's horde client (workers/bridge/horde.py, on http.client): a keep-alive
connection the server closed while idle is opened again, a request a kept connection dropped
unanswered goes once more, the environment's proxy is used with its credentials, NO_PROXY bypasses
it, an HTTPS horde's certificate is verified, a messages_url is fetched through redirects, and a
closed client refuses calls. The servers here stand for what is outside the project: a horde front
that closes idle connections (over TLS too), an HTTP proxy and an object store."""

from __future__ import annotations

import gzip
import json
import select
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from contract.chat_limits import MAX_CHAT_BODY_BYTES
from tests.http_fakes import QuietHandler
from workers.bridge.connections import proxy_for
from workers.bridge.horde import POP_HELD_AFTER, HordeClient, HordeUnavailable


class _Recorder(QuietHandler):
    """Answers every request with {"id": null}, records its request line and headers, and with
    `close_after` set closes the connection after answering without saying so (as a proxy or
    server whose idle timeout ended the connection would). With `drop_after` N, a connection's
    requests after its first N are read and left unanswered, the connection closed (as a server
    whose idle timeout ends a kept connection while a request is on its way)."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, dict[str, str], tuple[str, int]]] = []  # request line, headers, client address
    bodies: list[bytes] = []
    close_after = False
    drop_after: int | None = None

    def do_GET(self) -> None:
        """A messages_url: /moved redirects to /messages, which holds the offloaded array."""
        type(self).seen.append((self.requestline, dict(self.headers), self.client_address))
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/messages")
            body = b""
        elif self.path == "/messages":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            body = json.dumps([{"role": "user", "content": "offloaded"}]).encode()
        elif self.path == "/messages.gz":  # stored gzipped: served as stored, whatever was accepted
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Encoding", "gzip")
            body = gzip.compress(json.dumps([{"role": "user", "content": "packed"}]).encode())
        elif self.path == "/broken.gz":
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            body = b"\x1f\x8b\x08\x00 not really gzip"
        elif self.path == "/huge.gz":  # a small body that inflates past the fetch cap
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            body = gzip.compress(b"[" + b" " * (MAX_CHAT_BODY_BYTES + 10) + b"]", compresslevel=9)
        else:
            self.send_response(404)
            body = b"NoSuchKey"
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        type(self).bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        type(self).seen.append((self.requestline, dict(self.headers), self.client_address))
        answered = getattr(self, "answered", 0)
        if type(self).drop_after is not None and answered >= type(self).drop_after:
            self.close_connection = True  # closed with nothing sent
            return
        self.answered = answered + 1
        body = json.dumps({"id": None}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if type(self).close_after:
            self.close_connection = True


@pytest.fixture()
def server() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "bodies": [], "close_after": False, "drop_after": None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_one_connection_serves_a_threads_calls(server, monkeypatch):
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    url, handler = server
    client = HordeClient(url, "k" * 22)
    assert [client.pop({"name": "w"}) for _ in range(3)] == [{"id": None}] * 3
    assert len({connection for _, _, connection in handler.seen}) == 1
    assert handler.seen[0][0] == "POST /api/v2/generate/text/pop HTTP/1.1"
    assert handler.seen[0][1]["apikey"] == "k" * 22
    client.pop({"name": "wörker 工"})
    assert handler.bodies[-1] == '{"name":"wörker 工"}'.encode()  # compact UTF-8, as httpx sent it
    client.close()


def test_a_connection_the_server_closed_while_idle_is_opened_again(server, monkeypatch):
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    url, handler = server
    handler.close_after = True
    client = HordeClient(url, "k" * 22)
    assert client.pop({"name": "w"}) == {"id": None}
    time.sleep(0.2)  # the server's close reaches the client's socket
    assert client.pop({"name": "w"}) == {"id": None}
    assert len(handler.seen) == 2
    client.close()


def test_a_request_a_kept_connection_dropped_unanswered_goes_once_more_on_a_new_one(server, monkeypatch):
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    url, handler = server
    handler.drop_after = 1
    client = HordeClient(url, "k" * 22)
    assert client.pop({"name": "w"}) == {"id": None}
    assert client.pop({"name": "w"}) == {"id": None}  # dropped on the kept connection, answered on a new one
    assert len(handler.seen) == 3 and len({connection for _, _, connection in handler.seen}) == 2
    handler.drop_after = 0  # a new connection that is dropped is a horde that did not answer
    with pytest.raises(HordeUnavailable):
        HordeClient(url, "k" * 22).pop({"name": "w"})
    assert len(handler.seen) == 4
    client.close()


def test_the_environments_proxy_takes_the_absolute_url_with_its_credentials(server, monkeypatch):
    proxy_url, proxy = server  # the recorder stands for the proxy: it answers for the horde
    monkeypatch.setenv("HTTP_PROXY", proxy_url.replace("http://", "http://volunteer:s%3Dcret@"))
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.delenv("no_proxy", raising=False)
    client = HordeClient("http://horde.invalid:7001/base", "k" * 22)
    assert client.pop({"name": "w"}) == {"id": None}
    request_line, headers, _ = proxy.seen[0]
    assert request_line == "POST http://horde.invalid:7001/base/api/v2/generate/text/pop HTTP/1.1"
    assert headers["Proxy-Authorization"] == "Basic dm9sdW50ZWVyOnM9Y3JldA=="  # volunteer:s=cret
    client.close()


def test_no_proxy_names_the_hosts_reached_directly(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "horde.example")
    assert proxy_for("https", "horde.example") is None
    assert proxy_for("https", "other.example") == ("proxy.internal", 3128, None)


def test_a_closed_client_refuses_calls_and_an_unreachable_horde_is_unavailable(monkeypatch):
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    client = HordeClient("http://127.0.0.1:9", "k" * 22)  # the discard port: refused
    with pytest.raises(HordeUnavailable, match="ConnectionRefused"):
        client.pop({"name": "w"})
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.submit({"id": "x"})


def test_a_messages_url_is_fetched_through_redirects_without_the_api_key(server, monkeypatch):
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    url, handler = server
    client = HordeClient("http://horde.invalid", "k" * 22)  # the array lives on another host
    assert client.fetch_json(f"{url}/moved") == [{"role": "user", "content": "offloaded"}]
    assert [line for line, _, _ in handler.seen] == ["GET /moved HTTP/1.1", "GET /messages HTTP/1.1"]
    assert all("apikey" not in headers for _, headers, _ in handler.seen)
    with pytest.raises(HordeUnavailable, match="messages_url"):
        client.fetch_json(f"{url}/expired")


def test_a_gzipped_messages_object_is_decoded(server, monkeypatch):
    """urllib leaves Content-Encoding to the caller: an object stored gzipped still reads as JSON."""
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    url, _ = server
    client = HordeClient("http://horde.invalid", "k" * 22)
    assert client.fetch_json(f"{url}/messages.gz") == [{"role": "user", "content": "packed"}]
    # A body that is not gzip, or that inflates past the cap, is a failed fetch like any other.
    for path in ("/broken.gz", "/huge.gz"):
        with pytest.raises(HordeUnavailable, match="messages_url"):
            client.fetch_json(f"{url}{path}")


def _self_signed(folder) -> tuple[str, str]:
    """A certificate for localhost and its key, as PEM files in `folder`."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_file), str(key_file)


def test_an_https_horde_is_verified_against_ssl_cert_file_else_the_certifi_bundle(tmp_path, monkeypatch):
    for name in ("HTTPS_PROXY", "https_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    cert_file, key_file = _self_signed(tmp_path)
    handler = type("Handler", (_Recorder,), {"seen": [], "bodies": [], "close_after": False, "drop_after": None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"https://localhost:{httpd.server_address[1]}"
    try:
        with pytest.raises(HordeUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            HordeClient(url, "k" * 22).pop({"name": "w"})  # a certificate no public authority signed
        monkeypatch.setenv("SSL_CERT_FILE", cert_file)
        client = HordeClient(url, "k" * 22)
        assert [client.pop({"name": "w"}) for _ in range(2)] == [{"id": None}] * 2
        assert len({connection for _, _, connection in handler.seen}) == 1  # kept alive over TLS too
        client.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


class _HoldingServer:
    """A raw HTTP/1.1 server that holds each pop until the client half-closes, as the horde holds
    a pop for a job; it then answers `answer_after_close` (a job the horde handed out just before
    it saw the worker gone), or closes without answering (what the horde does). With
    `answer_after` it answers that many seconds after the request instead, as a pop the horde is
    running (not holding) does, unless the client half-closes first."""

    def __init__(self, answer_after_close: bytes | None, *, answer_after: float | None = None):
        import socket

        self.answer_after_close = answer_after_close
        self.answer_after = answer_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.saw_end = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            if self.answer_after is not None:
                # A client that ends its sending meanwhile is gone: like a proxy in front of a
                # horde, the server drops the answer (and, with it, the job it handed out).
                readable, _, _ = select.select([conn], [], [], self.answer_after)
                if readable and not conn.recv(65536):
                    self.saw_end.set()
                    return
                self._answer(conn, b'{"id": "job-running"}')
                return
            while conn.recv(65536):  # the body, then the client's end of sending
                pass
            self.saw_end.set()
            if self.answer_after_close is not None:
                self._answer(conn, self.answer_after_close)

    @staticmethod
    def _answer(conn, body: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body
        )

    def close(self) -> None:
        self.listener.close()


def _pop_in_a_thread(client: HordeClient) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def pop() -> None:
        try:
            outcome.append(client.pop({"name": "w", "wait": 10}))
        except HordeUnavailable as error:
            outcome.append(error)

    thread = threading.Thread(target=pop)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("answer", [b'{"id": "job-1"}', None], ids=["answered", "unanswered"])
def test_interrupting_a_held_pop_ends_it_and_still_reads_an_answer_already_sent(answer, monkeypatch):
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    server = _HoldingServer(answer)
    client = HordeClient(f"http://127.0.0.1:{server.port}", "key")
    thread, outcome = _pop_in_a_thread(client)
    time.sleep(POP_HELD_AFTER + 0.2)  # out long enough to be taken as held
    assert outcome == []
    client.interrupt_pops()
    thread.join(5)
    assert not thread.is_alive() and server.saw_end.is_set()
    if answer is None:
        assert isinstance(outcome[0], HordeUnavailable)
    else:
        assert outcome == [{"id": "job-1"}]
    with pytest.raises(HordeUnavailable, match="interrupted"):  # no pop after the stop
        client.pop({"name": "w", "wait": 10})
    client.close()
    server.close()


def test_a_pop_that_asks_not_to_be_held_is_never_interrupted(monkeypatch):
    """A pop without `wait` (the check-in pop, a worker that polls) is one the horde runs at once:
    however long it takes, a stop leaves it to answer."""
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    server = _HoldingServer(None, answer_after=POP_HELD_AFTER + 0.5)
    client = HordeClient(f"http://127.0.0.1:{server.port}", "key")
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(client.pop({"name": "w"})))
    thread.start()
    time.sleep(POP_HELD_AFTER + 0.2)  # as old as a held pop
    client.interrupt_pops()
    thread.join(5)
    assert outcome == [{"id": "job-running"}] and not server.saw_end.is_set()
    client.close()
    server.close()


def test_a_pop_younger_than_a_held_one_is_left_to_answer(monkeypatch):
    """At a stop, a pop just sent may be one the horde is running: ending it would lose the job
    the horde hands out. It is left to answer."""
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    server = _HoldingServer(None, answer_after=0.5)
    client = HordeClient(f"http://127.0.0.1:{server.port}", "key")
    thread, outcome = _pop_in_a_thread(client)
    time.sleep(0.1)
    client.interrupt_pops()
    thread.join(5)
    assert outcome == [{"id": "job-running"}] and not server.saw_end.is_set()
    client.close()
    server.close()
