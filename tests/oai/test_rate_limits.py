"""Rate limits of the generate routes behind a front (spec chat_requests.md, Rate limits; issue 11
item 6; docs/adr/0015-rate-limits-behind-a-front.md), raced with real parallel connections against
the live horde: through the mounted front (in process), the front over HTTP (as `python -m oai`
calls), the standalone process itself, and the native routes.

Each client connects from its own loopback address (127.0.0.2, 127.0.0.3...), so the horde and the
front see the addresses real clients would have. Limits of the hour or longer are used where a test
counts refusals, so a window boundary cannot split the count (`_fresh_window`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from oai.settings import load_settings
from tests.oai.conftest import MODEL
from tests.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "Hello?"}]
CHAT_BODY = {"model": MODEL, "messages": USER}
PASSKEY = "front-passkey-for-the-tests"


# --- helpers --------------------------------------------------------------------------------------


def _client_from(address: str, **kwargs: Any) -> httpx.Client:
    """An HTTP client whose connections come from `address` (any 127.x address is loopback)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30, **kwargs)


def _race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Start every call at once on its own thread and connection; their results in order."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(index: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            results[index] = call()
        except Exception as error:  # the assertion reports it
            results[index] = error

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def _fresh_window(seconds: int = 3600) -> None:
    """Wait out the end of the current fixed window when it is near, so a test's hits share one."""
    left = seconds - time.time() % seconds
    if left < 10:
        time.sleep(left + 0.1)


