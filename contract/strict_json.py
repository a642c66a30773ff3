"""JSON as the horde reads a client's body: Python's parser, without what JSON cannot carry.

Python's json accepts NaN, Infinity and -Infinity, and reads a number past a float's range (1e999)
as infinity. None of them can be written back as JSON (the native calls' and the answers' encoders
refuse them), so a body holding one is refused where it is read, not with a 500 later.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:32]}{'...' if len(text) > 32 else ''} is out of range")
    return value


def loads_strict(raw: bytes | str) -> Any:
    """`json.loads(raw)` with NaN, Infinity and out-of-range numbers refused: raises ValueError (or
    RecursionError for a body nested past the interpreter's limit)."""
    return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
