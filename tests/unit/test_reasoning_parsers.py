"""Reasoning parsers on recorded answers, whole and streamed at every split point;
reasoning followed by tool calls (ChatAnswer); the grammar that binds only the answer."""

from __future__ import annotations

import json

import pytest
from dpserve.daemons.api.reasoning import REASONING_PARSERS, answer_grammar, thinking_enabled
from dpserve.daemons.api.tools.answer import ChatAnswer
from dpserve.daemons.api.tools.parsers import TOOL_PARSERS

# (parser, thinking, text, reasoning, content)
RECORDED = [
    ("deepseek_r1", True, "<think>Paris is in France.</think>\n\nIt is Paris.", "Paris is in France.", "\n\nIt is Paris."),
    ("deepseek_r1", True, "The template opened it. </think>Answer", "The template opened it. ", "Answer"),
    ("deepseek_r1", True, "Still thinking when cut <", "Still thinking when cut <", None),
    ("deepseek_r1", True, "<think></think>", "", None),
    ("deepseek_r1", True, "a </thin b </think>c</think>d", "a </thin b ", "c</think>d"),
    ("qwen3", True, "<think>\nneed a tool\n</think>\n\n<tool_call>x", "\nneed a tool\n", "\n\n<tool_call>x"),
    ("qwen3", True, "<think>call it<tool_call>{}", "call it", "<tool_call>{}"),
    ("qwen3", False, "<think>literal</think> text", None, "<think>literal</think> text"),
]


def splits(text):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize(("name", "thinking", "text", "reasoning", "content"), RECORDED)
def test_whole_and_streamed(name, thinking, text, reasoning, content):
    p = REASONING_PARSERS[name](thinking)
    p.feed(text)
    p.finish()
    assert p.result() == (reasoning, content)
    for chunks in splits(text):
        p = REASONING_PARSERS[name](thinking)
        parts = [p.feed(c) for c in chunks] + [p.finish()]
        assert "".join(r for r, _ in parts) == (reasoning or ""), chunks
        assert "".join(c for _, c in parts) == (content or ""), chunks


def test_tag_prefixes_are_held_back_not_lost():
    p = REASONING_PARSERS["deepseek_r1"]()
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>abc </th") == ("abc ", "")
    assert p.feed("ink>ok") == ("", "ok")


def test_qwen3_follows_enable_thinking():
    assert thinking_enabled("qwen3", {"enable_thinking": False}) is False
    assert thinking_enabled("qwen3", None) and thinking_enabled("deepseek_r1", {"enable_thinking": False})


def test_reasoning_then_tool_calls_streamed_as_whole():
    text = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    whole = ChatAnswer(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"]())
    msg = whole.message(text)
    assert msg["reasoning_content"] == msg["reasoning"] == "\nThe user wants weather.\n"
    assert msg["content"] == "\n\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("get_weather", '{"city": "Paris"}')]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for chunks in splits(text):
        answer = ChatAnswer(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"]())
        deltas = [answer.feed(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == msg["content"]
        args = "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", ()))
        assert args == msg["tool_calls"][0]["function"]["arguments"]


def test_answer_grammar_wraps_json_and_lark_grammars():
    inner = json.dumps({"grammars": [{"name": "json_schema", "json_schema": {"type": "object"}, "lark_grammar": None}]})
    top = json.loads(answer_grammar(inner, True))
    assert top["grammars"][0]["lark_grammar"].startswith("start: <think>? THINK </think>")
    assert "@json_schema" in top["grammars"][0]["lark_grammar"] and top["grammars"][1]["name"] == "json_schema"
    top = json.loads(answer_grammar('start: "yes" | "no"', False))
    assert top["grammars"][1] == {"name": "answer", "lark_grammar": 'start: "yes" | "no"'}
    assert "think[lazy]" in top["grammars"][0]["lark_grammar"]


@pytest.mark.parametrize("chat", ["tools", "plain"])  # the tags as added tokens, or as plain text
def test_answer_grammar_binds_only_the_answer(tmp_path, chat):
    llguidance = pytest.importorskip("llguidance")
    from dpserve.engine.grammar import llg_tokenizer
    from dpserve.engine.testing.demo_model import write_tokenizer
    from tokenizers import Tokenizer

    model = write_tokenizer(str(tmp_path / "tok"), chat=chat)
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    lltok = llg_tokenizer(tok, tok.get_vocab_size(), [1])  # as a rank builds it: non-special tags are text
    schema = llguidance.LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                            "required": ["a"], "additionalProperties": False})
    grammar = answer_grammar(schema, False)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    for text, ok in (('<think>any {"b": text}</think>\n{"a": 1}', True), ('no open tag</think>{"a":2}', True),
                     ('<think>x</think>{"b": 1}', False), ('{"a": 1}', False)):
        matcher = llguidance.LLMatcher(lltok, grammar)
        accepted = matcher.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and matcher.is_accepting()
        assert accepted == ok, text


