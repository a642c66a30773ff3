"""Findings of the security review of docs/adr/0092, each reproduced against a real web process
(daphne on the test database, as `scripts/run.py web` serves it) with real local servers for what is
outside the horde: an image host that drips its answer, or answers at once.

- A request's images hold a web thread while they are fetched (up to the request's fetch bound,
  15 s), checked and re-encoded. Before the fix, HORDE_WEB_THREADS such requests from one client
  held every thread of the process: its heartbeat, pops and submits waited for them. Now only
  HORDE_CHAT_IMAGE_CONCURRENCY requests of a process load images at once; another is answered
  503 ChatImagesBusy with Retry-After at once, and the other routes keep their threads.
- An image URL refused for its address named the address its host resolved to: the horde told
  anyone the internal addresses of the names its resolver knows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.hordesite.test_web_restart import (
    CHAT_DECLARATION,
    CHAT_MODEL,
    SCRIBE_AGENT,
    WebProcess,
    web_env,
)
from tests.http_fakes import QuietHandler, close_server, serve
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WEB_THREADS = 2
GENEROUS_LIMITS = {
    "HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP": "1000/second",
    "HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP": "100000/minute",
    "HORDE_API_KEY_RATE_LIMITS": "1000/second",
}


class DripHost:
    """An image host on 127.0.0.1 that sends its headers, then a byte every 0.2 s until the client
    goes away, the test releases it (it then closes the connection short of its Content-Length) or
    30 s pass: unreleased, each fetch of it lasts the horde's whole fetch bound."""

    def __init__(self) -> None:
        self.connections = 0
        self.lock = threading.Lock()
        self.released = threading.Event()
        host = self

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802
                with host.lock:
                    host.connections += 1
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                end = time.monotonic() + 30
                try:
                    while time.monotonic() < end and not host.released.is_set():
                        self.wfile.write(b"\x89")
                        self.wfile.flush()
                        host.released.wait(0.2)
                except OSError:
                    pass
                self.close_connection = True

        self.server = serve(Handler)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_port}{path}"

    def close(self) -> None:
        close_server(self.server)


@pytest.fixture
def drip_host() -> Iterator[DripHost]:
    host = DripHost()
    yield host
    host.close()


def _web(tmp_path: Path, **values: str) -> WebProcess:
    env = web_env(tmp_path, HORDE_WEB_THREADS=str(WEB_THREADS), **GENEROUS_LIMITS, **values)
    process = WebProcess(env, free_port(), tmp_path / "daphne.log")
    process.start()
    return process


@pytest.fixture
def web_factory(tmp_path) -> Iterator:
    started: list[WebProcess] = []

    def start(**values: str) -> WebProcess:
        process = _web(tmp_path, **values)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc and process.proc.poll() is None:
            process.kill()


def _chat_with_image(client: httpx.Client, key: str, url: str) -> httpx.Response:
    body = {
        "model": CHAT_MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]}],
    }
    return client.post("generate/chat/async", json=body, headers={"apikey": key})


def _vision_worker(client: httpx.Client, key: str) -> None:
    declaration = {**CHAT_DECLARATION, "chat_features": [*CHAT_DECLARATION["chat_features"], "vision"],
                   "image_transports": ["url", "base64"]}
    pop = {"name": "review-vision", "models": [CHAT_MODEL], "max_length": 512, "max_context_length": 4096,
           "bridge_agent": SCRIBE_AGENT, **declaration}
    answer = client.post("generate/text/pop", json=pop, headers={"apikey": key})
    assert answer.status_code == 200 and answer.json()["id"] is None, answer.text


