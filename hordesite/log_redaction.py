"""Secrets that clients put in a URL path, kept out of the web process's logs.

`/api/v2/sharedkeys/<id>` carries a shared key's id in its path, and the id is a credential: whoever
holds it spends its owner's kudos. SillyTavern 1.19.0 sends the user's own API key there too (its
"show kudos" asks for the key as a shared key before it finds the user; docs/adr/0108). The horde
stores only keys' hashes, so a log line holding the path whole would be the one place a key is kept
readable. The two lines the web process writes about a request, daphne's access line and
django.request's warning on a 4xx, name such a path with the id replaced.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

REDACTED = "<redacted>"
# The id runs to the next slash, query, space or quote (an access line quotes the request); any case,
# since another spelling of the route is a 404 that logs its path too.
_SECRET_PATH = re.compile(r"(/api/v2/sharedkeys/)[^/?#\s\"]+", re.IGNORECASE)


def redact_path(text: str) -> str:
    return _SECRET_PATH.sub(r"\g<1>" + REDACTED, text)


class RedactSecretPaths(logging.Filter):
    """On django.request (settings.LOGGING): its "%s: %s" warning's path argument, redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_path(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact_path(arg) if isinstance(arg, str) else arg for arg in record.args)
        return True


ActionLogger = Callable[[str, str, dict[str, Any]], None]


def redacting_action_logger(action_logger: ActionLogger) -> ActionLogger:
    """daphne's access log (its `action_logger`), given each request's path redacted."""

    def log(protocol: str, action: str, details: dict[str, Any]) -> None:
        if isinstance(details.get("path"), str):
            details = {**details, "path": redact_path(details["path"])}
        action_logger(protocol, action, details)

    return log
