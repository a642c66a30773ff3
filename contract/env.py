"""The one environment reader of every process's settings (the horde's, the front's): django-environ's,
whose cast errors name the variable and its value, so `HORDE_DEFAULT_CONCURRENCY=ten` stops a process
with "HORDE_DEFAULT_CONCURRENCY='ten' cannot be read: invalid literal for int() ..." rather than a bare
ValueError; and a number outside its bounds (`minimum`, `above`) stops it with "HORDE_WEB_THREADS
must be at least 1, not 0" rather than a process that starts and then fails or hangs its requests."""

from __future__ import annotations

import builtins
from typing import Any

import environ


class SettingsEnv(environ.Env):
    @classmethod
    def parse_value(cls, value: Any, cast: Any) -> Any:
        # A decimal as Python reads it, as an integer is: django-environ drops what is not a digit
        # first, so "1,000" would be 1.0 and "ten5" 5.0, a typo run on another value.
        if cast is builtins.float:
            return builtins.float(value)
        return super().parse_value(value, cast)

    def get_value(self, var: str, cast: Any = None, default: Any = environ.Env.NOTSET, parse_default: bool = False) -> Any:
        try:
            return super().get_value(var, cast=cast, default=default, parse_default=parse_default)
        except ValueError as error:
            name = f"{self.prefix}{var}"
            raise environ.ImproperlyConfigured(f"{name}={self.ENVIRON.get(name)!r} cannot be read: {error}") from None

    def list(self, var: str, cast: Any = None, default: Any = environ.Env.NOTSET) -> builtins.list[Any]:
        """Comma-separated, each entry trimmed and blank ones dropped: `a, b` names "b", not " b" (a
        host Django never matches), and " " names nothing."""
        values = super().list(var, cast=cast, default=default)
        return [value.strip() if isinstance(value, str) else value for value in values if not isinstance(value, str) or value.strip()]

    def int(self, var: str, default: Any = environ.Env.NOTSET, *, minimum: builtins.int | None = None) -> builtins.int:
        value: builtins.int = super().int(var, default=default)
        if minimum is not None and value < minimum:
            raise environ.ImproperlyConfigured(f"{self.prefix}{var} must be at least {minimum}, not {value}")
        return value

    def float(
        self,
        var: str,
        default: Any = environ.Env.NOTSET,
        *,
        minimum: builtins.float | None = None,
        above: builtins.float | None = None,
    ) -> builtins.float:
        value: builtins.float = super().float(var, default=default)
        # `not x >= bound` also refuses nan, which no bound lets through.
        if minimum is not None and not value >= minimum:
            raise environ.ImproperlyConfigured(f"{self.prefix}{var} must be at least {minimum:g}, not {value:g}")
        if above is not None and not value > above:
            raise environ.ImproperlyConfigured(f"{self.prefix}{var} must be above {above:g}, not {value:g}")
        return value
