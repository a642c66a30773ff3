"""DRF fields that take a JSON value only in its own JSON type, as upstream's schema validation does.

DRF coerces: "5" and 5.0 pass an IntegerField, 5 a CharField, "yes" and 1 a BooleanField, an
integer a UUIDField. Upstream validates the text request against its JSON schema first (flask-restx,
Draft 4), which refuses every one of those; these fields refuse them with its message
("5 is not of type 'string'"). A JavaScript client never sends an integral number with a fraction
(JSON.stringify(5.0) is "5"), so the integer rule costs browser clients nothing.
"""

from __future__ import annotations

from typing import Any

from django.core.validators import ProhibitNullCharactersValidator
from rest_framework import serializers

from contract.text import replace_nul

_SHOWN_CHARACTERS = 80


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARACTERS else f"{text[:_SHOWN_CHARACTERS]}..."


def not_of_type(value: Any, json_type: str) -> serializers.ValidationError:
    return serializers.ValidationError(f"{_shown(value)} is not of type '{json_type}'", code="invalid")


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise not_of_type(data, "string")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    def to_internal_value(self, data):
        # bool is an int in Python, not in JSON.
        if type(data) is not int:
            raise not_of_type(data, "integer")
        return data


class StrictFloatField(serializers.FloatField):
    """A JSON number: an integer or a float, never a string or a boolean."""

    def to_internal_value(self, data):
        if type(data) not in (int, float):
            raise not_of_type(data, "number")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data):
        if type(data) is not bool:
            raise not_of_type(data, "boolean")
        return data


class WorkerIdField(serializers.UUIDField):
    """A worker's id as a string: a worker's name, or any other string, is refused, never ignored."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise not_of_type(data, "string")
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError:
            raise serializers.ValidationError(
                f"{_shown(data)} is not a worker id: workers are named by their id (a UUID).", code="invalid"
            ) from None


class NulReplacingCharField(serializers.CharField):
    """A worker's text: a NUL is replaced (contract.text.NUL_REPLACEMENT, as the chat submit stores
    it) rather than refused, so a job the worker did is not dropped for it (docs/adr/0116). A lone
    surrogate is still refused."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.validators = [v for v in self.validators if not isinstance(v, ProhibitNullCharactersValidator)]

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        return replace_nul(value)
