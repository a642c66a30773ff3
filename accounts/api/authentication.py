from __future__ import annotations

from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed

from accounts.selectors import user_get_by_api_key
from contract.errors import HordeError


class ApiKeyAuthentication(BaseAuthentication):
    """The upstream `apikey` header. No header leaves the caller unauthenticated (views decide)."""

    def authenticate(self, request):
        api_key = request.headers.get("apikey")
        if not api_key:
            return None
        user = user_get_by_api_key(api_key)
        if user is None:
            raise HordeError("InvalidAPIKey", "No user matching sent API Key. Have you remembered to register at https://aihorde.net/register ?")
        return (user, api_key)

    def authenticate_header(self, request) -> str:
        return "apikey"


__all__ = ["ApiKeyAuthentication", "AuthenticationFailed"]