def _completion(
    base: str, key: str | None, address: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    sent = {"Authorization": f"Bearer {key}"} if key else {}
    with _client_from(address) as http:
        return http.post(f"{base}/chat/completions", json=CHAT_BODY, headers={**sent, **(headers or {})})


def _chat_async(live, key: str | None, address: str, headers: dict[str, str] | None = None) -> httpx.Response:
    sent = {"apikey": key} if key else {}
    with _client_from(address) as http:
        return http.post(
            f"{live.url}/api/v2/generate/chat/async", json=CHAT_BODY, headers={**sent, **(headers or {})}
        )


def _text_async(live, key: str | None, address: str, headers: dict[str, str] | None = None) -> httpx.Response:
    sent = {"apikey": key} if key else {}
    with _client_from(address) as http:
        return http.post(
            f"{live.url}/api/v2/generate/text/async",
            json={"prompt": "Once upon a time", "models": [MODEL]},
            headers={**sent, **(headers or {})},
        )


def _codes(responses: list[Any]) -> list[int]:
    assert all(isinstance(r, httpx.Response) for r in responses), responses
    return sorted(r.status_code for r in responses)


def _assert_front_rate_limited(response: httpx.Response, per: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "RateLimited"
    assert error["message"].startswith("Rate limit exceeded: ") and error["message"].endswith(f" per {per}.")
    assert int(response.headers["Retry-After"]) > 1


def _stored_addresses() -> list[str]:
    from chat.models import GenerationRequest

    return sorted(GenerationRequest.objects.values_list("ip_address", flat=True))


def _shipped_limits(settings) -> None:
    """The limits as shipped (hordesite/settings.py defaults), instead of the suite's generous ones."""
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["2/second", "90/minute"]
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = None
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = None
    settings.HORDE_API_KEY_RATE_LIMITS = ["2/second"]
    settings.HORDE_ANONYMOUS_KEY_RATE_LIMITS = ["60/second"]


@pytest.fixture
def front_over_http(front, live_horde, settings):
    """The front calling the horde over HTTP, as the standalone front does, with a known passkey."""
    settings.HORDE_PROXY_PASSKEYS = [PASSKEY]

    def configure(**overrides: Any):
        overrides.setdefault("proxy_passkey", PASSKEY)
        return front.configure(native_roots=[f"{live_horde.url}/api/v2"], **overrides)

    return configure


# --- six parallel completions from one user --------------------------------------------------------


def test_six_parallel_chat_completions_from_one_user_are_served(front, requester, start_worker, settings):
    """The issue's exchange: the openai SDK (its retries off), six completions at once from one user at
    one address, against the limits as shipped (2/second per address and per key). The horde refuses
    the submits over its 2/second; the front sends each again when the second has passed."""
    _shipped_limits(settings)
    start_worker()
    with _client_from("127.0.0.2") as http:
        sdk = openai.OpenAI(base_url=front.live.v1, api_key=requester.key, max_retries=0, http_client=http)
        results = _race([lambda: sdk.chat.completions.create(model=MODEL, messages=USER) for _ in range(6)])
    assert all(not isinstance(r, Exception) for r in results), results
    assert all(r.choices[0].message.content for r in results)
    refused = [
        value
        for attrs, value in front.metrics()["horde.oai.native.duration"]
        if attrs == {"horde.call_type": "submit", "horde.outcome": "refused"}
    ]
    # Six submits within at most two one-second windows: at least two were refused and sent again.
    assert refused and refused[0][0] >= 2
    assert _stored_addresses() == ["127.0.0.2"] * 6


def test_without_waiting_the_same_six_meet_the_limit(front, requester, start_worker, settings):
    """The counterpart: a front that does not wait out the window passes the horde's 429 on."""
    _shipped_limits(settings)
    front.configure(rate_limit_wait_seconds=0)
    start_worker()
    responses = _race([lambda: _completion(front.live.v1, requester.key, "127.0.0.2") for _ in range(6)])
    codes = _codes(responses)
    assert codes.count(429) >= 2 and set(codes) == {200, 429}
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.json()["error"]["type"] == "rate_limit_error" and limited.headers["Retry-After"] == "1"


# --- each client of the front has its own budget ---------------------------------------------------


def _two_clients(front, requester) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """Client A (127.0.0.2) sends three completions and client B (127.0.0.3) two, all at once, against
    2 per hour per address."""
    _fresh_window()
    calls = [lambda: _completion(front.live.v1, requester.key, "127.0.0.2") for _ in range(3)]
    calls += [lambda: _completion(front.live.v1, requester.key, "127.0.0.3") for _ in range(2)]
    responses = _race(calls)
    return responses[:3], responses[3:]


def _hourly_chat_limit(settings, text: str = "2/hour") -> None:
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = "1000/second"
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = text


def test_two_clients_of_the_mounted_front_are_limited_separately(front, requester, start_worker, settings):
    _hourly_chat_limit(settings)
    start_worker()
    assert front.state().client.in_process  # no passkey configured: the process's own
    a, b = _two_clients(front, requester)
    assert _codes(a) == [200, 200, 429] and _codes(b) == [200, 200]
    _assert_front_rate_limited(next(r for r in a if r.status_code == 429), "client address")
    assert _stored_addresses() == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]


def test_two_clients_of_a_front_over_http_are_limited_separately(
    front, front_over_http, requester, start_worker, settings
):
    _hourly_chat_limit(settings)
    front_over_http()
    assert not front.state().client.in_process
    start_worker()
    a, b = _two_clients(front, requester)
    assert _codes(a) == [200, 200, 429] and _codes(b) == [200, 200]
    assert _stored_addresses() == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]


@pytest.mark.parametrize("passkey", ["", "a-passkey-the-horde-does-not-know"])
def test_without_a_known_passkey_the_users_of_a_front_share_its_address(
    front, front_over_http, requester, start_worker, settings, passkey
):
    """The spec's "clients behind one egress address share both budgets": the horde ignores the
    forwarded address of a front it does not know."""
    _hourly_chat_limit(settings, "3/hour")
    front_over_http(proxy_passkey=passkey)
    start_worker()
    a, b = _two_clients(front, requester)
    assert _codes(a + b) == [200, 200, 200, 429, 429]
    assert _stored_addresses() == ["127.0.0.1"] * 3  # the front's own address


