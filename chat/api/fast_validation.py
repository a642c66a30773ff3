"""Validation of the worker routes' bodies without building a DRF serializer, for canonical input.

A worker pops about once a second and submits once per job; building a DRF serializer deep-copies
every declared field (and its validators) first, which cost a pop view more than its SQL did. A
body whose every value already has its field's exact JSON type and fits its bounds is validated
here to the same `validated_data` DRF would give; anything else (a wrong type, a value DRF would
coerce, a bound crossed, a missing required key) returns None, and the view runs the serializer,
which then also writes the error body. tests/chat/test_fast_validation.py checks the agreement
with DRF on generated bodies.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import (
    MaxLengthValidator,
    MaxValueValidator,
    MinLengthValidator,
    MinValueValidator,
    ProhibitNullCharactersValidator,
)
from rest_framework import serializers
from rest_framework.fields import empty
from rest_framework.utils import json as drf_json
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from chat.api.strict_fields import (
    NulReplacingCharField,
    StrictBooleanField,
    StrictCharField,
    StrictFloatField,
    StrictIntegerField,
    WorkerIdField,
)

# Validators DRF attaches itself from a field's arguments, which the checks below apply.
_BUILT_IN_VALIDATORS = (
    MaxLengthValidator,
    MinLengthValidator,
    MaxValueValidator,
    MinValueValidator,
    ProhibitNullCharactersValidator,
    ProhibitSurrogateCharactersValidator,
)
_NULL_OR_SURROGATE = re.compile("[\x00\ud800-\udfff]")


class _Defer(Exception):
    """The value is not canonical: leave it to the serializer."""


Check = Callable[[Any], Any]


def _string(field: serializers.CharField) -> Check:
    def check(value):
        if type(value) is not str:
            raise _Defer
        if field.trim_whitespace:
            value = value.strip()
        if (not value and not field.allow_blank) or _NULL_OR_SURROGATE.search(value):
            raise _Defer
        if (field.max_length is not None and len(value) > field.max_length) or (
            field.min_length is not None and len(value) < field.min_length
        ):
            raise _Defer
        return value

    return check


def _integer(field: serializers.IntegerField) -> Check:
    def check(value):
        if type(value) is not int:
            raise _Defer
        if (field.min_value is not None and value < field.min_value) or (
            field.max_value is not None and value > field.max_value
        ):
            raise _Defer
        return value

    return check


def _number(field: serializers.FloatField) -> Check:
    """A JSON number (never a boolean), as float, finite and within the bounds."""

    def check(value):
        if type(value) is not float and type(value) is not int:
            raise _Defer
        try:
            value = float(value)
        except OverflowError:
            raise _Defer from None
        if not math.isfinite(value) or (field.min_value is not None and value < field.min_value) or (
            field.max_value is not None and value > field.max_value
        ):
            raise _Defer
        return value

    return check


def _boolean(value):
    if type(value) is not bool:
        raise _Defer
    return value


def _choice(field: serializers.ChoiceField) -> Check:
    choices = frozenset(key for key in field.choices if isinstance(key, str))

    def check(value):
        if type(value) is not str or value not in choices:
            raise _Defer
        return value

    return check


def _uuid(value):
    if type(value) is not str:
        raise _Defer
    try:
        return uuid.UUID(hex=value)
    except ValueError:
        raise _Defer from None


def _list(field: serializers.ListField, child: Check) -> Check:
    def check(value):
        if type(value) is not list or (not value and not field.allow_empty):
            raise _Defer
        if (field.max_length is not None and len(value) > field.max_length) or (
            field.min_length is not None and len(value) < field.min_length
        ):
            raise _Defer
        if None in value:  # the serializer decides on a null item
            raise _Defer
        return [child(item) for item in value]

    return check


def _empty_list_only(value):
    """A nested many=True serializer: only the empty list is taken here."""
    if value != [] or type(value) is not list:
        raise _Defer
    return []


def _json(value):
    """As DRF's JSONField: a value its JSON encoder writes (strict: no NaN or infinity)."""
    if type(value) in (dict, list) or type(value) is float:
        try:
            drf_json.dumps(value)
        except (TypeError, ValueError):
            raise _Defer from None
    return value


def _absent_only(value):
    """An optional field this module does not check: its body goes to the serializer when it has it."""
    raise _Defer


