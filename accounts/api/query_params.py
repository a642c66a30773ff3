"""Whole-number query parameters (`page`, `min_count`, `max_count`): read as the schema documents
them, a signed integer of at most nine digits. The bound keeps a huge number out of the database's
integer columns; the sign is not a digit (ADR 0114)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request

from contract.errors import HordeError

QUERY_WHOLE_NUMBER_DIGITS = 9
QUERY_WHOLE_NUMBER_BOUND = 10**QUERY_WHOLE_NUMBER_DIGITS - 1


def whole_number_parameter(name: str, *, description: str) -> OpenApiParameter:
    """The parameter as the schema documents it: an integer within the bounds the route reads."""
    schema = {"type": "integer", "minimum": -QUERY_WHOLE_NUMBER_BOUND, "maximum": QUERY_WHOLE_NUMBER_BOUND}
    return OpenApiParameter(name, schema, description=description)


def whole_number_query(request: Request, name: str) -> int | None:
    """The parameter's value, None when absent; 400 BadRequest unless a whole number within the bounds."""
    value = request.query_params.get(name)
    if value is None:
        return None
    digits = value.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or len(digits) > QUERY_WHOLE_NUMBER_DIGITS:
        raise HordeError(
            "BadRequest",
            f"{name} must be a whole number from {-QUERY_WHOLE_NUMBER_BOUND} to {QUERY_WHOLE_NUMBER_BOUND}.",
        )
    return int(value)
