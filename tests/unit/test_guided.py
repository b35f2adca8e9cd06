"""Structured output's cost model, its compile pool on the API server, and the
engine's grammar compiles: every budget is a quick 400 naming the parameter,
what passes compiles and is followed, nothing compiles on a loop, a repeated
grammar compiles once, and a grammar that breaks fails its request."""

from __future__ import annotations

import asyncio
import json
import re
import time

import msgspec
import pytest
from dpserve.daemons.api import guided
from dpserve.daemons.api.guided import GrammarBudget, check_cost, guided_grammar, regex_size
from dpserve.daemons.api.openai_types import ApiError, CompletionRequest
from dpserve.engine.common.protocol import FINISH_ERROR, AddRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)

BUDGET = GrammarBudget()
REF_CYCLE = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                       "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
             "$ref": "#/$defs/a"}


def request(**kw) -> CompletionRequest:
    return msgspec.convert({"model": "demo", "prompt": "Hi", **kw}, CompletionRequest)


def refused(name: str, value, copies: int = 1) -> ApiError:
    start = time.perf_counter()
    with pytest.raises(ApiError) as info:
        check_cost(name, value, BUDGET, copies)
    assert time.perf_counter() - start < 1.0  # milliseconds in fact; a stall of seconds must not happen
    assert info.value.status == 400 and info.value.param == name, str(info.value)
    return info.value


@pytest.mark.parametrize(("pattern", "size"), [
    ("abc", 3), ("a{100}", 100), ("(ab){3}", 6), ("((a{10}){10}){10}", 1000), ("a{2,5}b", 6), ("a{3,}", 3),
    (r"\d{4}-\d{2}", 7), ("[a-z{}]{8}", 8), (r"a\{100\}", 6), ("a*b+c?", 3), ("x{,}", 4), (r"\p{L}{5}", 5),
])
def test_regex_size_expands_counted_repetitions(pattern, size):
    assert regex_size(pattern, 10**9) == size


@pytest.mark.parametrize("pattern", ["a{100000}", "a{1000000}", "((a{100}){100}){100}", "(a{99999999999999999999})"])
def test_huge_repetitions_are_a_400_naming_the_flag(pattern):
    err = refused("guided_regex", pattern)
    assert "--max-guided-regex-size" in str(err)


@pytest.mark.parametrize("num", [3000, 10_000, 300_000])
def test_too_many_choices_are_a_400(num):
    err = refused("guided_choice", [f"choice{i}" for i in range(num)])
    assert "--max-guided-choices" in str(err) or "--max-guided-grammar-bytes" in str(err)


def test_n_times_the_grammar_is_bounded():
    choices = [f"choice-number-{i:04d}" for i in range(900)]  # 16 KiB; x 128: 2 MiB
    check_cost("guided_choice", choices, BUDGET, 1)
    assert "--max-guided-bytes-per-request" in str(refused("guided_choice", choices, copies=128))


def test_schemas_past_the_budgets_are_a_400():
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(5000)}}  # 54 KB: within the bytes
    assert "properties" in str(refused("guided_json", wide))
    assert "properties" in str(refused("guided_json", json.dumps(wide)))
    many = {"type": "object", "properties": {f"o{k}": {"type": "object", "properties": {f"p{i}": {} for i in range(400)}} for k in range(3)}}
    assert "--max-guided-schema-properties" in str(refused("guided_json", many))
    deep: dict = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    assert "--max-guided-schema-depth" in str(refused("guided_json", deep))
    refused("guided_json", "[" * 30000 + "]" * 30000)  # deeper than json.loads goes: still a 400
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert "--max-guided-schema-depth" in str(refused("guided_json", {"type": "array", "default": nested}))
    assert "--max-guided-choices" in str(refused("guided_json", {"enum": list(range(5000))}))
    assert "--max-guided-regex-size" in str(refused("guided_json", {"type": "string", "pattern": "a{100000}"}))
    assert "--max-guided-regex-size" in str(refused("guided_json", {"type": "array", "minItems": 100000}))
    assert "--max-guided-regex-size" in str(refused("guided_json", {"type": "object", "patternProperties": {"a{100000}": {}}}))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": wide}}
    assert "properties" in str(refused("response_format", fmt))


