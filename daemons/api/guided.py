"""Structured output: response_format, vLLM's structured_outputs ({json, regex, choice,
grammar}) and its older guided_* names (aliases), and allowed_token_ids, turned into one
llguidance grammar for the engine to follow. A JSON schema's objects without
`additionalProperties` allow no other keys, as vLLM's default backend.

Owns the translation, its cost model and its validation. The cost model
(check_cost) is pure Python over the request's value and runs first, so an
oversized grammar is a 400 naming the parameter and the budget within
milliseconds; whatever passes it is within what llguidance follows under
GRAMMAR_LIMITS. Compiling and validating (llguidance, up to hundreds of ms)
must never run on the event loop: it runs on a small thread pool, once per
grammar text (an LRU of results). llguidance is imported on the first guided
request, so plain API servers never load it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from dpserve.daemons.api.openai_types import ApiError
from dpserve.engine.common.grammar_limits import (
    GRAMMAR_LIMITS,
    MAX_GRAMMAR_ALTERNATIVES,
    MAX_GRAMMAR_PATTERN_SIZE,
    MAX_GRAMMAR_PROPERTIES_PER_OBJECT,
)

# JSON as the model writes it: no free whitespace, which a weak model would
# otherwise fill (valid JSON either way; vLLM offers the same switch).
_JSON_OPTIONS = {"whitespace_flexible": False}
_COMPILE_THREADS = 2
_CACHE_ENTRIES = 256
_CACHE_BYTES = 32 << 20  # grammar texts held (their compiled form is of the same order)
_SIZE_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_LIST_KEYWORDS = ("enum", "anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """What one structured-output request may cost (the --max-guided-* flags).

    Each limit is also held under the grammar library's own (see protocol.py):
    a value that passes here compiles and is followed.
    """

    max_bytes: int = 65536  # the parameter's value: choices' total, regex, schema JSON
    max_bytes_per_request: int = 1 << 20  # that x n x prompts
    max_choices: int = 1000  # guided_choice entries; also a schema's enum / anyOf / oneOf lists
    max_regex_size: int = 4096  # a pattern with repetitions expanded; longest choice; schema length bounds
    max_schema_properties: int = 1000  # properties in the whole schema
    max_schema_depth: int = 64  # JSON nesting of the schema

    @classmethod
    def from_config(cls, cfg) -> GrammarBudget:
        return cls(cfg.max_guided_grammar_bytes, cfg.max_guided_bytes_per_request, cfg.max_guided_choices,
                   cfg.max_guided_regex_size, cfg.max_guided_schema_properties, cfg.max_guided_schema_depth)


def _over(name: str, what: str, limit: int, flag: str) -> ApiError:
    return ApiError(400, f"{name} is too large: {what} exceeds the limit of {limit:,} ({flag}).", param=name, code="grammar_too_large")


# structured_outputs' keys -> the guided_* name that the rest of this module speaks
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


def asked_for(req) -> tuple[str, Any] | None:
    """(parameter, value) of the request's one structured-output parameter, or None.
    structured_outputs' keys are reported under their guided_* names."""
    asked: list[tuple[str, Any]] = []
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        asked.append(("response_format", fmt))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            asked.append((name, getattr(req, name)))
    so = req.structured_outputs
    if so is not None:
        given = [(alias, getattr(so, key)) for key, alias in _STRUCTURED.items() if getattr(so, key) is not None]
        if len(given) != 1:
            raise ApiError(400, "structured_outputs takes exactly one of json, regex, choice and grammar.", param="structured_outputs")
        asked += given
    if getattr(req, "allowed_token_ids", None) is not None:
        asked.append(("allowed_token_ids", req.allowed_token_ids))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise ApiError(400, f"Only one structured-output parameter per request; got {names}.", param=asked[1][0])
    return asked[0] if asked else None


