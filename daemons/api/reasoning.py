"""Reasoning parsers (--reasoning-parser): a thinking model's answer split into its
reasoning (reasoning_content) and the answer proper (content).

Formats follow vLLM's parsers of the same names: deepseek_r1 (everything before
</think> is reasoning, whether or not the model wrote <think>: its template opens
the block) and qwen3 (the same while thinking is on, and a <tool_call> ends the
reasoning too; with chat_template_kwargs enable_thinking=false the whole answer is
content). Fed piece by piece or whole, with the same result. The grammar of
structured output and tool choice is wrapped (answer_grammar) so that it binds the
answer after the reasoning, never the reasoning itself. Must never raise on model text.
"""

from __future__ import annotations

import json

from dpserve.daemons.api.tools.scan import grown, partial_tag_overlap

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """One answer's split. Text before `reasoning_end` (after the opening tag) is
    reasoning; from `content_start` on, content. Until the end is seen, a tail that
    may be the start of an ending tag is held back from the reasoning deltas."""

    name = "deepseek_r1"
    end_tags: tuple[str, ...] = (THINK_END,)
    implicit_ends: tuple[str, ...] = ()  # tags that end the reasoning and belong to the content

    def __init__(self, thinking: bool = True) -> None:
        self.text = ""
        self.thinking = thinking
        self.reasoning_start = 0
        self.reasoning_end: int | None = None if thinking else 0
        self.content_start: int | None = None if thinking else 0
        self._opened = not thinking  # the leading <think> has been looked for
        self._safe = 0  # reasoning text before this index is final
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) text new with this delta."""
        self.text = grown(self, delta)
        self._advance(False)
        return self._deltas()

    def finish(self) -> tuple[str, str]:
        """The deltas left at the end (no tag can start any more)."""
        self._advance(True)
        return self._deltas()

    def result(self) -> tuple[str | None, str | None]:
        """(reasoning, content or None) of the whole answer, after finish(); reasoning is
        None only when the model does not think (then "" is an empty block, as vLLM's)."""
        end = len(self.text) if self.reasoning_end is None else self.reasoning_end
        reasoning = self.text[self.reasoning_start : end] if self.thinking else None
        content = self.text[self.content_start :] if self.content_start is not None else ""
        return reasoning, content or None

    def _advance(self, final: bool) -> None:
        text = self.text
        if not self._opened:
            if text.startswith(THINK_START):
                self.reasoning_start = self._safe = len(THINK_START)
            elif not final and THINK_START.startswith(text):
                return  # may still become <think>
            self._opened = True
        if self.content_start is not None:
            return
        tags = self.end_tags + self.implicit_ends
        start = max(self.reasoning_start, self._safe)  # no tag starts before what is already final
        found = [(i, tag) for tag in tags if (i := text.find(tag, start)) >= 0]
        if found:
            i, tag = min(found)
            self.reasoning_end = i
            self.content_start = i if tag in self.implicit_ends else i + len(tag)
            return
        tail = 0 if final else max(partial_tag_overlap(text, tag) for tag in tags)
        self._safe = max(self._safe, len(text) - tail)

    def _deltas(self) -> tuple[str, str]:
        end = self.reasoning_end if self.reasoning_end is not None else self._safe
        start = max(self._sent_reasoning, self.reasoning_start)
        reasoning = self.text[start:end] if end > start else ""
        self._sent_reasoning = max(self._sent_reasoning, end)
        content = ""
        if self.content_start is not None:
            start = max(self._sent_content, self.content_start)
            content = self.text[start:]
            self._sent_content = len(self.text)
        return reasoning, content


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_ends = ("<tool_call>",)


class ReasoningTokens:
    """vLLM's usage.completion_tokens_details.reasoning_tokens of one answer: its output
    ids from the start (past a leading <think>) up to the first tag that ends the
    reasoning, counted as the ids arrive. When a tag is not one token of the vocabulary,
    the reasoning text the parser found is tokenized instead."""

    __slots__ = ("parser", "tokenizer", "start_id", "end_ids", "count", "seen", "done")

    def __init__(self, parser: ReasoningParser, tokenizer) -> None:
        self.parser = parser
        self.tokenizer = tokenizer
        ids = [_single_token(tokenizer, tag) for tag in (THINK_START, *parser.end_tags, *parser.implicit_ends)]
        self.start_id = ids[0]
        self.end_ids = frozenset(ids[1:]) if all(i is not None for i in ids[1:]) else None
        self.count = 0
        self.seen = 0
        self.done = not parser.thinking

    def update(self, ids: list[int]) -> int:
        """The count after `ids`, the answer's output ids so far (a longer list each call)."""
        if self.done:
            return self.count
        if self.end_ids is None:
            reasoning, _ = self.parser.result()
            return len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        for i in range(self.seen, len(ids)):
            token = ids[i]
            if token in self.end_ids:
                self.done = True
                break
            if not (i == 0 and token == self.start_id):
                self.count += 1
        self.seen = len(ids)
        return self.count


def _single_token(tokenizer, text: str) -> int | None:
    """The id of `text` when it is one token of the vocabulary, else None."""
    token_id = tokenizer.backend.token_to_id(text)
    return token_id if token_id is not None and tokenizer.decode((token_id,), skip_special_tokens=False) == text else None


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (ReasoningParser, Qwen3ReasoningParser)
}


def thinking_enabled(parser: str, template_kwargs: dict | None) -> bool:
    """Whether the model thinks in this request: qwen3 honours the template's
    enable_thinking switch (default on), as vLLM's parser does."""
    if parser == "qwen3" and template_kwargs and template_kwargs.get("enable_thinking") is False:
        return False
    return True


def answer_grammar(grammar: str, think_tokens: bool) -> str:
    """`grammar` (llguidance's JSON form) bound to the answer after a reasoning block:
    an optional <think>, any text, </think>, new lines, then the answer's grammar.
    `think_tokens`: the tags are single tokens of the tokenizer (llguidance then
    names them as tokens, which regular text cannot spell)."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    grammars = top["grammars"]
    grammars[0] = {**grammars[0], "name": grammars[0].get("name") or "answer"}
    answer = grammars[0]["name"]
    if think_tokens:
        lark = f"start: <think>? THINK </think> /[ \\n]*/ @{answer}\nTHINK: /(?s:.*)/"
    else:
        lark = f'start: "<think>"? think /[ \\n]*/ @{answer}\nthink[lazy]: /(?s:.*)<\\/think>/'
    top["grammars"] = [{"name": "reasoned", "lark_grammar": lark}, *grammars]
    return json.dumps(top)