def test_the_front_counts_a_forwarded_address_only_from_its_trusted_proxies(
    front, requester, start_worker, settings
):
    """A client cannot pick the address the front forwards: the front ignores X-Forwarded-For without
    trusted proxy hops (and never passes a client's Proxied-For or Proxy-Authorization on), and reads
    it with HORDE_OAI_TRUSTED_PROXY_COUNT."""
    _hourly_chat_limit(settings)
    settings.HORDE_PROXY_PASSKEYS = [PASSKEY]
    start_worker()
    _fresh_window()

    def forged(n: int) -> httpx.Response:
        headers = {
            "X-Forwarded-For": f"203.0.113.{n}",
            "Proxied-For": f"198.51.100.{n}",
            "Proxy-Authorization": PASSKEY,
        }
        return _completion(front.live.v1, requester.key, "127.0.0.2", headers)

    assert _codes(_race([lambda n=n: forged(n) for n in range(3)])) == [200, 200, 429]
    front.configure(trusted_proxy_count=1)
    assert _codes(_race([lambda n=n: forged(n) for n in range(3, 6)])) == [200, 200, 200]
    assert _stored_addresses() == ["127.0.0.2", "127.0.0.2", "203.0.113.3", "203.0.113.4", "203.0.113.5"]


# --- the native routes: the passkey -----------------------------------------------------------------


@pytest.mark.parametrize("route", [_chat_async, _text_async])
def test_a_forged_forwarded_address_is_ignored_without_a_known_passkey(
    live_horde, front, requester, start_worker, settings, route
):
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = "2/hour"
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["2/hour"]
    settings.HORDE_PROXY_PASSKEYS = [PASSKEY]
    start_worker()
    _fresh_window()

    def send(n: int, passkey: str | None) -> httpx.Response:
        headers = {"Proxied-For": f"198.51.100.{n}"}
        if passkey is not None:
            headers["Proxy-Authorization"] = passkey
        return route(live_horde, requester.key, "127.0.0.4", headers)

    forged = _race([lambda n=n: send(n, None if n % 2 else "wrong") for n in range(3)])
    assert _codes(forged) == [202, 202, 429]
    assert next(r for r in forged if r.status_code == 429).json() == {
        "message": "Rate limit exceeded: 2/hour per client address.",
        "rc": "RateLimited",
    }
    known = _race([lambda n=n: send(n, PASSKEY) for n in range(10, 13)])
    assert _codes(known) == [202, 202, 202]
    assert _stored_addresses() == ["127.0.0.4"] * 2 + ["198.51.100.10", "198.51.100.11", "198.51.100.12"]
    # A known proxy's Proxied-For that is not an address counts the proxy itself.
    assert send_raw(route, live_horde, requester.key, "127.0.0.4", "not-an-address").status_code == 429


def send_raw(route, live_horde, key: str, address: str, forwarded: str) -> httpx.Response:
    return route(live_horde, key, address, {"Proxied-For": forwarded, "Proxy-Authorization": PASSKEY})


# --- the per-key limit ------------------------------------------------------------------------------


def test_the_per_key_limit_holds_across_addresses_through_the_front(
    front, requester, make_user, start_worker, settings
):
    """One key from three client addresses: the per-key limit (the text route's) counts them together;
    another key has its own."""
    settings.HORDE_API_KEY_RATE_LIMITS = ["2/hour"]
    start_worker()
    _fresh_window()
    other = make_user("other-requester", kudos=100_000)
    calls = [
        lambda a=a: _completion(front.live.v1, requester.key, a)
        for a in ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    ]
    calls.append(lambda: _completion(front.live.v1, other.key, "127.0.0.2"))
    responses = _race(calls)
    assert _codes(responses[:3]) == [200, 200, 429] and responses[3].status_code == 200
    _assert_front_rate_limited(next(r for r in responses if r.status_code == 429), "API key")