async def guided_grammar(req, cfg=None, copies: int = 1, vocab_size: int | None = None) -> str | None:
    """The request's grammar (llguidance's JSON form), or None when it asks for none.

    `cfg` holds the budgets (ApiServerConfig's max_guided_* fields; None: the
    defaults); `copies` is how many engine requests carry the grammar (n x
    prompts). The cost check runs here; the build and validation on the compile
    pool, once per value.
    """
    asked = asked_for(req)
    if asked is None:
        return None
    name, value = asked
    if name == "allowed_token_ids":
        return allowed_tokens_grammar(value, vocab_size)
    budget = GrammarBudget() if cfg is None else GrammarBudget.from_config(cfg)
    value, key = check_cost(name, value, budget, copies)
    grammar, error = await asyncio.wrap_future(_COMPILED.get(key, lambda: _build_checked(name, value)))
    if error:  # a fresh exception each time: a cached one would grow its traceback per raise
        raise ApiError(400, error, param=name)
    return grammar


def allowed_tokens_grammar(ids: list[int], vocab_size: int | None) -> str:
    """vLLM's allowed_token_ids as a grammar of those tokens only. As in vLLM every other
    token is masked, EOS included: the grammar ends in a lexeme that matches nothing, so it
    never accepts and never allows EOS for itself (an EOS id in the list is just a token)."""
    import llguidance

    if not ids:
        raise ApiError(400, "allowed_token_ids is not None and empty!", param="allowed_token_ids")
    if vocab_size is not None:
        from dpserve.daemons.api.request_checks import out_of_vocab

        out_of_vocab("allowed_token_ids", ids, vocab_size)
    spans, ordered = [], sorted(set(ids))
    start = prev = ordered[0]
    for t in ordered[1:] + [None]:
        if t is not None and t == prev + 1:
            prev = t
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if t is not None:
            start = prev = t
    return llguidance.LLMatcher.grammar_from_lark(f"start: <[{','.join(spans)}]>* NEVER\nNEVER: /[^\\x00-\\U0010FFFF]/")


def check_cost(name: str, value: Any, budget: GrammarBudget, copies: int) -> tuple[Any, str]:
    """The value to build (guided_json's string parsed) and its cache key; a 400 past the budget."""
    if name == "guided_choice":
        limit = min(budget.max_choices, MAX_GRAMMAR_ALTERNATIVES)
        if len(value) > limit:  # first: a 300,000-entry list is refused before it is scanned
            raise _over(name, f"{len(value):,} choices", limit, "--max-guided-choices")
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, "guided_choice must be a non-empty list of non-empty strings.", param=name)
        longest = max(len(c.encode()) for c in value)
        if longest > min(budget.max_regex_size, MAX_GRAMMAR_PATTERN_SIZE):
            raise _over(name, f"a choice of {longest:,} bytes", min(budget.max_regex_size, MAX_GRAMMAR_PATTERN_SIZE), "--max-guided-regex-size")
        size = sum(len(c.encode()) for c in value)
    elif name in ("guided_regex", "guided_grammar"):
        size = len(value.encode())
    elif name == "guided_json" and isinstance(value, str):
        size = len(value.encode())
        if size <= budget.max_bytes:
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):  # RecursionError: nested past what json.loads follows
                raise ApiError(400, "guided_json must be a JSON schema (an object, or a string holding one).", param=name) from None
    else:
        try:
            size = len(msgspec.json.encode(value))
        except RecursionError:  # nested past any budget (the walk below would say so too)
            raise _over(name, "its nesting", budget.max_schema_depth, "--max-guided-schema-depth") from None
    if size > budget.max_bytes:
        raise _over(name, f"{size:,} bytes", budget.max_bytes, "--max-guided-grammar-bytes")
    if size * copies > budget.max_bytes_per_request:
        raise _over(name, f"{size:,} bytes x {copies} choices", budget.max_bytes_per_request, "--max-guided-bytes-per-request")
    if name == "guided_regex":
        check_regex(name, value, min(budget.max_regex_size, MAX_GRAMMAR_PATTERN_SIZE))
    elif name == "guided_json":
        if not isinstance(value, dict):
            raise ApiError(400, "guided_json must be a JSON schema object.", param=name)
        check_schema(name, value, budget)
    elif name == "response_format":
        schema = _response_format_schema(value)
        check_schema(name, schema, budget)
    return value, name + "\0" + msgspec.json.encode(value).decode()


