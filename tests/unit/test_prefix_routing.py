"""Cache-aware routing (issue 16): block keys, the prefix index, and the router's trade of
cache hits against load. Pure state, no sockets."""

from __future__ import annotations

import random
import subprocess
import sys

from dpserve.daemons.api.prefix_index import BLOCK, PrefixIndex, block_key, chain_keys, holder_steps, leading_holders
from dpserve.daemons.api.router import Router
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import LoadTable, PrefixRouted, RankLoad, TableChannel


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def live_router(n: int = 2, **kw) -> Router:
    router = Router(n, "cache-aware", **kw)
    router.update_table(LoadTable(1, n, [RankLoad(r, f"i{r}", True) for r in range(n)]))
    for r in range(n):
        router.engine_hello(r, f"i{r}")
    return router


def route(router: Router, ids: list[int], finish: bool = True, pinned: int | None = None) -> int:
    rank = router.pick(pinned, ids)
    router.on_send(rank, len(ids) + 16)
    if finish:
        router.on_finish(rank, len(ids) + 16)
    return rank


# ---------------------------------------------------------------- keys and the index


def test_keys_are_a_chain_over_full_blocks():
    a = prompt(1, 5 * BLOCK + 10)
    assert len(chain_keys(a)) == 5 and chain_keys(a[: BLOCK - 1]) == []
    assert chain_keys(a + [1, 2, 3])[:5] == chain_keys(a)  # extending a prompt keeps its keys
    b = list(a)
    b[2 * BLOCK + 7] += 1  # one token of block 2 differs: blocks 0-1 shared, none from 2 on
    ka, kb = chain_keys(a), chain_keys(b)
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))


def test_keys_agree_across_processes():
    """API servers share keys: they must not depend on the interpreter's hash seed."""
    code = "from dpserve.daemons.api.prefix_index import chain_keys; print(chain_keys(list(range(300))))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""},
                           check=True).stdout for seed in ("1", "2", "random")}
    assert len(outs) == 1 and outs.pop().strip() == str(chain_keys(list(range(300))))


def test_index_matches_the_depth_each_rank_holds_and_forgets_a_lost_rank():
    index = PrefixIndex(3)
    keys = chain_keys(prompt(2, 6 * BLOCK))
    index.add(keys[:4], 0)
    index.add(keys, 1)
    index.add(keys[:1], 2)
    assert index.match(keys) == {0: 4, 1: 6, 2: 1}
    index.forget_rank(1)
    assert index.match(keys) == {0: 4, 2: 1}
    assert index.match(chain_keys(prompt(3, 6 * BLOCK))) == {}


def test_keys_are_block_key_chained_over_each_blocks_tokens():
    ids = prompt(7, 3 * BLOCK + 5)
    expect, parent = [], 0
    for i in range(3):  # what kv_index files from a rank's BlockStored tokens
        parent = block_key(parent, tuple(ids[i * BLOCK : (i + 1) * BLOCK]))
        expect.append(parent)
    assert chain_keys(ids) == expect == chain_keys(tuple(ids)) and chain_keys(ids, 16)[:1] != expect[:1]


def test_holder_steps_are_where_the_linear_walk_changes():
    rng = random.Random(3)
    for _ in range(300):
        n, ranks = rng.randrange(1, 40), range(rng.randrange(1, 9))
        keys = list(range(n))
        held = {r: rng.choice([0, 0, rng.randrange(n + 1), n]) for r in ranks}  # prefix-closed depths
        entries = {}
        for r, d in held.items():
            for k in keys[:d]:
                entries.setdefault(k, {})[r] = 0
        rank = rng.randrange(9)
        levels, expect = leading_holders(entries, keys), []
        for d in range(len(levels), 0, -1):  # the linear walk: each set at its deepest level, down to rank's
            if d == len(levels) or len(levels[d - 1]) != len(levels[d]):
                expect.append((d, levels[d - 1]))
                if rank in levels[d - 1]:
                    break
        assert holder_steps(entries, keys, rank, 0) == expect