def test_slow_image_urls_do_not_take_every_web_thread(web_factory, drip_host):
    web = web_factory(HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS="127.0.0.0/8")
    requester = web.manage("horde_user", "create", "review-requester", "--kudos", "1000", "--trusted").split()[-1]
    owner = web.manage("horde_user", "create", "review-owner", "--trusted").split()[-1]
    client = httpx.Client(base_url=web.url, timeout=60)
    _vision_worker(client, owner)

    # As many image requests as the process has threads, each with one URL that drips.
    with ThreadPoolExecutor(WEB_THREADS) as pool:
        sent = [pool.submit(_chat_with_image, httpx.Client(base_url=web.url, timeout=60), requester,
                            drip_host.url(f"/drip-{n}.png")) for n in range(WEB_THREADS)]
        # Each is either fetching (its connection reached the host) or answered already.
        deadline = time.monotonic() + 10
        while drip_host.connections + sum(f.done() for f in sent) < WEB_THREADS:
            assert time.monotonic() < deadline, "the image requests neither fetched nor answered"
            time.sleep(0.05)
        fetching = drip_host.connections

        started = time.monotonic()
        heartbeat = client.get("status/heartbeat", timeout=30)
        heartbeat_seconds = time.monotonic() - started
        started = time.monotonic()
        _vision_worker(client, owner)  # a worker's pop
        pop_seconds = time.monotonic() - started
        drip_host.released.set()  # measured: the fetches need not wait out their bound
        answers = [f.result() for f in sent]

    assert heartbeat.status_code == 200
    # The other routes keep a thread: before the fix both waited out the 15 s fetch bound.
    assert heartbeat_seconds < 3 and pop_seconds < 3, (heartbeat_seconds, pop_seconds, fetching)
    assert fetching == WEB_THREADS // 2
    busy = [a for a in answers if a.status_code == 503]
    assert len(busy) == WEB_THREADS - fetching, [a.text for a in answers]
    for answer in busy:
        assert answer.json()["rc"] == "ChatImagesBusy", answer.text
        assert int(answer.headers["Retry-After"]) > 0
    fetched = [a for a in answers if a.status_code != 503]
    assert all(a.status_code == 400 and a.json()["rc"] == "SourceImageUrlInvalid" for a in fetched), [
        a.text for a in fetched
    ]


def test_a_refused_image_url_does_not_tell_the_address_its_host_resolves_to(web_factory):
    web = web_factory()
    requester = web.manage("horde_user", "create", "review-requester", "--kudos", "1000", "--trusted").split()[-1]
    owner = web.manage("horde_user", "create", "review-owner", "--trusted").split()[-1]
    client = httpx.Client(base_url=web.url, timeout=60)
    _vision_worker(client, owner)

    answer = _chat_with_image(client, requester, "http://localhost:9/internal.png")

    assert answer.status_code == 400 and answer.json()["rc"] == "SourceImageUrlRefused", answer.text
    message = answer.json()["message"]
    assert "localhost" in message and "not public" in message, message
    assert "127.0.0.1" not in message and "::1" not in message, message


def _cookies(answer: httpx.Response) -> dict[str, str]:
    """The cookies an answer sets, secure ones included (a browser behind the proxy's TLS keeps them)."""
    return dict(
        header.split(";", 1)[0].strip().split("=", 1) for header in answer.headers.get_list("set-cookie")
    )


def test_the_admin_logs_in_behind_a_tls_proxy_from_its_trusted_origin_only(web_factory):
    """The documented deployment serves the horde behind a reverse proxy that ends TLS, and the
    admin's cookies are secure-only there: a browser's login then comes with `Origin: https://...`
    to a process that sees plain HTTP. Django's CSRF check refused it (403) with no setting to name
    the proxy's origin; CSRF_TRUSTED_ORIGINS names it, and any other origin is still refused."""
    port = free_port()
    web = web_factory(CSRF_TRUSTED_ORIGINS=f"https://127.0.0.1:{port}", DJANGO_SUPERUSER_PASSWORD="a-Long-pass-4321")
    web.manage("createsuperuser", "--noinput", "--username", "root", "--email", "root@example.org")
    admin = httpx.Client(base_url=f"http://127.0.0.1:{web.port}", timeout=30)
    form = admin.get("/admin/login/")
    token = form.text.split('name="csrfmiddlewaretoken" value="', 1)[1].split('"', 1)[0]
    cookie = "; ".join(f"{name}={value}" for name, value in _cookies(form).items())

    def login(origin: str) -> httpx.Response:
        return admin.post(
            "/admin/login/?next=/admin/",
            data={"csrfmiddlewaretoken": token, "username": "root", "password": "a-Long-pass-4321", "next": "/admin/"},
            headers={"Cookie": cookie, "Origin": origin, "Referer": f"{origin}/admin/login/"},
        )

    assert login("https://evil.example").status_code == 403
    answer = login(f"https://127.0.0.1:{port}")
    assert answer.status_code == 302 and answer.headers["Location"] == "/admin/", answer.text[:300]
    assert "sessionid" in _cookies(answer)
    assert "Secure" in next(h for h in answer.headers.get_list("set-cookie") if h.startswith("sessionid="))


