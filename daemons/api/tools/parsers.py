"""Tool-call parsers: the model's answer text -> content and OpenAI tool calls.

One parser object reads one answer, fed piece by piece (streaming) or whole; both
run the same scan, so the deltas a stream sends always join into the calls the
whole answer gives. Formats follow vLLM's parsers of the same --tool-call-parser
names: hermes (<tool_call>{json}</tool_call>), llama3_json ({json}; {json}, after
an optional <|python_tag|>), mistral ([TOOL_CALLS][{json}, ...] or
[TOOL_CALLS]name{args}) and pythonic ([f(a=1), g()]). Text that does not parse
is returned as content, whole: a parser must never raise on model output.
"""

from __future__ import annotations

import ast
import json

from dpserve.daemons.api.tools.base import ToolCall, ToolParser, random_call_id
from dpserve.daemons.api.tools.scan import ObjectScan, skip_space


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number; content is
    the text before the first (text between and after calls is dropped, as vLLM does)."""

    name = "hermes"
    start_tag, end_tag = "<tool_call>", "</tool_call>"

    def _advance(self, final: bool) -> None:
        while not self.failed:
            state = self._state
            if state == "start":
                if not self._content_until(self.start_tag, final):
                    return
                self._state = "open"
            elif state == "open":
                if not self._open_object(final):
                    return
                self._state = "object"
            elif state == "object":
                if not self._scan_object(self.calls[-1], final):
                    return
                self._state = "close"
            elif state == "close":
                p = skip_space(self.text, self._pos)
                rest = self.text[p:]
                if rest.startswith(self.end_tag):
                    self._pos, self._state = p + len(self.end_tag), "between"
                elif not rest or (self.end_tag.startswith(rest) and not final):
                    return  # (an unclosed last call is a call, as in vLLM)
                else:
                    self.failed = True
            else:  # between calls: only another call counts
                idx = self.text.find(self.start_tag, self._pos)
                if idx < 0:
                    self._pos = max(self._pos, len(self.text) - len(self.start_tag))
                    return
                self._pos, self._state = idx + len(self.start_tag), "open"


class JsonArrayToolParser(ToolParser):
    """A JSON array of {"name": ..., "parameters"|"arguments": {...}} objects: what
    tool_choice "required" makes the model write (vLLM's schema)."""

    name = "json_array"

    def _advance(self, final: bool) -> None:
        if self._state == "start":
            p = skip_space(self.text, 0)
            if p == len(self.text):
                self.failed = final
                return
            if self.text[p] != "[":
                self.failed = True
                return
            self._pos, self._state = p + 1, "item"
        self._array(final)

    def _array(self, final: bool) -> None:
        """The items of an array whose '[' is behind _pos: item, comma, ..., ']'."""
        while not self.failed and self._state != "done":
            if self._state == "item":
                p = skip_space(self.text, self._pos)
                if p < len(self.text) and self.text[p] == "]" and not self.calls:
                    self._pos, self._state = p + 1, "done"
                elif self._open_object(final):
                    self._state = "object"
                else:
                    return
            elif self._state == "object":
                if not self._scan_object(self.calls[-1], final):
                    return
                self._state = "comma"
            else:
                p = skip_space(self.text, self._pos)
                if p == len(self.text):
                    self.failed = final
                    return
                self._pos = p + 1
                if self.text[p] == ",":
                    self._state = "item"
                elif self.text[p] == "]":
                    self._state = "done"
                else:
                    self.failed = True


class Llama3JsonToolParser(ToolParser):
    """JSON objects {"name", "parameters" | "arguments"}, separated by ';' or white space,
    after an optional <|python_tag|>. As vLLM: text before the first '{' is content (a
    first object that is no call makes the whole answer content); an object after a
    call that is no call ends the calls, and the text from it on is dropped."""

    name = "llama3_json"
    bot_token = "<|python_tag|>"

    def _advance(self, final: bool) -> None:
        while not self.failed:
            state, text = self._state, self.text
            if state == "start":
                p = skip_space(text, 0)
                rest = text[p:]
                if rest.startswith(self.bot_token):
                    self._pos, self._state = p + len(self.bot_token), "open"
                elif not final and (not rest or self.bot_token.startswith(rest)):
                    return
                else:
                    self._state = "prose"
            elif state == "prose":
                idx = text.find("{", self._pos)
                self.content_end = self._pos = len(text) if idx < 0 else idx
                if idx < 0:
                    return
                self._state = "open"
            elif state == "open":
                if not self._open_object(final):
                    return
                self._state = "object"
            elif state == "object":
                ended = self._scan_object(self.calls[-1], final)
                if self.failed and len(self.calls) > 1:  # trailing text that is no call
                    self.failed = False
                    self.calls.pop()
                    self._state = "tail"
                elif not ended:
                    return
                else:
                    self._state = "separator"
            elif state == "separator":
                p = skip_space(text, self._pos)
                if p == len(text):
                    return
                if text[p] == ";":
                    p = skip_space(text, p + 1)
                    if p == len(text):
                        return
                self._pos, self._state = p, "open" if text[p] == "{" else "tail"
            else:
                self._pos = len(text)  # text after the calls is dropped
                return


class MistralToolParser(JsonArrayToolParser):
    """[TOOL_CALLS] then a JSON array of calls (tokenizers before v11), or
    [TOOL_CALLS]name{arguments} (optionally name[ARGS]{...}), one marker per call."""

    name = "mistral"
    id_style = "mistral"
    bot_token = "[TOOL_CALLS]"

    def _advance(self, final: bool) -> None:
        while not self.failed:
            state = self._state
            if state in ("item", "object", "comma", "done"):  # the pre-v11 array
                self._array(final)
                return
            if state == "start":
                if not self._content_until(self.bot_token, final):
                    return
                self._state = "marker"
            elif state == "marker":
                p = skip_space(self.text, self._pos)
                if p == len(self.text):
                    self.failed = final
                    return
                if self.text[p] == "[" and not self.text.startswith("[ARGS]", p):
                    self._pos, self._state = p + 1, "item"
                    self._array(final)
                    return
                self._pos, self._state = p, "name"
            elif state == "name":
                if not self._named_call(final):
                    return
                self._state = "next"
            elif state == "arguments":
                if not self._scan_raw_arguments(final):
                    return
                self._state = "next"
            else:
                idx = self.text.find(self.bot_token, self._pos)
                if idx < 0:
                    return
                self._pos, self._state = idx + len(self.bot_token), "marker"

    def _named_call(self, final: bool) -> bool:
        """name{...} or name[ARGS]{...}: the name ends at '{' or [ARGS]."""
        text = self.text
        brace = text.find("{", self._pos)
        marker = text.find("[ARGS]", self._pos)
        cut = min(i for i in (brace, marker, len(text)) if i >= 0)
        if cut == len(text):
            self.failed = final
            return False
        name = text[self._pos : cut].strip()
        if not name or any(c in name for c in '"[]{}'):
            self.failed = True
            return False
        start = text.find("{", cut)
        if start < 0:
            self.failed = final
            return False
        self._new_call(name).args_key = ""
        self._scan = ObjectScan(start)
        self._state = "arguments"
        return self._scan_raw_arguments(final)

    def _scan_raw_arguments(self, final: bool) -> bool:
        call, scan = self.calls[-1], self._scan
        scan.advance(self.text)
        if scan.error or (final and scan.end is None):
            self.failed = True
            return False
        end = scan.end if scan.end is not None else scan.pos
        call.arguments = self.text[scan.start : end].rstrip()
        if scan.end is None:
            return False
        call.complete, self._pos = True, scan.end
        return True


class PythonicToolParser(ToolParser):
    """[f(a=1, b="x"), g()] as the whole answer (Llama 3.2 / 4's pythonic calls);
    each call's keyword arguments become its JSON arguments when the call closes."""

    name = "pythonic"
    _NAMES = {"true": True, "false": False, "null": None}

    def _advance(self, final: bool) -> None:
        text = self.text
        if self._state == "start":
            p = skip_space(text, 0)
            if p == len(text):
                return
            if text[p] != "[":
                self._state = "content"
            else:
                self._pos, self._state, self._scan = p + 1, "list", _PyScan(p + 1)
        if self._state == "content":
            self.content_end = len(text)
            return
        if self._state == "list":
            self._calls(text)
        if final and not self.failed and (self._state != "done" or text[self._pos :].strip()):
            self.failed = True

    def _calls(self, text: str) -> None:
        scan = self._scan
        for segment, closing in scan.segments(text):
            if segment.strip():
                call = self._parse_call(segment)
                if call is None:
                    self.failed = True
                    return
                self.calls.append(call)
            if closing:
                self._pos, self._state = scan.pos, "done"
                return

    def _parse_call(self, source: str) -> ToolCall | None:
        try:
            node = ast.parse(source.strip(), mode="eval").body
            if not isinstance(node, ast.Call) or node.args:
                return None
            name = ast.unparse(node.func)
            args = {kw.arg: self._value(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(args) != len(node.keywords):
                return None
            arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)  # 1e999: not JSON
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return None
        return ToolCall(random_call_id(), name, arguments, True)

    def _value(self, node: ast.AST):
        if isinstance(node, ast.Name) and node.id in self._NAMES:
            return self._NAMES[node.id]
        if isinstance(node, ast.Dict):
            return {self._value(k): self._value(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._value(v) for v in node.elts]
        return ast.literal_eval(node)


class _PyScan:
    """Python source in a list, split at its top-level commas and closing ']'."""

    def __init__(self, pos: int) -> None:
        self.pos = self.start = pos
        self.depth = 0
        self.quote = ""
        self.escape = False

    def segments(self, text: str):
        while self.pos < len(text):
            c, i = text[self.pos], self.pos
            self.pos += 1
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "'\"":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")}" or (c == "]" and self.depth):
                self.depth -= 1
            elif c in ",]" and self.depth == 0:
                segment, self.start = text[self.start : i], self.pos
                yield segment, c == "]"
                if c == "]":
                    return


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}