def _nested(serializer_class: type[serializers.Serializer]) -> Check | None:
    """A nested plain serializer (one object, not many): its own plan, on a JSON object."""
    if _plan(serializer_class) is None:
        return None

    def check(value):
        if type(value) is not dict:
            raise _Defer
        return _validated(serializer_class, value)

    return check


# Exact classes: a subclass may convert differently. The strict fields refuse what DRF would
# coerce, which the checks here never take either.
_STRINGS = (serializers.CharField, StrictCharField, NulReplacingCharField)
_INTEGERS = (serializers.IntegerField, StrictIntegerField)
_NUMBERS = (serializers.FloatField, StrictFloatField)
_BOOLEANS = (serializers.BooleanField, StrictBooleanField)
_UUIDS = (serializers.UUIDField, WorkerIdField)


def _check_for(field: serializers.Field) -> Check | None:
    if any(not isinstance(v, _BUILT_IN_VALIDATORS) for v in field.validators):
        return None
    if isinstance(field, serializers.ListSerializer):
        return _empty_list_only if field.allow_empty else None
    if isinstance(field, serializers.Serializer):
        return _nested(type(field))
    if isinstance(field, serializers.ListField):
        child = _check_for(field.child)
        return _list(field, child) if child is not None else None
    # Decided by the exact class; each isinstance, true of every class in its tuple, only tells
    # the type checker which field it is.
    kind = type(field)
    if kind in _STRINGS and isinstance(field, serializers.CharField):
        return _string(field)
    if kind in _INTEGERS and isinstance(field, serializers.IntegerField):
        return _integer(field)
    if kind in _NUMBERS and isinstance(field, serializers.FloatField):
        return _number(field)
    if kind in _BOOLEANS:
        return _boolean
    if type(field) is serializers.ChoiceField and not field.allow_blank:
        return _choice(field)
    if kind in _UUIDS and isinstance(field, serializers.UUIDField) and field.uuid_format == "hex_verbose":
        return _uuid
    if type(field) is serializers.JSONField and not field.binary and field.encoder is None:
        return _json
    return None


@cache
def _plan(serializer_class: type[serializers.Serializer]):
    """(name, check, required, default, allow_null) per field, or None when the class is not plain
    enough. A class's own validate() runs after the fields, on an unbound instance (it may read
    only its attrs); serializer-level validators and validate_<field> methods are not run here."""
    if getattr(getattr(serializer_class, "Meta", None), "validators", None):
        return None
    plan = []
    for name, field in serializer_class().fields.items():
        check = _check_for(field)
        if check is None and not field.required and field.default is empty:
            check = _absent_only
        if check is None or field.read_only or field.source not in (None, name) or hasattr(
            serializer_class, f"validate_{name}"
        ):
            return None
        plan.append((name, check, field.required, field.default, field.allow_null))
    return tuple(plan)


def _validated(serializer_class: type[serializers.Serializer], data: dict) -> dict[str, Any]:
    validated: dict[str, Any] = {}
    for name, check, required, default, allow_null in _plan(serializer_class):
        if name in data:
            value = data[name]
            if value is None:
                if not allow_null:
                    raise _Defer
                validated[name] = None
            else:
                validated[name] = check(value)
        elif required:
            raise _Defer
        elif default is not empty:
            validated[name] = default() if callable(default) else default
    if serializer_class.validate is not serializers.Serializer.validate:
        try:
            validated = serializer_class().validate(validated)
        except (serializers.ValidationError, DjangoValidationError):
            raise _Defer from None  # the serializer writes the error body
    return validated


def canonical_validated_data(serializer_class: type[serializers.Serializer], data: Any) -> dict | None:
    """`serializer_class(data=data).validated_data` when `data` is canonical for it, else None."""
    if _plan(serializer_class) is None or type(data) is not dict:
        return None
    try:
        return _validated(serializer_class, data)
    except _Defer:
        return None


def validated_body(serializer_class: type[serializers.Serializer], data: Any) -> Mapping[str, Any]:
    """The body's validated data: from the canonical path when it applies, else from the serializer
    (whose ValidationError becomes the usual 400 body)."""
    validated = canonical_validated_data(serializer_class, data)
    if validated is not None:
        return validated
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data