_VLLM_SIDE = """
import json, logging, sys
logging.disable(logging.CRITICAL)
from transformers import PreTrainedTokenizerFast
from dpserve.engine.testing.demo_model import write_tokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParserManager

tok = PreTrainedTokenizerFast(tokenizer_file=write_tokenizer(sys.argv[1], chat="tools") + "/tokenizer.json")
out = []
for name, thinking, text in json.load(sys.stdin):
    kwargs = {"enable_thinking": thinking}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], chat_template_kwargs=kwargs)
    cls = ReasoningParserManager.get_reasoning_parser(name)
    try:
        parser = cls(tok, chat_template_kwargs=kwargs)
    except TypeError:
        parser = cls(tok)
    out.append(list(parser.extract_reasoning(text, req)))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_same_split_as_vllms_parsers(tmp_path):
    """vLLM's own deepseek_r1 and qwen3 parsers (the vLLM venv's) split every recorded answer the same way."""
    import subprocess

    from tests.support import vllm_venv

    cases = [(name, thinking, text) for name, thinking, text, *_ in RECORDED]
    script = tmp_path / "vllm_side.py"
    script.write_text(_VLLM_SIDE)
    proc = subprocess.run([f"{vllm_venv()}/bin/python", str(script), str(tmp_path / "tok")], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    for (name, thinking, text), theirs in zip(cases, json.loads(lines[0][len("RESULT "):]), strict=True):
        parser = REASONING_PARSERS[name](thinking)
        parser.feed(text)
        parser.finish()
        assert list(parser.result()) == theirs, (name, text)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    assert [c["function"]["name"] for c in ChatAnswer(None, TOOL_PARSERS["hermes"](), single_call=True).message(text)["tool_calls"]] == ["a"]
    for chunks in splits(text):
        answer = ChatAnswer(None, TOOL_PARSERS["hermes"](), single_call=True)
        deltas = [answer.feed(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
        assert {t["index"] for d in deltas for t in d.get("tool_calls", ())} == {0}
        assert answer.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("chat", ["tools", "plain"])  # the tags as single tokens, or as text tokenized
def test_reasoning_tokens_count_the_ids_before_the_end_tag(tmp_path, chat):
    # vLLM's usage.completion_tokens_details.reasoning_tokens: counted as the ids arrive
    from dpserve.daemons.api.tokenizer import TextTokenizer
    from dpserve.engine.testing.demo_model import write_tokenizer

    tok = TextTokenizer.from_dir(write_tokenizer(str(tmp_path / "tok"), chat=chat))
    thought, answer = "let me think about it", "the answer"
    ids = tok.encode(f"<think>{thought}</think>{answer}", add_special_tokens=False)
    answer_ = ChatAnswer(REASONING_PARSERS["deepseek_r1"](), None)
    answer_.message(tok.decode(ids, skip_special_tokens=False))
    assert answer_.reasoning_tokens(ids, tok) == len(tok.encode(thought, add_special_tokens=False))
    streamed = ChatAnswer(REASONING_PARSERS["qwen3"](), None)
    for i in range(1, len(ids) + 1):  # one more id each call
        streamed.feed(tok.decode(ids[i - 1 : i], skip_special_tokens=False), i == len(ids))
        count = streamed.reasoning_tokens(ids[:i], tok)
    assert count == len(tok.encode(thought, add_special_tokens=False))
    off = ChatAnswer(REASONING_PARSERS["qwen3"](thinking=False), None)
    assert off.reasoning_tokens(ids, tok) == 0 and ChatAnswer(None, None).reasoning_tokens(ids, tok) == 0
