"""The native API as a worker uses it: find_user, pop and submit, over httpx."""

from __future__ import annotations

from typing import Any

import httpx

from contract.chat_progress import PROGRESS_ROUTE
from workers.bridge import BRIDGE_AGENT

# The upstream worker's timeouts (spec: existing-clients.md): pop 40 s, submit 60 s.
POP_TIMEOUT = 40.0
SUBMIT_TIMEOUT = 60.0

# A progress post is small and frequent: a slow answer is not worth holding the backend's stream for.
PROGRESS_TIMEOUT = 10.0

# Return codes after which popping again cannot help until the configuration changes.
FATAL_POP_RCS = frozenset(
    {"InvalidAPIKey", "AnonForbiddenWorker", "AnonForbidden", "ChatDeclarationInvalid", "ProfaneWorkerName",
     "WrongCredentials", "TooManySameIPs", "NotTrusted"}
)


class HordeUnavailable(Exception):
    """The horde cannot be reached or answered 5xx/429: retry with backoff."""


class HordeRefused(Exception):
    """A 4xx with the native body {message, rc}."""

    def __init__(self, status: int, rc: str, message: str):
        super().__init__(f"{status} {rc}: {message}")
        self.status = status
        self.rc = rc
        self.message = message


class HordeClient:
    def __init__(self, url: str, api_key: str, *, transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self._client = httpx.Client(
            base_url=f"{self.url}/api/v2/",
            headers={"apikey": api_key, "Client-Agent": BRIDGE_AGENT},
            timeout=httpx.Timeout(SUBMIT_TIMEOUT, connect=10.0),
            transport=transport,
        )

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, *, timeout: float, json: Any = None) -> Any:
        try:
            response = self._client.request(method, path, json=json, timeout=timeout)
        except httpx.HTTPError as error:
            raise HordeUnavailable(f"{type(error).__name__}: {error}") from None
        if response.status_code >= 500 or response.status_code == 429:
            raise HordeUnavailable(f"{response.status_code}: {response.text[:200]}")
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code >= 400:
            body = body if isinstance(body, dict) else {}
            raise HordeRefused(
                response.status_code,
                str(body.get("rc") or "Unknown"),
                str(body.get("message") or response.text[:200]),
            )
        return body

    def find_user(self) -> dict[str, Any]:
        return self._call("GET", "find_user", timeout=POP_TIMEOUT)

    def pop(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "generate/text/pop", json=body, timeout=POP_TIMEOUT)

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "generate/text/submit", json=body, timeout=SUBMIT_TIMEOUT)

    def progress(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST the progress route: (status, body) for any answer; HordeUnavailable without one."""
        try:
            response = self._client.post(PROGRESS_ROUTE.removeprefix("/api/v2/"), json=body, timeout=PROGRESS_TIMEOUT)
        except httpx.HTTPError as error:
            raise HordeUnavailable(f"{type(error).__name__}: {error}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        return response.status_code, answer if isinstance(answer, dict) else {}

    def fetch_json(self, url: str, *, timeout: float = 30.0) -> Any:
        """A messages_url: a presigned URL outside the API, fetched without the API key."""
        try:
            response = httpx.get(url, timeout=timeout, follow_redirects=True)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as error:
            raise HordeUnavailable(f"messages_url: {error}") from None