@pytest.mark.parametrize("schema", [
    REF_CYCLE,
    {"type": "object", "properties": {"child": {"$ref": "#"}}},
    {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
    {"$ref": "https://example.com/schema.json"},
])
def test_ref_cycles_and_remote_refs_are_a_400(schema):
    assert "$ref" in str(refused("guided_json", schema))


def test_acyclic_refs_pass():
    schema = {"$defs": {"name": {"type": "string", "maxLength": 8}, "pair": {"type": "array", "prefixItems": [{"$ref": "#/$defs/name"}, {"$ref": "#/$defs/name"}]}},
              "type": "object", "properties": {"a": {"$ref": "#/$defs/pair"}, "b": {"$ref": "#/$defs/name"}}, "required": ["a", "b"]}
    check_cost("guided_json", schema, BUDGET, 1)


# ---------------------------------------------------------------- at the budget: compiles and is followed

def at_the_limits() -> list[tuple[str, object, object]]:
    """(parameter, value, a check of the text) at each budget's default."""
    choices = [f"w{i:04d}" for i in range(BUDGET.max_choices)]
    obj = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(400)}}
    wide = {"type": "object", "properties": {f"o{k}": obj for k in range(2)}}
    enum = {"enum": [f"e{i}" for i in range(BUDGET.max_choices)]}
    return [
        ("guided_choice", choices, lambda text: text in choices),
        ("guided_regex", "a{4096}", lambda text: re.fullmatch("a{4096}", text)),
        ("guided_regex", "(ab|cd){1000}", lambda text: re.fullmatch("(ab|cd){1000}", text)),
        ("guided_json", wide, lambda text: _valid(text, wide)),
        ("guided_json", enum, lambda text: _valid(text, enum)),
    ]


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.fixture(scope="module")
def grammar_tokenizer(demo_model_dir):
    from dpserve.engine.grammar import GrammarCompiler
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(f"{demo_model_dir}/tokenizer.json").get_vocab_size()
    return GrammarCompiler._build_tokenizer(demo_model_dir, size, [1])  # demo_model.EOS


def follow(tokenizer, grammar: str, max_tokens: int = 9000) -> str:
    """Walk the grammar to its end, taking the last allowed token each step; the text."""
    import llguidance
    import llguidance.torch as llg
    import torch
    from dpserve.engine.common.grammar_limits import GRAMMAR_LIMITS

    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=llguidance.LLParserLimits(**GRAMMAR_LIMITS))
    mask = llg.allocate_token_bitmask(1, tokenizer.vocab_size)
    data = b""
    for _ in range(max_tokens):
        assert not matcher.is_error(), matcher.get_error()
        if matcher.is_stopped():
            break
        llg.fill_next_token_bitmask(matcher, mask, 0)
        allowed = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[: tokenizer.vocab_size].nonzero()
        token = int(allowed[-1])
        if token == tokenizer.eos_token:
            break
        assert matcher.consume_token(token), matcher.get_error()
        data += tokenizer.decode_bytes([token])
    assert not matcher.is_error(), matcher.get_error()
    return data.decode()


@pytest.mark.parametrize("case", range(5))
def test_what_passes_the_budget_compiles_and_is_followed(grammar_tokenizer, case):
    name, value, check = at_the_limits()[case]
    req = request(**{name: value})
    grammar = asyncio.run(guided_grammar(req))
    text = follow(grammar_tokenizer, grammar)
    assert check(text), text[:200]


# ---------------------------------------------------------------- the API server's compile pool

def test_compiling_never_blocks_the_loop_and_a_repeat_is_cached():
    schema = {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(1000)}, "required": [f"q{i}" for i in range(1000)]}
    req = request(guided_json=schema)

    async def main():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        start = time.perf_counter()
        first = await guided_grammar(req)
        took = time.perf_counter() - start
        start = time.perf_counter()
        again = await guided_grammar(request(guided_json=json.dumps(schema)))
        repeat = time.perf_counter() - start
        done.set()
        await ticker
        return first, again, took, repeat, max(gaps)

    first, again, took, repeat, gap = asyncio.run(main())
    assert first == again
    assert repeat < took  # cached: no build
    assert gap < max(took / 2, 0.05), (gap, took)  # the loop kept turning while it compiled


def test_a_grammar_the_library_refuses_is_a_400_every_time():
    for _ in range(2):
        with pytest.raises(ApiError) as info:
            asyncio.run(guided_grammar(request(guided_regex="a(")))
        assert info.value.status == 400 and info.value.param == "guided_regex"


def test_the_cache_is_bounded():
    results = guided._Results()
    for i in range(guided._CACHE_ENTRIES + 20):
        results.get(f"k{i}", lambda: ("g", "")).result()
    assert len(results._items) == guided._CACHE_ENTRIES


# ---------------------------------------------------------------- the engine's grammar compiles

def test_the_engine_compiles_one_grammar_once_off_its_loop(loaded_demo_model):
    from tests.unit.test_sampler import make_engine, prompt

    engine = make_engine(loaded_demo_model, max_num_seqs=64)
    choices = [f"w{i:04d}" for i in range(500)]
    grammar = asyncio.run(guided_grammar(request(guided_choice=choices)))
    for i in range(32):
        assert engine.add_request(AddRequest(f"g{i}", prompt(i, 6), SamplingParams(max_tokens=12, temperature=1.0, seed=i, guided_grammar=grammar), 0.0)) is None
    texts = _finish(engine, 32)
    assert engine.grammars.num_compiles == 1
    assert all(text in choices for text in texts.values()), texts