def regex_size(pattern: str, limit: int) -> int:
    """The pattern's size with every counted repetition expanded (a{100} is 100,
    (ab){3}{2} is 12); stops counting once past `limit`. Unbounded * and + count once."""
    frames = [[0, 0]]  # per open group: [size so far, size of the last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            if i <= n and pattern[i - 1] in "pPx" and i < n and pattern[i] == "{":
                i = pattern.find("}", i) + 1 or n  # \p{Greek}, \x{263a}
            frames[-1][0] += 1
            frames[-1][1] = 1
            continue
        if c == "[":
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            frames[-1][0] += 1
            frames[-1][1] = 1
            continue
        if c == "(":
            frames.append([0, 0])
        elif c == ")" and len(frames) > 1:
            size = frames.pop()[0]
            frames[-1][0] += size
            frames[-1][1] = size
        elif c == "{":
            close = pattern.find("}", i)
            bounds = pattern[i + 1 : close].split(",") if close > 0 else []
            if 1 <= len(bounds) <= 2 and all(b.strip().isdigit() or (k and not b.strip()) for k, b in enumerate(bounds)):
                top = bounds[-1].strip() or bounds[0].strip()
                times = int(top) if len(top) <= 12 else limit + 1
                frame = frames[-1]
                frame[0] += frame[1] * (times - 1)
                frame[1] *= times
                i = close + 1
                if frame[0] > limit:
                    return frame[0]
                continue
            frames[-1][0] += 1
            frames[-1][1] = 1
        elif c not in "|*+?^$":
            frames[-1][0] += 1
            frames[-1][1] = 1
        i += 1
    return sum(frame[0] for frame in frames)


def check_regex(name: str, pattern: str, limit: int) -> None:
    size = regex_size(pattern, limit)
    if size > limit:
        raise _over(name, f"the pattern's size with its repetitions expanded ({size:,}+)", limit, "--max-guided-regex-size")