def test_a_text_requests_repeated_stop_sequences_reach_its_worker_once(web_factory):
    """Upstream's bound counts the distinct stop sequences (at most 128, ADR 0072), so a body of
    100,000 copies of one passed it, and every pop of the request carried the 100,000 copies to a
    worker (about 600 KB of JSON per pop). The worker now receives each sequence once, in order."""
    web = web_factory()
    requester = web.manage("horde_user", "create", "review-requester", "--kudos", "1000", "--trusted").split()[-1]
    owner = web.manage("horde_user", "create", "review-owner", "--trusted").split()[-1]
    client = httpx.Client(base_url=web.url, timeout=60)
    model = "koboldcpp/Llama-3-8B"
    pop = {"name": "review-text", "models": [model], "max_length": 512, "max_context_length": 4096,
           "bridge_agent": SCRIBE_AGENT}
    assert client.post("generate/text/pop", json=pop, headers={"apikey": owner}).status_code == 200
    stops = ["\nUser:", "###"] * 50_000 + ["", "\nUser:"]
    created = client.post(
        "generate/text/async", headers={"apikey": requester},
        json={"prompt": "Once", "params": {"n": 1, "max_length": 16, "stop_sequence": stops}, "models": [model]},
    )
    assert created.status_code == 202, created.text

    job = client.post("generate/text/pop", json=pop, headers={"apikey": owner})

    assert job.status_code == 200 and job.json()["id"] is not None, job.text[:300]
    assert job.json()["payload"]["stop_sequence"] == ["\nUser:", "###"]
    assert len(job.content) < 10_000


def _png_data_url(side: int) -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(out, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_data_url_images_wait_for_an_image_slot_too(web_factory, drip_host):
    """Decoding and re-encoding images holds a thread as a fetch does: 15 data URLs of a 3072x3072
    PNG (35 KB each, within an untrusted requester's 5 MiB) took 3.5 s of a web thread, and four
    such requests from the anonymous key, cancelled at once to free its concurrency, stalled the
    process's heartbeat 6.3 s. Every request with images takes an image slot: with the one slot
    of this process held by a slow image URL, a request of data URLs is answered 503 at once."""
    web = web_factory(HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS="127.0.0.0/8")
    requester = web.manage("horde_user", "create", "review-requester", "--kudos", "1000", "--trusted").split()[-1]
    owner = web.manage("horde_user", "create", "review-owner", "--trusted").split()[-1]
    client = httpx.Client(base_url=web.url, timeout=60)
    _vision_worker(client, owner)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_chat_with_image, httpx.Client(base_url=web.url, timeout=60), requester,
                           drip_host.url("/drip.png"))
        deadline = time.monotonic() + 10
        while drip_host.connections < 1:
            assert time.monotonic() < deadline and not slow.done(), "the slow image request did not fetch"
            time.sleep(0.05)

        started = time.monotonic()
        busy = _chat_with_image(client, requester, _png_data_url(3072))
        busy_seconds = time.monotonic() - started
        drip_host.released.set()
        slow.result()

    assert busy.status_code == 503 and busy.json()["rc"] == "ChatImagesBusy", busy.text
    assert int(busy.headers["Retry-After"]) > 0 and busy_seconds < 3
    # With the slot free again the same request is served.
    assert _chat_with_image(client, requester, _png_data_url(3072)).status_code == 202
