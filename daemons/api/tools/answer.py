"""One chat choice's answer, read through the reasoning parser and then the tool
parser: stream deltas as the text comes, and the whole message at the end.

The reasoning parser sees the model's text first; only the answer after the
reasoning reaches the tool parser. Both hold back text that may still become a
tag, so a delta is never taken back. A stream's deltas join into exactly the
message a whole answer gives (tests/unit/test_tool_parsers.py splits recorded
answers at every point to hold this), except for an answer whose tool call turns
out malformed only at its end: its already streamed call stays sent, and the
rest follows as content. Never raises on model text.
"""

from __future__ import annotations

from dpserve.daemons.api.reasoning import ReasoningParser, ReasoningTokens
from dpserve.daemons.api.tools.base import ToolParser
from dpserve.engine.common.protocol import FINISH_STOP

FINISH_TOOL_CALLS = "tool_calls"


class ChatAnswer:
    """`named`: the call was forced by name; its finish stays "stop" (as OpenAI's).
    `show_reasoning`: false (vLLM's include_reasoning) leaves the reasoning out.
    `single_call`: parallel_tool_calls false keeps the first call only (vLLM's filter)."""

    __slots__ = ("reasoning", "tools", "named", "show_reasoning", "single_call", "_called", "_counter")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, named: bool = False,
                 show_reasoning: bool = True, single_call: bool = False) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.named = named
        self.show_reasoning = show_reasoning
        self.single_call = single_call
        self._called = False
        self._counter: ReasoningTokens | None = None

    def reasoning_tokens(self, ids: list[int], tokenizer) -> int:
        """vLLM's reasoning_tokens of the answer whose output ids so far are `ids` (0 without
        a reasoning parser); hidden reasoning (include_reasoning false) counts too."""
        if self.reasoning is None:
            return 0
        if self._counter is None:
            self._counter = ReasoningTokens(self.reasoning, tokenizer)
        return self._counter.update(ids)

    def feed(self, text: str, final: bool) -> dict:
        """The delta this text adds: reasoning_content / reasoning, content, tool_calls
        (each only when there is some); `final` on the last text of the answer."""
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed(text) if text else ("", "")
            if final:
                more_thought, more_answer = self.reasoning.finish()
                thought, answer = thought + more_thought, answer + more_answer
        else:
            thought, answer = "", text
        calls: list[dict] = []
        if self.tools is not None:
            if answer:
                self.tools.feed(answer)
            if final:
                self.tools.finish()
            answer, calls = self.tools.take_deltas()
            if self.single_call:
                calls = [call for call in calls if call["index"] == 0]
        delta: dict = {}
        if thought and self.show_reasoning:
            delta["reasoning_content"] = delta["reasoning"] = thought
        if answer:
            delta["content"] = answer
        if calls:
            delta["tool_calls"] = calls
            self._called = True
        return delta

    def message(self, text: str) -> dict:
        """The whole answer's message fields (content, tool_calls, reasoning) from its text."""
        self.feed(text, True)
        if self.reasoning is not None:
            thought, answer = self.reasoning.result()
        else:
            thought, answer = None, text or None
        msg: dict = {"content": answer}
        if self.tools is not None:
            content, calls = self.tools.result()
            msg["content"] = content
            if calls:
                msg["tool_calls"] = [call.as_openai() for call in calls[: 1 if self.single_call else None]]
                self._called = True
        if self.reasoning is not None and self.show_reasoning:
            msg["reasoning_content"] = msg["reasoning"] = thought
        if msg["content"] is None and "tool_calls" not in msg:
            msg["content"] = ""  # (an answer that is all reasoning, or empty)
        return msg

    def finish_reason(self, finish: str) -> str:
        """"tool_calls" for an answer that called tools and stopped by itself."""
        if self._called and finish == FINISH_STOP and not self.named:
            return FINISH_TOOL_CALLS
        return finish