def test_index_is_bounded_least_recently_used_first():
    index = PrefixIndex(1, max_entries=8)
    old, new = chain_keys(prompt(4, 4 * BLOCK)), chain_keys(prompt(5, 8 * BLOCK))
    index.add(old, 0)
    index.add(new, 0)
    assert len(index.entries) == 8 and index.match(old) == {} and index.match(new) == {0: 8}


# ---------------------------------------------------------------- the router


def test_a_conversation_returns_to_its_rank():
    router = live_router(4)
    system = prompt(6, 16 * BLOCK)
    ranks = {}
    for conv in range(8):  # eight conversations, same system prompt: spread by load while in flight
        turn1 = system + prompt(100 + conv, 2 * BLOCK)
        ranks[conv] = route(router, turn1, finish=False)
    assert len(set(ranks.values())) == 4  # a hot shared prefix does not pile onto one rank
    for conv in range(8):
        router.on_finish(ranks[conv], len(system) + 2 * BLOCK + 16)
    for conv in range(8):  # turn 2 extends turn 1: back to turn 1's rank
        turn2 = system + prompt(100 + conv, 2 * BLOCK) + prompt(200 + conv, 3 * BLOCK)
        assert route(router, turn2) == ranks[conv]


def test_a_much_busier_rank_loses_its_affinity():
    router = live_router(2)
    conv = prompt(7, 10 * BLOCK)
    first = route(router, conv)
    other = 1 - first
    # its cache saves 640 prefill tokens; 5,000 tokens of queued work outweigh that
    router.update_table(LoadTable(2, 2, [RankLoad(first, f"i{first}", True, num_waiting_prefill_tokens=5_000)]))
    assert route(router, conv + [1, 2, 3]) == other
    # a small imbalance does not (the other rank, which just got the prompt, forgets it first)
    router.prefix.forget_rank(other)
    router.update_table(LoadTable(3, 2, [RankLoad(first, f"i{first}", True, num_waiting_prefill_tokens=300)]))
    assert route(router, conv + [4, 5, 6]) == first


def test_a_restarted_rank_forgets_its_prefixes():
    router = live_router(2)
    conv = prompt(8, 8 * BLOCK)
    first = route(router, conv)
    router.update_table(LoadTable(2, 2, [RankLoad(first, f"i{first}-new", True)]))  # restarted: new incarnation
    router.engine_hello(first, f"i{first}-new")
    assert router.prefix.match(chain_keys(conv)) == {}


def test_the_pin_wins_and_teaches_the_index():
    router = live_router(2)
    conv = prompt(9, 8 * BLOCK)
    first = route(router, conv)
    other = 1 - first
    assert route(router, conv + [1], pinned=other) == other
    assert router.prefix.match(chain_keys(conv)) == {first: 8, other: 8}


def test_what_other_api_servers_routed_is_learned_and_shared_once():
    a, b = live_router(2), live_router(2)
    a.origin, b.origin = "api-a", "api-b"
    shared: list[tuple[int, list[int]]] = []
    a.on_routed = lambda rank, keys: shared.append((rank, keys))
    conv = prompt(10, 8 * BLOCK)
    rank = route(a, conv)
    assert shared == [(rank, chain_keys(conv))]
    # through the coordinator's PUB socket, as bytes
    codec = Codec(TableChannel)
    msg = codec.decode(Codec(PrefixRouted).encode(PrefixRouted("api-a", shared)))
    assert isinstance(msg, PrefixRouted)
    a.learn(msg)  # its own: nothing changes
    b.learn(msg)
    assert b.prefix.match(chain_keys(conv)) == {rank: 8}
    b.update_table(LoadTable(2, 2, [RankLoad(1 - rank, f"i{1 - rank}", True, num_waiting_prefill_tokens=10)]))
    assert route(b, conv + [1]) == rank


def test_without_cache_aware_nothing_is_hashed_or_shared():
    router = Router(2, "tokens")
    assert router.prefix is None
    router.update_table(LoadTable(1, 2, [RankLoad(r, f"i{r}", True) for r in range(2)]))
    for r in range(2):
        router.engine_hello(r, f"i{r}")
    router.pick(None, prompt(11, 4 * BLOCK))
    assert router._pending_keys is None
