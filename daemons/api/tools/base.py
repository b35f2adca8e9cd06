"""What every tool-call parser shares: the call as parsed so far, the scan of one
call's JSON object, content up to a tag, and the stream's deltas.

A parser holds one answer's text and moves a resumable scan over what is new, so
feeding it piece by piece costs what one whole parse does, and both end in the
same calls. Must never raise on model text: what does not parse is content.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass

from dpserve.daemons.api.tools.scan import ObjectScan, grown, partial_tag_overlap, skip_space

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
        self.text = grown(self, delta)
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
                name = json_or_none(value)
                if not isinstance(name, str):
                    self.failed = True
                    return False
                call.name = name
        if call.args_key is None:
            call.args_key = next((k for k in scan.keys if k in _ARGUMENT_KEYS), None)
        if call.args_key is not None and call.name is not None:
            value, done = scan.value_so_far(text, call.args_key)
            if value.startswith('"'):  # arguments written as a JSON string: whole, once closed
                decoded = json_or_none(value) if done else None
                call.arguments = _serialized(decoded) if isinstance(decoded, str) else ""
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


def _serialized(arguments: str) -> str:
    """Arguments the model wrote as a string: passed on when the string holds JSON
    (Granite 4 serializes them), else encoded as a JSON string (vLLM's rule)."""
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        return json.dumps(arguments, ensure_ascii=False)
    return arguments


def json_or_none(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