def test_the_per_key_limit_on_the_native_routes(live_horde, front, requester, start_worker, settings):
    """Each route counts its own; the anonymous key, which everyone without a key shares, has its
    own limit (upstream's 60/second beside 2/second)."""
    settings.HORDE_API_KEY_RATE_LIMITS = ["2/hour"]
    settings.HORDE_ANONYMOUS_KEY_RATE_LIMITS = ["3/hour"]
    start_worker()
    _fresh_window()
    addresses = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
    chat = _race([lambda a=a: _chat_async(live_horde, requester.key, a) for a in addresses[:3]])
    assert _codes(chat) == [202, 202, 429]
    assert next(r for r in chat if r.status_code == 429).json()["message"] == (
        "Rate limit exceeded: 2/hour per API key."
    )
    text = _race([lambda a=a: _text_async(live_horde, requester.key, a) for a in addresses[:3]])
    assert _codes(text) == [202, 202, 429]
    anonymous = _race([lambda a=a: _chat_async(live_horde, None, a) for a in addresses])
    assert _codes(anonymous) == [202, 202, 202, 429]
    explicit_anonymous = _chat_async(live_horde, "0000000000", "127.0.0.6")
    assert explicit_anonymous.status_code == 429  # the same key, sent or not


# --- whitelisted service addresses -----------------------------------------------------------------


def test_a_whitelisted_service_address_gets_the_whitelisted_limits(
    live_horde, front, requester, make_user, start_worker, settings
):
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = "1/hour"
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1/hour"]
    settings.HORDE_WHITELISTED_SERVICE_IPS = ["127.0.0.5", "10.20.0.0/16"]
    settings.HORDE_WHITELISTED_SERVICE_RATE_LIMITS = ["1000/second", "3/hour"]
    settings.HORDE_PROXY_PASSKEYS = [PASSKEY]
    start_worker()
    _fresh_window()
    keys = [make_user(f"service-user-{n}", kudos=1000).key for n in range(4)]
    service = _race([lambda k=k: _chat_async(live_horde, k, "127.0.0.5") for k in keys])
    ordinary = _race([lambda k=k: _chat_async(live_horde, k, "127.0.0.6") for k in keys[:2]])
    assert _codes(service) == [202, 202, 202, 429] and _codes(ordinary) == [202, 429]
    assert next(r for r in service if r.status_code == 429).json()["message"] == (
        "Rate limit exceeded: 3/hour per client address."
    )
    # The text route's own whitelisted budget; and a network entry, forwarded by a known front.
    text = _race([lambda k=k: _text_async(live_horde, k, "127.0.0.5") for k in keys])
    assert _codes(text) == [202, 202, 202, 429]
    forwarded = {"Proxied-For": "10.20.3.4", "Proxy-Authorization": PASSKEY}
    through_proxy = _race([lambda k=k: _chat_async(live_horde, k, "127.0.0.7", forwarded) for k in keys])
    assert _codes(through_proxy) == [202, 202, 202, 429]


def test_a_whitelisted_client_of_the_front_gets_the_whitelisted_limits(
    front, requester, make_user, start_worker, settings
):
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = "1/hour"
    settings.HORDE_WHITELISTED_SERVICE_IPS = ["127.0.0.5"]
    settings.HORDE_WHITELISTED_SERVICE_RATE_LIMITS = ["1000/second", "3/hour"]
    start_worker()
    _fresh_window()
    keys = [make_user(f"bot-user-{n}", kudos=100_000).key for n in range(3)]
    calls = [lambda k=k: _completion(front.live.v1, k, "127.0.0.5") for k in keys]
    calls += [lambda k=k: _completion(front.live.v1, k, "127.0.0.6") for k in keys[:2]]
    responses = _race(calls)
    assert _codes(responses[:3]) == [200, 200, 200] and _codes(responses[3:]) == [200, 429]


# --- chat limits follow the text submit limit -------------------------------------------------------


