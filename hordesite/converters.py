"""Path converters of the native API.

A UUID's text is case-insensitive (RFC 9562), and upstream's lookup (PostgreSQL's uuid type) finds
a request or worker by its id in either case; Django's `uuid` converter matches lower case only, so
a client that keeps ids in upper case got 404 NotFound from the resolver.
"""

from __future__ import annotations

import uuid


class AnyCaseUUIDConverter:
    regex = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"

    def to_python(self, value: str) -> uuid.UUID:
        return uuid.UUID(value)

    def to_url(self, value: uuid.UUID | str) -> str:
        return str(value).lower()
