"""Pydantic's lax mode for the one coercion vLLM's own tests rely on: chat's `logprobs`
sent as a string ("logprobs": "true", vLLM's test_chat_echo).

vLLM validates requests with pydantic, which reads "true", "yes", "1" (and 0 / 1) as
bools; dpserve decodes strictly with msgspec and retries through here only when the
strict decode failed on one of LAX_BOOL_FIELDS, so a well-typed request pays nothing.
Nothing else is loosened: other fields, ints, floats, strings, nested fields and every
range check stay strict, and the OpenAPI document states the forms accepted.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

# Pydantic's lax bools, for these top-level fields only: these strings (any case, as
# pydantic) or the numbers 0 and 1. Each field is coerced at most once.
LAX_BOOL_FIELDS = frozenset({"logprobs"})
_LAX_TYPE = re.compile(r"^Expected `bool( \| null)?`, got `(str|int|float)` - at `\$\.([A-Za-z_]\w*)`$")
_LAX_BOOL = {"1": True, "on": True, "t": True, "true": True, "y": True, "yes": True,
             "0": False, "off": False, "f": False, "false": False, "n": False, "no": False}


def lax_bool_schemas() -> list[dict]:
    """The lax forms as JSON Schema alternatives of a LAX_BOOL_FIELDS bool, for the OpenAPI
    document (a pattern per letter's two cases: JSON Schema has no case-insensitive flag)."""
    words = "|".join("".join(f"[{c}{c.upper()}]" if c.isalpha() else c for c in w) for w in sorted(_LAX_BOOL))
    return [{"type": "string", "pattern": f"^({words})$"}, {"type": "integer", "enum": [0, 1]}]


def lax_bool(value: Any) -> bool | None:
    """`value` as pydantic's lax mode reads it for a bool field, or None when it does not."""
    if isinstance(value, str) and len(value) <= 5:
        return _LAX_BOOL.get(value.lower())
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    return None


def lax_decode(body: bytes, kind: type, exc: msgspec.ValidationError) -> Any:
    """The request decoded with pydantic's lax bools, or None when a failure is not one
    of them (the strict error then stands); raises another field's ValidationError."""
    match = _LAX_TYPE.match(str(exc))
    if match is None:
        return None
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    done: set[str] = set()
    while match is not None and isinstance(data, dict):
        field = match.group(3)
        value = lax_bool(data.get(field)) if field in LAX_BOOL_FIELDS else None
        if field in done or value is None:
            return None
        data[field] = value
        done.add(field)
        try:
            return msgspec.convert(data, kind)
        except msgspec.ValidationError as again:
            match = _LAX_TYPE.match(str(again))
            if match is None:  # a failure of another kind: the caller's 400 names it
                raise
    return None


# msgspec's range words -> pydantic's (vLLM's error messages carry pydantic's type names).
_RANGE = re.compile(r"^Expected `(?:int|float)` (>=|<=|>|<) (\S+) - at")
_PYDANTIC_RANGE = {">=": ("greater than or equal to", "greater_than_equal"), "<=": ("less than or equal to", "less_than_equal"),
                   ">": ("greater than", "greater_than"), "<": ("less than", "less_than")}


def pydantic_words(text: str) -> str:
    """A range error's words as pydantic (and so vLLM) puts them, to follow msgspec's."""
    match = _RANGE.match(text)
    if match is None:
        return ""
    words, name = _PYDANTIC_RANGE[match.group(1)]
    return f" (Input should be {words} {match.group(2)} [type={name}])"
