from __future__ import annotations

from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed

from accounts.selectors import shared_key_get, user_get_by_api_key
from contract.errors import HordeError

INVALID_API_KEY_MESSAGE = (
    # Upstream's first sentence; its second sent users to its own site, which a self-hosted horde is not.
    "No user matching sent API Key. Have you remembered to register with this horde?"
)


class ApiKeyAuthentication(BaseAuthentication):
    """The upstream `apikey` header: a user's key, or a shared key (its id), which authenticates as
    its owner with the key as `request.auth`. No header leaves the caller unauthenticated (views
    decide); the routes that act as the owner itself refuse a shared key (accounts.api.callers)."""

    def authenticate(self, request):
        api_key = request.headers.get("apikey")
        if not api_key:
            return None
        user = user_get_by_api_key(api_key)
        if user is not None:
            return (user, api_key)
        shared_key = shared_key_get(api_key)
        if shared_key is None:
            raise HordeError("InvalidAPIKey", INVALID_API_KEY_MESSAGE)
        return (shared_key.user, shared_key)

    def authenticate_header(self, request) -> str:
        return "apikey"


__all__ = ["ApiKeyAuthentication", "AuthenticationFailed"]
