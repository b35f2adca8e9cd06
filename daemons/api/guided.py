"""Structured output: response_format and vLLM's guided_json / guided_regex /
guided_choice, turned into one llguidance grammar for the engine to follow.

Owns only the translation and its validation (a bad schema or regex is a 400
naming the parameter here, never an engine error). llguidance is imported on
the first guided request, so plain API servers never load it.
"""

from __future__ import annotations

import json
from typing import Any

from dpserve.daemons.api.openai_types import ApiError
from dpserve.engine.common.protocol import GRAMMAR_LIMITS

# JSON as the model writes it: no free whitespace, which a weak model would
# otherwise fill (valid JSON either way; vLLM offers the same switch).
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance():
    import llguidance

    return llguidance.LLMatcher


def guided_grammar(req) -> str | None:
    """The request's grammar (llguidance's JSON form), or None when it asks for none."""
    asked: list[tuple[str, Any]] = []
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        asked.append(("response_format", fmt))
    for name in ("guided_json", "guided_regex", "guided_choice"):
        if getattr(req, name) is not None:
            asked.append((name, getattr(req, name)))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise ApiError(400, f"Only one structured-output parameter per request; got {names}.", param=asked[1][0])
    name, value = asked[0]
    try:
        grammar = _build(name, value)
        import llguidance

        error = _llguidance().validate_grammar(grammar, limits=llguidance.LLParserLimits(**GRAMMAR_LIMITS))
    except ApiError:
        raise
    except Exception as exc:  # whatever the library makes of a hostile schema is the request's fault
        error = str(exc) or type(exc).__name__
    if error:
        raise ApiError(400, f"{name} cannot be followed: {error.strip()[:400]}", param=name)
    return grammar


def _build(name: str, value: Any) -> str:
    matcher = _llguidance()
    if name == "response_format":
        grammar = matcher.grammar_from_json_schema(_response_format_schema(value), defaults=_JSON_OPTIONS)
    elif name == "guided_json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise ApiError(400, "guided_json must be a JSON schema (an object, or a string holding one).", param=name) from None
        if not isinstance(schema, dict):
            raise ApiError(400, "guided_json must be a JSON schema object.", param=name)
        grammar = matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    elif name == "guided_regex":
        grammar = matcher.grammar_from_regex(value)
    else:
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, "guided_choice must be a non-empty list of non-empty strings.", param=name)
        grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    return grammar


def _response_format_schema(fmt: dict) -> dict:
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON schema object.", param="response_format")
        return schema
    raise ApiError(400, f"response_format type must be 'text', 'json_object' or 'json_schema'; got {str(kind)[:40]!r}.", param="response_format")