def test_unset_chat_limits_follow_the_text_submit_limit(live_horde, front, requester, start_worker, settings):
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = None
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = None
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1000/second", "2/hour"]
    start_worker()
    _fresh_window()
    chat = _race([lambda: _chat_async(live_horde, requester.key, "127.0.0.2") for _ in range(3)])
    assert _codes(chat) == [202, 202, 429]
    assert next(r for r in chat if r.status_code == 429).json()["message"] == (
        "Rate limit exceeded: 2/hour per client address."
    )
    # The same limit, its own budget: the chat submits did not spend the text route's.
    text = _race([lambda: _text_async(live_horde, requester.key, "127.0.0.2") for _ in range(3)])
    assert _codes(text) == [202, 202, 429]
    # Set, the long window is its own; the short one still follows the text route's.
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = "3/hour"
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1/second", "2/hour"]
    burst = _race([lambda: _chat_async(live_horde, requester.key, "127.0.0.3") for _ in range(3)])
    assert 429 in _codes(burst)
    assert next(r for r in burst if r.status_code == 429).json()["message"] == (
        "Rate limit exceeded: 1/second per client address."
    )


def test_unset_chat_limits_follow_the_text_submit_limit_through_the_front(
    front, requester, start_worker, settings
):
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = None
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = None
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["2/hour"]
    start_worker()
    _fresh_window()
    responses = _race([lambda: _completion(front.live.v1, requester.key, "127.0.0.2") for _ in range(3)])
    assert _codes(responses) == [200, 200, 429]
    _assert_front_rate_limited(next(r for r in responses if r.status_code == 429), "client address")


def test_chat_request_limits_per_ip_by_setting(settings):
    from accounts.ratelimit import chat_request_limits_per_ip

    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = None
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = None
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["2/second", "90/minute"]
    assert chat_request_limits_per_ip() == ["2/second", "90/minute"]
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["90/minute", "1000/day", "2/second"]
    assert chat_request_limits_per_ip() == ["2/second", "1000/day"]
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["5/minute"]
    assert chat_request_limits_per_ip() == ["5/minute"]
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = "5/second"
    assert chat_request_limits_per_ip() == ["5/second", "5/minute"]
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = "300/minute"
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = []
    assert chat_request_limits_per_ip() == ["5/second", "300/minute"]
    settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = None
    settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = None
    assert chat_request_limits_per_ip() == []


@pytest.mark.parametrize(
    "name, value",
    [
        ("HORDE_API_KEY_RATE_LIMITS", ["2 every second"]),
        ("HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP", "90/fortnight"),
        ("HORDE_TEXT_ASYNC_RATE_LIMITS", ["5"]),
        ("HORDE_WHITELISTED_SERVICE_IPS", ["10.0.0.300"]),
    ],
)
def test_a_limit_that_cannot_be_read_fails_at_start(settings, name, value):
    from django.core.exceptions import ImproperlyConfigured

    from accounts.ratelimit import validate_rate_limit_settings

    validate_rate_limit_settings()
    setattr(settings, name, value)
    with pytest.raises(ImproperlyConfigured, match=name):
        validate_rate_limit_settings()


@pytest.mark.parametrize(
    "text, limit",
    [
        ("90/minute", (90, 60)),
        ("2 per second", (2, 1)),
        ("10/2 minutes", (10, 120)),
        ("1 per 3 hours", (1, 10_800)),
        ("3/Day", (3, 86_400)),
        ("1/year", (1, 31_104_000)),
    ],
)
def test_limits_read_flask_limiter_notation(text, limit):
    from accounts.ratelimit import parse_limit

    assert parse_limit(text) == limit


def test_only_a_rate_limit_refusal_is_waited_out():
    from oai.horde_client import NativeAnswer, rate_limit_pause

    after = httpx.Headers({"Retry-After": "3"})
    assert rate_limit_pause(NativeAnswer(429, {"rc": "RateLimited", "message": "..."}, after)) == 3
    # The concurrency limit is not a window: waiting a few seconds would not lift it.
    assert rate_limit_pause(NativeAnswer(429, {"rc": "TooManyPrompts", "message": "..."}, after)) is None
    assert rate_limit_pause(NativeAnswer(429, {"rc": "RateLimited"}, httpx.Headers())) is None
    assert rate_limit_pause(NativeAnswer(202, {"id": "x"}, after)) is None
    assert (
        rate_limit_pause(NativeAnswer(429, {"rc": "RateLimited"}, httpx.Headers({"Retry-After": "0"}))) == 0.5
    )


