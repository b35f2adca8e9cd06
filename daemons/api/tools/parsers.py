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
import secrets
import string
import uuid
from dataclasses import dataclass

from dpserve.daemons.api.tools.scan import ObjectScan, partial_tag_overlap, skip_space

_ARGUMENT_KEYS = ("arguments", "parameters")
_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class ToolCall:
    """A call as parsed so far: `arguments` is its final text or a prefix of it."""

    id: str
    name: str | None = None
    arguments: str = ""
    complete: bool = False
    args_key: str | None = None  # the JSON key its arguments came from

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def random_call_id(style: str = "random") -> str:
    """vLLM's ids: chatcmpl-tool-<hex> (Mistral: 9 letters and digits)."""
    if style == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """Base: holds the text, the calls and how much of the text is content.

    Subclasses implement _advance(final), which moves the scan over new text and
    sets `content_end` (text before it is content for sure), appends to `calls`,
    or sets `failed`. After finish(), `result()` is the answer: (content or None,
    calls), or (the whole text, []) when anything failed to parse.
    """

    name = ""
    id_style = "random"

    def __init__(self) -> None:
        self.text = ""
        self.content_end = 0
        self.calls: list[ToolCall] = []
        self.failed = False
        self.finished = False
        self._state = "start"
        self._pos = 0
        self._scan: ObjectScan | None = None
        self._sent_content = 0
        self._sent: list[list] = []  # per call: [name sent, argument chars sent]

    def feed(self, delta: str) -> None:
        self.text += delta
        if not self.failed:
            self._advance(False)

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        self.finished = True
        if not self.failed:
            self._advance(True)
        if not self.failed and self.calls and not all(self._valid(c) for c in self.calls):
            self.failed = True
        return self.result()

    def result(self) -> tuple[str | None, list[ToolCall]]:
        if self.failed or not self.calls:
            return self.text, []
        return self.text[: self.content_end] or None, self.calls

    @staticmethod
    def _valid(call: ToolCall) -> bool:
        if not call.complete or not isinstance(call.name, str) or not call.name:
            return False
        try:
            json.loads(call.arguments)
        except (ValueError, RecursionError):
            return False
        return True

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ streaming

    def take_deltas(self) -> tuple[str, list[dict]]:
        """What is new since the last call: content text and OpenAI tool_calls deltas
        (a call's id, type and name first, then its argument fragments). After a failed
        finish, the text not yet sent goes out as content."""
        if self.failed:
            if not self.finished:
                return "", []
            content, self._sent_content = self.text[self._sent_content :], len(self.text)
            return content, []
        end = len(self.text) if self.finished and not self.calls else self.content_end
        content = self.text[self._sent_content : end] if end > self._sent_content else ""
        self._sent_content = max(self._sent_content, end)
        out = []
        for index, call in enumerate(self.calls):
            if index == len(self._sent):
                self._sent.append([False, 0])
            sent = self._sent[index]
            if call.name is None:
                break  # calls go out in order: none before this one's name
            item: dict = {"index": index}
            if not sent[0]:
                sent[0] = True
                item.update(id=call.id, type="function", function={"name": call.name, "arguments": ""})
            if len(call.arguments) > sent[1]:
                item.setdefault("function", {})["arguments"] = call.arguments[sent[1] :]
                sent[1] = len(call.arguments)
            if len(item) > 1:
                out.append(item)
        return content, out

    # ------------------------------------------------------------ shared steps

    def _new_call(self, name: str | None = None) -> ToolCall:
        call = ToolCall(random_call_id(self.id_style), name)
        self.calls.append(call)
        return call

    def _open_object(self, final: bool) -> bool:
        """At _pos, past white space, a JSON object starts a new call; False to wait."""
        p = skip_space(self.text, self._pos)
        if p == len(self.text):
            if final:
                self.failed = True
            return False
        if self.text[p] != "{":
            self.failed = True
            return False
        self._scan = ObjectScan(p)
        self._new_call()
        return True

    def _scan_object(self, call: ToolCall, final: bool, name_key: str | None = "name") -> bool:
        """Scan the current call's object; True once it has ended (fills the call)."""
        scan, text = self._scan, self.text
        scan.advance(text)
        if scan.error or (final and scan.end is None):
            self.failed = True
            return False
        if name_key is not None and call.name is None:
            value, done = scan.value_so_far(text, name_key)
            if done:
                name = _json_or_none(value)
                if not isinstance(name, str):
                    self.failed = True
                    return False
                call.name = name
        if call.args_key is None:
            call.args_key = next((k for k in scan.keys if k in _ARGUMENT_KEYS), None)
        if call.args_key is not None and call.name is not None:
            value, done = scan.value_so_far(text, call.args_key)
            if value.startswith('"'):  # arguments written as a JSON string: whole, once closed
                decoded = _json_or_none(value) if done else None
                call.arguments = decoded if isinstance(decoded, str) else ""
            else:
                call.arguments = value
        if scan.end is None:
            return False
        if call.name is None:
            self.failed = True
            return False
        if call.args_key is None:
            call.arguments = "{}"  # a call without arguments (vLLM refuses it; small models write it)
        call.complete = True
        self._pos = scan.end
        return True

    def _content_until(self, tag: str, final: bool) -> bool:
        """Content up to `tag` (held back while the text may end in its prefix); True at the tag."""
        idx = self.text.find(tag, self._pos)
        if idx < 0:
            tail = 0 if final else partial_tag_overlap(self.text, tag)
            self.content_end = len(self.text) - tail
            self._pos = max(self._pos, self.content_end - len(tag))
            return False
        self.content_end = idx
        self._pos = idx + len(tag)
        return True


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


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
    """An answer that starts (after an optional <|python_tag|>) with a JSON object is
    one or more calls, separated by ';'; any other answer is content."""

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
                elif rest.startswith("{"):
                    self._pos, self._state = p, "open"
                elif not final and (not rest or self.bot_token.startswith(rest)):
                    return
                else:
                    self._state = "content"
            elif state == "content":
                self.content_end = len(text)
                return
            elif state == "open":
                if not self._open_object(final):
                    return
                self._state = "object"
            elif state == "object":
                if not self._scan_object(self.calls[-1], final):
                    return
                self._state = "separator"
            else:
                p = skip_space(text, self._pos)
                if p == len(text):
                    return
                if text[p] == ";":
                    self._pos, self._state = p + 1, "open"
                elif text[p] == "{":
                    self._pos, self._state = p, "open"
                else:
                    self._pos = len(text)  # trailing text after the calls is dropped


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
            arguments = json.dumps(args, ensure_ascii=False)
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