def test_a_heavy_compile_does_not_hold_the_step_loop(loaded_demo_model):
    """A grammar that takes a second to compile (past the API server's budgets, sent
    straight to the engine): plain requests step on meanwhile, each step short."""
    import llguidance

    from tests.unit.test_sampler import make_engine, prompt

    engine = make_engine(loaded_demo_model)
    heavy = llguidance.LLMatcher.grammar_from_json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}})
    engine.grammars.submit("warm-up").result()  # the tokenizer is built
    assert engine.add_request(AddRequest("heavy", prompt(1, 6), SamplingParams(max_tokens=4, guided_grammar=heavy), 0.0)) is None
    assert engine.add_request(AddRequest("plain", prompt(2, 6), SamplingParams(max_tokens=8, ignore_eos=True), 0.0)) is None
    longest, plain_done, finished = 0.0, None, {}
    while engine.has_unfinished():
        start = time.perf_counter()
        for out in engine.step():
            if out.finish_reason:
                finished[out.request_id] = out
        longest = max(longest, time.perf_counter() - start)
        if "plain" in finished and plain_done is None:
            plain_done = "heavy" not in finished
    assert plain_done, "the plain request waited for the compile"
    assert longest < 0.5, longest  # the compile itself takes about a second


def test_a_grammar_that_breaks_fails_its_request_never_stop(loaded_demo_model):
    """Grammars past the API server's budgets, sent straight to the engine: one the
    library cannot compile, and one whose lexer runs out of fuel mid-answer."""
    import llguidance

    from tests.unit.test_sampler import make_engine, prompt

    engine = make_engine(loaded_demo_model)
    rows = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(f"ch{i:05d}") for i in range(3000)))
    cases = {"bad": "{not a grammar", "fuel": llguidance.LLMatcher.grammar_from_regex("a{100000}"), "rows": rows}
    for rid, grammar in cases.items():
        assert engine.add_request(AddRequest(rid, prompt(3, 6), SamplingParams(max_tokens=20, temperature=0.0, guided_grammar=grammar), 0.0)) is None
    assert engine.add_request(AddRequest("plain", prompt(4, 6), SamplingParams(max_tokens=5, ignore_eos=True), 0.0)) is None
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finish_reason})
    for rid in cases:
        assert finals[rid].finish_reason == FINISH_ERROR and finals[rid].error, (rid, finals[rid])
    assert finals["plain"].finish_reason == "length"


def _finish(engine, num: int) -> dict[str, str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{engine.config.model}/tokenizer.json")
    ids: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.finish_reason != FINISH_ERROR, out.error
            ids.setdefault(out.request_id, []).extend(t for t in out.new_token_ids if t not in engine.eos_token_ids)
    assert len(ids) == num
    return {rid: tok.decode(t) for rid, t in ids.items()}


def test_the_flags_reach_the_api_servers_budget():
    """--max-guided-* on the command line -> ServeConfig -> an API server's config -> its budget."""
    from dpserve.daemons.config import ApiServerConfig, ServeConfig, child_config

    from tests.unit.test_config import parse

    opts, names, _ = parse("serve", ["--max-guided-choices", "10", "--max-guided-regex-size", "50"])
    cfg = ServeConfig(model="/m", served_model_name="m", **{k: opts[k] for k in names if k in ServeConfig.__struct_fields__})
    required = dict(name="api-0", index=0, node_rank=0, coordinator_address="", eligible_ranks=[0], key_file="", model_dir="/m",
                    max_model_len=64, listen_fd=3, engine_address="", table_address="", supervisor_address="", probe_path="", parent_pid=1)
    budget = GrammarBudget.from_config(child_config(ApiServerConfig, cfg, **required))
    assert (budget.max_choices, budget.max_regex_size, budget.max_bytes) == (10, 50, GrammarBudget().max_bytes)
    with pytest.raises(ApiError, match="10 .--max-guided-choices"):
        check_cost("guided_choice", [str(i) for i in range(11)], budget, 1)
    with pytest.raises(ApiError, match="--max-guided-regex-size"):
        check_cost("guided_regex", "a{51}", budget, 1)
    check_cost("guided_regex", "a{50}", budget, 1)


def test_added_tokens_that_are_not_special_can_be_spelled(tmp_path):
    """A regex or JSON that spells a non-special added token's text (Hermes' <tool_call>) is
    followed, by that token too; a special token stays reachable only as a token."""
    llguidance = pytest.importorskip("llguidance")
    from dpserve.engine.grammar import GrammarCompiler
    from dpserve.engine.testing.demo_model import write_tokenizer
    from tokenizers import Tokenizer

    model = write_tokenizer(str(tmp_path / "tok"), chat="tools")
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    lltok = GrammarCompiler._build_tokenizer(model, tok.get_vocab_size(), [1])
    tool_call, im_end = tok.token_to_id("<tool_call>"), tok.token_to_id("<|im_end|>")
    for grammar, text in ((llguidance.LLMatcher.grammar_from_regex('<tool_call>\\{"a": 1\\}</tool_call>'), '<tool_call>{"a": 1}</tool_call>'),
                          (llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "const": "<tool_call>"}), '"<tool_call>"')):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tool_call in ids
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()
    special = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_regex("<\\|im_end\\|>"))
    assert not special.consume_token(im_end)  # its text is not its token: a special token is no text
    assert llguidance.LLMatcher(lltok, f"start: <[{im_end}]>").consume_token(im_end)