# --- lost-submit recovery under the limits ---------------------------------------------------------


@pytest.fixture
def losing_root(live_horde):
    """A first native root that forwards the submit to the horde and drops its answer."""
    from http.server import ThreadingHTTPServer

    from tests.oai.test_front import _LosingProxy

    _LosingProxy.target = f"{live_horde.url}/api/v2"
    _LosingProxy.seen = []
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _LosingProxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}/api/v2"
    proxy.shutdown()


def test_a_recovery_waits_out_the_per_key_window(
    front, live_horde, losing_root, requester, start_worker, settings
):
    """The limits are counted before the operation key is looked up, so the re-sent submit of a lost
    answer meets the per-key limit its first send spent: it is sent again when the second has passed,
    and finds the first one's claim."""
    settings.HORDE_API_KEY_RATE_LIMITS = ["1/second"]
    front.configure(native_roots=[losing_root, f"{live_horde.url}/api/v2"])
    start_worker()
    response = _completion(front.live.v1, requester.key, "127.0.0.2")
    assert response.status_code == 200, response.text
    assert len(_stored_addresses()) == 1
    assert ({"horde.existing_claim": True}, 1) in front.metrics()["horde.oai.submit.recoveries"]


def test_a_recovery_refused_by_a_long_window_is_an_unknown_outcome(
    front, live_horde, losing_root, requester, start_worker, settings
):
    """A 429 to the re-sent submit does not say whether the first landed: not a plain 429, which a
    client would retry as a new request."""
    settings.HORDE_API_KEY_RATE_LIMITS = ["1/hour"]
    front.configure(native_roots=[losing_root, f"{live_horde.url}/api/v2"])
    start_worker()
    _fresh_window()
    response = _completion(front.live.v1, requester.key, "127.0.0.2")
    assert response.status_code == 502 and response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["metadata"]["submit_outcome"] == "unknown"
    assert len(_stored_addresses()) == 1  # the first submit did land


# --- the standalone front ---------------------------------------------------------------------------


def test_front_settings_read_the_passkey_and_the_wait():
    assert load_settings({}).proxy_passkey == "" and load_settings({}).rate_limit_wait_seconds == 5.0
    settings = load_settings({"HORDE_OAI_PROXY_PASSKEY": " pk ", "HORDE_OAI_RATE_LIMIT_WAIT_SECONDS": "0"})
    assert settings.proxy_passkey == "pk" and settings.rate_limit_wait_seconds == 0.0


def test_python_m_oai_forwards_its_clients_addresses(live_horde, front, requester, start_worker, settings):
    """The standalone process with HORDE_OAI_PROXY_PASSKEY: its two clients are limited apart."""
    _hourly_chat_limit(settings)
    settings.HORDE_PROXY_PASSKEYS = [PASSKEY]
    start_worker()
    port = free_port()
    env = {
        **os.environ,
        "HORDE_OAI_NATIVE_ROOTS": f"{live_horde.url}/api/v2",
        "HORDE_OAI_PORT": str(port),
        "HORDE_OAI_POLL_SECONDS": "0.1",
        "HORDE_OAI_SIGNAL_RECHECK_SECONDS": "0.5",
        "HORDE_OAI_PROXY_PASSKEY": PASSKEY,
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "oai"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert process.poll() is None, process.stderr.read().decode()
        _fresh_window()
        calls = [lambda: _completion(f"{base}/v1", requester.key, "127.0.0.2") for _ in range(3)]
        calls += [lambda: _completion(f"{base}/v1", requester.key, "127.0.0.3") for _ in range(2)]
        responses = _race(calls)
        assert _codes(responses[:3]) == [200, 200, 429] and _codes(responses[3:]) == [200, 200]
        _assert_front_rate_limited(next(r for r in responses if r.status_code == 429), "client address")
        assert _stored_addresses() == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
    finally:
        process.terminate()
        process.wait(10)