def check_schema(name: str, schema: dict, budget: GrammarBudget) -> None:
    """Depth, properties (in all and per object), list sizes, length bounds and
    patterns of a JSON schema, walked without recursion; then its $ref graph."""
    regex_limit = min(budget.max_regex_size, MAX_GRAMMAR_PATTERN_SIZE)
    choices_limit = min(budget.max_choices, MAX_GRAMMAR_ALTERNATIVES)
    num_properties = 0
    refs: list[tuple[tuple[str, ...], str]] = []  # (where the $ref sits, its target)
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > budget.max_schema_depth:
            raise _over(name, f"a schema nested {len(path)} levels deep", budget.max_schema_depth, "--max-guided-schema-depth")
        if isinstance(node, list):
            stack.extend((item, (*path, str(k))) for k, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            num_properties += len(props)
            required = node.get("required")
            optional = len(props) - (len(set(required) & props.keys()) if isinstance(required, list) and all(isinstance(r, str) for r in required) else 0)
            if optional > MAX_GRAMMAR_PROPERTIES_PER_OBJECT:  # each optional one is about four items of a parser row
                raise _over(name, f"an object of {optional:,} optional properties", MAX_GRAMMAR_PROPERTIES_PER_OBJECT, "the grammar library's row limit")
            if num_properties > budget.max_schema_properties:
                raise _over(name, f"{num_properties:,}+ properties", budget.max_schema_properties, "--max-guided-schema-properties")
        for key in _LIST_KEYWORDS:
            if isinstance(node.get(key), list) and len(node[key]) > choices_limit:
                raise _over(name, f"a {key} of {len(node[key]):,} entries", choices_limit, "--max-guided-choices")
        for key in _SIZE_KEYWORDS:
            bound = node.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > regex_limit:
                raise _over(name, f"{key} {bound:,}", regex_limit, "--max-guided-regex-size")
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += node["patternProperties"]
        for pattern in patterns:
            check_regex(name, pattern, regex_limit)
        if isinstance(node.get("$ref"), str):
            refs.append((path, node["$ref"]))
        stack.extend((value, (*path, key)) for key, value in node.items())
    if refs:
        _check_refs(name, refs)


def _pointer(ref: str) -> tuple[str, ...] | None:
    """A local JSON pointer ('#', '#/$defs/a') as a path; None for anything else."""
    if ref == "#":
        return ()
    if not ref.startswith("#/"):
        return None
    from urllib.parse import unquote

    return tuple(part.replace("~1", "/").replace("~0", "~") for part in unquote(ref[2:]).split("/"))


def _check_refs(name: str, refs: list[tuple[tuple[str, ...], str]]) -> None:
    """A 400 for a $ref that is not a local JSON pointer, or for any cycle of
    $refs (a schema that refers to itself through its own subtree), which the
    engine cannot follow."""
    targets: dict[tuple[str, ...], str] = {}
    for _, ref in refs:
        target = _pointer(ref)
        if target is None:
            raise ApiError(400, f"{name}: only local $ref (JSON pointers like '#/$defs/x') are supported; got {ref[:80]!r}.", param=name)
        targets[target] = ref
    # An edge P -> Q: a $ref to Q sits inside the subtree that P points at.
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {t: set() for t in targets}
    for where, ref in refs:
        for k in range(len(where) + 1):
            if where[:k] in edges:
                edges[where[:k]].add(_pointer(ref))
    state: dict[tuple[str, ...], int] = {}  # 1: on the current path, 2: done
    for start in edges:
        if state.get(start):
            continue
        walk = [(start, iter(edges[start]))]
        state[start] = 1
        while walk:
            node, it = walk[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                walk.pop()
            elif state.get(nxt) == 1:
                raise ApiError(400, f"{name}: $ref {targets[nxt][:80]!r} refers back to itself (recursive schemas are not supported).", param=name)
            elif not state.get(nxt):
                state[nxt] = 1
                walk.append((nxt, iter(edges[nxt])))


class _Results:
    """Grammar builds by value, as futures (a repeated or concurrent grammar is
    built once); least recently used first out, bounded in entries and bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Future] = OrderedDict()
        self._bytes = 0
        self._pool: ThreadPoolExecutor | None = None

    def get(self, key: str, build) -> Future:
        with self._lock:
            fut = self._items.get(key)
            if fut is not None:
                self._items.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
            fut = self._pool.submit(build)
            self._items[key] = fut
            self._bytes += len(key)
            while len(self._items) > _CACHE_ENTRIES or self._bytes > _CACHE_BYTES:
                old, _ = self._items.popitem(last=False)
                self._bytes -= len(old)
            return fut


_COMPILED = _Results()


def _build_checked(name: str, value: Any) -> tuple[str, str]:
    """On the compile pool: (the grammar, "") or ("", why it cannot be followed)."""
    import llguidance

    try:
        grammar = _build(name, value)
        error = llguidance.LLMatcher.validate_grammar(grammar, limits=llguidance.LLParserLimits(**GRAMMAR_LIMITS))
    except ApiError as exc:
        return "", str(exc)
    except Exception as exc:  # whatever the library makes of a hostile schema is the request's fault
        error = str(exc) or type(exc).__name__
    if error:
        return "", f"{name} cannot be followed: {error.strip()[:400]}"
    return grammar, ""


def _build(name: str, value: Any) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    if name == "response_format":
        schema = _response_format_schema(value)
        return matcher.grammar_from_json_schema(schema if value.get("type") == "json_object" else strict_schema(schema), defaults=_JSON_OPTIONS)
    if name == "guided_json":
        schema = json.loads(value) if isinstance(value, str) else value
        return matcher.grammar_from_json_schema(strict_schema(schema), defaults=_JSON_OPTIONS)
    if name == "guided_regex":
        return matcher.grammar_from_regex(value)
    if name == "guided_grammar":  # EBNF (GBNF, `root ::= ...`) or Lark, as vLLM's guidance backend
        return llguidance.grammar_from("grammar", value)
    return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` whose objects with `properties` and no `additionalProperties`
    forbid other keys (vLLM's default backend does; JSON Schema itself allows them)."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in ("enum", "const", "default", "examples") else strict_schema(value) for key, value in schema.items()}
    if isinstance(out.get("properties"), dict):
        props = out["properties"]
        out["properties"] = {name: strict_schema(sub) for name, sub in schema["properties"].items()} if props else props
        out.setdefault("additionalProperties", False)
    return out


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
