"""Prefix caching end to end (issue 16): the real demo model gives the same greedy
answers with the cache on and off (hits, a prompt that is a prefix of another,
evictions under a small KV budget), and a real node reports cached prompt tokens
to the official openai client and in /metrics."""

from __future__ import annotations

import random
import re

import pytest

from tests.server import DpServer

BLOCK = 16  # the native engine's default block size
BYTES_PER_TOKEN = 1024  # demo model: 2 layers x 2 KV heads x 32 dims x (K, V) x float32


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(n)]


# ---------------------------------------------------------------- engine: on == off


@pytest.fixture(scope="module")
def loaded(demo_model_dir):
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.loader import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the demo model's matrices gain nothing from more
        return load_model(EngineConfig(model=demo_model_dir, device="cpu", dtype="float32"))


def run_waves(loaded, waves: list[list[list[int]]], caching: bool, kv_blocks: int = 0, max_tokens: int = 12):
    """Each wave's prompts run together to the end before the next wave starts (so
    later waves find what earlier ones cached). Returns (answers, cached tokens by
    request, the engine)."""
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.common.protocol import AddRequest, SamplingParams
    from dpserve.engine.core import EngineCore

    config = EngineConfig(model=loaded.model_dir, device="cpu", dtype="float32", enable_prefix_caching=caching,
                          kv_cache_memory_bytes=kv_blocks * BLOCK * BYTES_PER_TOKEN)
    engine = EngineCore.from_loaded(config, loaded)
    assert engine.blocks.enable_caching is caching
    if kv_blocks:
        assert engine.blocks.num_blocks == kv_blocks
    answers: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for w, wave in enumerate(waves):
        for i, prompt in enumerate(wave):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            assert engine.add_request(AddRequest(f"w{w}-{i}", prompt, params, arrival_time=0.0)) is None
        for _ in range(10_000):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                assert out.error is None, out.error
                if out.request_id not in answers:
                    cached[out.request_id] = out.num_cached_tokens
                answers.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # nothing leaked
    return answers, cached, engine


def test_greedy_answers_are_the_same_with_cache_hits_and_prefixes(loaded):
    system = ids(1, 70)  # 4 full blocks and a partial one
    long = ids(2, 64)  # exactly 4 blocks: the last must still be computed
    waves = [
        [system + ids(10, 9), long],
        [system + ids(11, 20), system + ids(12, 3), long, long[:40]],  # hits; a prefix of an earlier prompt
        [long + ids(13, 30), system, system + ids(11, 20)],  # extends a cached prompt; the shared prefix alone; a repeat
    ]
    off, off_cached, _ = run_waves(loaded, waves, caching=False)
    on, on_cached, engine = run_waves(loaded, waves, caching=True)
    assert on == off
    assert not any(off_cached.values())
    assert on_cached["w0-0"] == on_cached["w0-1"] == 0
    assert on_cached["w1-0"] == on_cached["w1-1"] == 64  # the system prompt's 4 full blocks
    assert on_cached["w1-2"] == 48  # the last block of an exact repeat runs again
    assert on_cached["w1-3"] == 32  # long[:40]: two full blocks of it are cached
    assert on_cached["w2-0"] == 64 and on_cached["w2-1"] == 64 and on_cached["w2-2"] == 80
    assert engine.num_prefix_hits == sum(on_cached.values())


def test_greedy_answers_are_the_same_under_evictions(loaded):
    # 24 blocks (384 tokens) against prompts of 100-150 tokens, three at a time:
    # cached blocks are evicted all along, and sequences are preempted.
    prefixes = [ids(100 + k, 80) for k in range(4)]
    rng = random.Random(7)
    waves = [[prefixes[rng.randrange(4)] + ids(200 + 10 * w + i, rng.randrange(20, 70)) for i in range(3)] for w in range(8)]
    off, _, engine_off = run_waves(loaded, waves, caching=False, kv_blocks=24, max_tokens=20)
    on, on_cached, engine = run_waves(loaded, waves, caching=True, kv_blocks=24, max_tokens=20)
    assert on == off
    assert engine.blocks.num_evictions > 0, "the test needs evictions"
    assert any(on_cached.values()), "the test needs cache hits"


# ---------------------------------------------------------------- a real node


@pytest.fixture(scope="module")
def node(demo_model_dir):
    with DpServer(demo_model_dir, "--data-parallel-size", "1", "--max-model-len", "1024") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(node):
    import openai

    with openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_a_repeated_long_prompt_reports_cached_tokens(node, client, openai_schema):
    prompt = ids(300, 300)
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0)
    again = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 288  # 18 full blocks; the last runs again
    assert again.usage.prompt_tokens == 300
    assert again.choices[0].text == first.choices[0].text
    openai_schema(again.usage.model_dump(exclude_none=True), "CompletionUsage")

    # Several prompts: summed like prompt_tokens (once per prompt, not per choice).
    batch = client.completions.create(model="demo", prompt=[prompt, ids(301, 40)], n=2, max_tokens=4, temperature=0)
    assert batch.usage.prompt_tokens == 340 and batch.usage.prompt_tokens_details.cached_tokens == 288

    text = "Tell me about the engine and its paged cache. " * 40
    messages = [{"role": "user", "content": text}]
    client.chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0)
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK * BLOCK > 0

    metrics = node.metrics()
    hits = re.search(r'^vllm:prefix_cache_hits_total\{rank="0"\} (\S+)$', metrics, re.M)
    queries = re.search(r'^vllm:prefix_cache_queries_total\{rank="0"\} (\S+)$', metrics, re.M)
    assert hits and queries, metrics
    # the load report may trail the last answers by a moment: at least the first repeat's hits are in
    assert float(hits.group(1)) >= 288 and float(queries.group(1)) >= 600
