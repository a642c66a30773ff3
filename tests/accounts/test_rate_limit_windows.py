"""A submit's limit windows, counted together (one Redis round trip, or in process without Redis):
in order, the address's then the key's, up to the first one over its allowance."""

from __future__ import annotations

import uuid

from chat.models import GenerationRequest


def _submit(horde, key: str, address: str):
    return horde.client.post(
        "/api/v2/generate/text/async",
        {"prompt": "Once upon a time", "models": ["Gryphe/MythoMax-L2-13b"]},
        format="json",
        HTTP_APIKEY=key,
        REMOTE_ADDR=address,
    )


def test_a_refusal_by_the_address_counts_nothing_against_the_key(horde, make_user, settings):
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1/hour", "100/day"]
    settings.HORDE_API_KEY_RATE_LIMITS = ["2/hour"]
    key = make_user(f"rl-{uuid.uuid4().hex[:6]}", kudos=1000).key
    assert _submit(horde, key, "10.0.0.1").status_code == 202
    refused = _submit(horde, key, "10.0.0.1")
    assert refused.status_code == 429
    assert refused.json()["message"] == "Rate limit exceeded: 1/hour per client address."
    assert refused["Retry-After"].isdigit() and 1 <= int(refused["Retry-After"]) <= 3600
    # The key's second submit: the address's refusal above took none of its two.
    assert _submit(horde, key, "10.0.0.2").status_code == 202
    over_key = _submit(horde, key, "10.0.0.3")
    assert over_key.status_code == 429
    assert over_key.json()["message"] == "Rate limit exceeded: 2/hour per API key."
    assert GenerationRequest.objects.count() == 2


def test_the_first_window_over_its_allowance_refuses(horde, make_user, settings):
    """The second of the address's limits refuses when the first still has room."""
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["100/hour", "2/day"]
    settings.HORDE_API_KEY_RATE_LIMITS = ["100/hour"]
    key = make_user(f"rl-{uuid.uuid4().hex[:6]}", kudos=1000).key
    assert [_submit(horde, key, "10.0.1.1").status_code for _ in range(2)] == [202, 202]
    refused = _submit(horde, key, "10.0.1.1")
    assert refused.status_code == 429
    assert refused.json()["message"] == "Rate limit exceeded: 2/day per client address."
    assert GenerationRequest.objects.count() == 2


def test_an_ipv6_client_is_counted_by_its_64_network(horde, make_user, settings):
    """A host holds a whole /64: its addresses share one allowance, another /64 has its own, and an
    IPv4 address written IPv4-mapped is that address."""
    settings.HORDE_TEXT_ASYNC_RATE_LIMITS = ["1/hour"]
    key = make_user(f"rl-{uuid.uuid4().hex[:6]}", kudos=1000).key
    assert _submit(horde, key, "2001:db8:1:2::1").status_code == 202
    assert _submit(horde, key, "2001:db8:1:2:ffff::9").status_code == 429
    assert _submit(horde, key, "2001:db8:1:3::1").status_code == 202
    assert _submit(horde, key, "10.0.2.1").status_code == 202
    assert _submit(horde, key, "::ffff:10.0.2.1").status_code == 429
    # The request row keeps the address itself.
    assert set(GenerationRequest.objects.values_list("ip_address", flat=True)) == {
        "2001:db8:1:2::1", "2001:db8:1:3::1", "10.0.2.1"
    }


def test_a_shared_key_is_counted_as_one_key_however_it_is_spelled(horde, make_user, settings):
    """A shared key authenticates in every spelling of its UUID (any case, braces, a urn, hyphens
    anywhere): each spelling must count against the one key's allowance, or a key lent out (the
    per-key limit is what bounds it across addresses) has as many allowances as spellings."""
    settings.HORDE_API_KEY_RATE_LIMITS = ["2/hour"]
    lender = make_user(f"rl-{uuid.uuid4().hex[:6]}", kudos=1000)
    shared = horde.client.put("/api/v2/sharedkeys", {}, format="json", HTTP_APIKEY=lender.key).json()["id"]
    spellings = [shared, shared.upper(), "{" + shared + "}", f"urn:uuid:{shared}", shared.replace("-", "")]
    answers = [_submit(horde, key, f"10.0.3.{n}").status_code for n, key in enumerate(spellings, start=1)]
    assert answers == [202, 202, 429, 429, 429]
    assert GenerationRequest.objects.count() == 2
