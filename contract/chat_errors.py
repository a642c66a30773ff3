"""The refusals the chat contract raises: HTTP status, `rc`, message and parameter path."""

from __future__ import annotations

import re

# Return codes the chat contract raises, with their HTTP status.
CHAT_RC_STATUS: dict[str, int] = {
    "BadRequest": 400,
    "UnsupportedChatParameter": 400,
    "ChatRequestConflict": 400,
    "RequestTooLarge": 413,
    "TooManyExtraSourceImages": 400,
    "SourceImageSizeExceeded": 400,
    "SourceImageUrlInvalid": 400,
    "ChatDeclarationInvalid": 400,
    "ChatSubmitInvalid": 400,
    "ChatSubmitNonconformant": 400,
    "ChatModelMismatch": 400,
    "ChatKudosCapExceeded": 400,
}

# A native message for a refusal with a path starts with the quoted path ('models[1]', ...), so
# a caller that only has {message, rc} (the front) recovers the param from it.
NATIVE_REQUEST_PATH_PATTERN = re.compile(r"^'(?P<param>[A-Za-z_$][^'\s]*)'")


class ChatRefusal(Exception):
    """A documented refusal.

    `text` is the bare message (OpenAI's where OpenAI has one), `param` the request path, and
    `message` the native message: the text prefixed with the quoted path when there is one.
    """

    def __init__(self, rc: str, text: str, *, param: str | None = None, status: int | None = None):
        self.rc = rc
        self.text = text
        self.param = param
        self.status = status if status is not None else CHAT_RC_STATUS.get(rc, 400)
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"'{self.param}': {self.text}" if self.param else self.text

    def body(self) -> dict[str, str]:
        """The native error body."""
        return {"message": self.message, "rc": self.rc}

    def __repr__(self) -> str:
        return f"ChatRefusal({self.status}, {self.rc!r}, {self.message!r})"


class ChatDeclarationInvalid(ChatRefusal):
    def __init__(self, text: str, *, param: str | None = None):
        super().__init__("ChatDeclarationInvalid", text, param=param)


def param_from_native_message(message: str) -> str | None:
    """The request path a native refusal message starts with, if any."""
    match = NATIVE_REQUEST_PATH_PATTERN.match(message or "")
    return match.group("param") if match else None
