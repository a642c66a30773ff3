"""A shared key through the front, as a user lends one to a chat app: the app's OpenAI SDK sends it
as its API key; the requests are the lender's, drawn from the key, and its refusals are OpenAI
errors with the horde's code."""

from __future__ import annotations

from decimal import Decimal

import openai
import pytest

from accounts.models import SharedKey
from chat.models import GenerationRequest
from tests.oai.conftest import MODEL

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello?"}]


def _sdk(front, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.live.v1, api_key=key, max_retries=0, timeout=30)


def test_a_chat_app_on_a_shared_key_is_served_as_the_lender(front, make_user, start_worker):
    lender = make_user("lender", kudos=1000)
    key = SharedKey.objects.create(user=lender.user, kudos=Decimal("100"), name="for my app")
    start_worker()
    with _sdk(front, str(key.pk)) as sdk:
        completion = sdk.chat.completions.create(model=MODEL, messages=USER)
    assert completion.choices[0].message.content
    [request] = GenerationRequest.objects.filter(is_chat=True)
    assert request.user_id == lender.user.pk and request.shared_key_id == key.pk
    key.refresh_from_db()
    assert key.utilized == request.consumed_kudos > 0
    assert key.kudos == Decimal("100") - key.utilized


def test_a_short_shared_key_is_a_permission_error_with_the_hordes_code(front, make_user, start_worker):
    lender = make_user("lender", kudos=1000)
    key = SharedKey.objects.create(user=lender.user, kudos=Decimal("2"))
    start_worker()
    with _sdk(front, str(key.pk)) as sdk, pytest.raises(openai.PermissionDeniedError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=512)
    assert caught.value.code == "SharedKeyInsufficientKudos", caught.value.body
    assert "does not have enough remaining kudos (2)" in caught.value.message
    assert not GenerationRequest.objects.exists()


def test_a_reply_over_the_keys_token_limit_is_a_bad_request_on_max_tokens(front, make_user, start_worker):
    lender = make_user("lender", kudos=1000)
    key = SharedKey.objects.create(user=lender.user, kudos=Decimal("100"), max_text_tokens=64)
    start_worker()
    with _sdk(front, str(key.pk)) as sdk, pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=USER, max_tokens=65)
    assert caught.value.param == "max_tokens", caught.value.body
    assert caught.value.body["message"] == "This shared key is limited to 64 tokens per job. You requested 65 tokens."
