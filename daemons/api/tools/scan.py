"""Resumable scanning of model text: one JSON object's top-level keys, and tag prefixes.

A scan reads a growing text from where it stopped, one pass over each character
in all (a streamed answer costs what one whole parse does). It must never parse
what it has not seen: every span it reports is final once reported, and a
value's text so far is always a prefix of its final text.
"""

from __future__ import annotations

import json

_SPACE = " \t\r\n"


def grown(holder, delta: str) -> str:
    """holder.text + delta, grown in place: CPython appends to a string without
    copying it only while nothing else refers to it (an attribute does), so the
    holder lets go of it first. A streamed answer costs linear time, not quadratic."""
    text = holder.text
    holder.text = ""
    text += delta
    return text


def partial_tag_overlap(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`
    (text that might still become the tag, held back from content)."""
    i = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while i >= 0:  # the earliest start that fits is the longest overlap
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    return pos


class ObjectScan:
    """One JSON object in a growing text, from its '{' at `start`.

    `keys` maps each top-level key to [value start, value end or None]; `end` is
    the index after the closing '}' once seen; `error` is set for text that
    cannot be a JSON object (the scan then stops). It checks structure (nesting,
    strings, separators), not every token: `loads()` is the final word.
    """

    __slots__ = ("start", "pos", "depth", "in_string", "escape", "end", "error", "keys",
                 "_key_start", "_key", "_expect")

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.end: int | None = None
        self.error = False
        self.keys: dict[str, list] = {}
        self._key_start = -1
        self._key: str | None = None
        self._expect = "open"  # at depth 1: key, colon, value, comma (or the end)

    @property
    def done(self) -> bool:
        return self.end is not None or self.error

    def advance(self, text: str) -> None:
        """Scan text[self.pos:], stopping at the object's end or at an error."""
        i, n = self.pos, len(text)
        while i < n and not self.done:
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 1 and self._expect == "colon":
                        self._close_key(text, i)
            elif c in _SPACE:
                pass
            elif self.depth == 1:
                self._top_level(text, i, c)
            elif self.depth == 0:
                if c != "{":
                    self.error = True
                else:
                    self.depth, self._expect = 1, "key"
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._expect = "comma"
            elif c == '"':
                self.in_string = True
            i += 1
        self.pos = i

    def _top_level(self, text: str, i: int, c: str) -> None:
        expect = self._expect
        if expect == "key":
            if c == '"':
                self.in_string, self._key_start, self._expect = True, i, "colon"
            elif c == "}" and not self.keys:
                self._finish(i)
            else:
                self.error = True
        elif expect == "colon":
            if c != ":":
                self.error = True
            else:
                self._expect = "value"
        elif expect == "value":
            self.keys[self._key] = [i, None]
            self._expect = "comma"
            if c in "{[":
                self.depth += 1
            elif c == '"':
                self.in_string = True
            elif c in ",}]:":
                self.error = True
        elif c == ",":
            self._close_value(text, i)
            self._expect = "key"
        elif c == "}":
            self._close_value(text, i)
            self._finish(i)
        elif c in "{[]\":":
            self.error = True

    def _close_key(self, text: str, i: int) -> None:
        try:
            self._key = json.loads(text[self._key_start : i + 1])
        except ValueError:
            self.error = True

    def _close_value(self, text: str, i: int) -> None:
        span = self.keys.get(self._key)
        if span is not None and span[1] is None:
            span[1] = len(text[: i].rstrip(_SPACE))

    def _finish(self, i: int) -> None:
        self.depth = 0
        self.end = i + 1

    def value_so_far(self, text: str, key: str) -> tuple[str | None, bool]:
        """(the key's value text so far, whether it is complete); (None, False) when
        the key has not been seen. Text so far is right-stripped: white space that
        may end the value is held back, so it stays a prefix of the final value."""
        span = self.keys.get(key)
        if span is None:
            return None, False
        if span[1] is not None:
            return text[span[0] : span[1]], True
        return text[span[0] : self.pos].rstrip(_SPACE), False

    def loads(self, text: str):
        """The whole object (None unless it is complete and valid JSON)."""
        if self.end is None or self.error:
            return None
        try:
            return json.loads(text[self.start : self.end])
        except (ValueError, RecursionError):
            return None
