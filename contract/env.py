"""The one environment reader of every process's settings (the horde's, the front's): django-environ's,
whose cast errors name the variable and its value, so `HORDE_DEFAULT_CONCURRENCY=ten` stops a process
with "HORDE_DEFAULT_CONCURRENCY='ten' cannot be read: invalid literal for int() ..." rather than a bare
ValueError."""

from __future__ import annotations

from typing import Any

import environ


class SettingsEnv(environ.Env):
    @classmethod
    def parse_value(cls, value: Any, cast: Any) -> Any:
        # A decimal as Python reads it, as an integer is: django-environ drops what is not a digit
        # first, so "1,000" would be 1.0 and "ten5" 5.0, a typo run on another value.
        if cast is float:
            return float(value)
        return super().parse_value(value, cast)

    def get_value(self, var: str, cast: Any = None, default: Any = environ.Env.NOTSET, parse_default: bool = False) -> Any:
        try:
            return super().get_value(var, cast=cast, default=default, parse_default=parse_default)
        except ValueError as error:
            name = f"{self.prefix}{var}"
            raise environ.ImproperlyConfigured(f"{name}={self.ENVIRON.get(name)!r} cannot be read: {error}") from None
