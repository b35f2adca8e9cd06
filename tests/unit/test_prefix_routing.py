"""Cache-aware routing (issue 16): block keys, the prefix index, and the router's trade of
cache hits against load. Pure state, no sockets."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import sysconfig

import pytest
from dpserve.daemons.api.prefix_index import (
    BLOCK,
    KEYS_IMPL,
    PrefixIndex,
    block_key,
    chain_keys,
    cheapest_holder,
    deepest_held,
    py_chain_keys,
)
from dpserve.daemons.api.router import CACHE_WEIGHT, Router
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


def test_cheapest_holder_is_the_brute_force_cheapest():
    """The pruned search returns what scoring every rank at its own depth would: the lowest
    score - depth x block x max(1, weight / the ranks holding that depth), best on a tie;
    non-candidates (None) never win. With stale entries
    (the approximate index after a restart: an older incarnation's deeper blocks) a rank may
    be credited with less than it holds, never with more."""
    rng = random.Random(3)
    for i in range(3000):
        n, size, stale = rng.randrange(1, 40), rng.randrange(1, 9), i % 3 == 0
        keys = list(range(100, 100 + n))
        gen = [rng.choice([0, 0, 1]) if stale else 0 for _ in range(size)]
        entries, depth = {}, {}
        for r in range(size):
            old, d = rng.choice([0, 0, rng.randrange(n + 1), n]) if stale else 0, rng.choice([0, rng.randrange(n + 1), n])
            for j, k in enumerate(keys[: max(old, d)]):
                entries.setdefault(k, {})[r] = gen[r] if j < d else gen[r] - 1
            depth[r] = d
        scores = [rng.choice([None, rng.randrange(0, 3000)]) for _ in range(size)]
        if all(x is None for x in scores):
            continue
        best = min((r for r in range(size) if scores[r] is not None), key=lambda r: scores[r])
        block, weight = rng.choice([64, 256, 16]), rng.choice([1.0, 8.0, 2.5])
        rank, got = cheapest_holder(entries, keys, best, scores, gen, block, weight)
        holders = {r: sum(1 for h in range(size) if depth[h] >= depth[r]) for r in range(size)}
        cost = {r: scores[r] - depth[r] * block * max(1.0, weight / holders[r]) for r in range(size) if scores[r] is not None}
        assert rank in cost and got <= depth[rank]
        if not stale:
            assert got == depth[rank] and cost[rank] == min(cost.values())
            assert rank == best or cost[best] > cost[rank]


def test_deepest_held_probes_the_first_and_the_last_block_first():
    keys, probed = list(range(64)), []

    class Entries(dict):
        def __contains__(self, key):
            probed.append(key)
            return dict.__contains__(self, key)

    for held, probes in ((0, [0]), (64, [0, 63]), (40, None)):
        probed.clear()
        assert deepest_held(Entries({k: {0: 0} for k in keys[:held]}), keys) == held
        assert probes is None or probed == probes
    assert len(probed) <= 8  # a binary search otherwise


def test_c_keys_are_the_python_keys():
    """The C extension and the pure-Python fallback give the same keys: for token ids, for ints
    past one digit, negative or beyond 64 bits (ints hash modulo 2**61 - 1), bools, and
    other hashable ids (hashed from a tuple copy), from lists and tuples, any block size."""
    if KEYS_IMPL != "c":
        pytest.skip("built without the C extension: chain_keys is the Python fallback (KEYS_IMPL)")
    from dpserve.daemons.api._prefix_keys import chain_keys as c_keys

    rng = random.Random(5)
    odd = [0, -1, -2, 1 << 30, -(1 << 30), (1 << 61) - 1, 1 << 61, (1 << 63) - 1, -(1 << 63), 1 << 64, -(1 << 90), True, False]
    for _ in range(300):
        ids = [rng.choice(odd) if rng.random() < 0.2 else rng.randrange(-(1 << 70), 1 << 70) if rng.random() < 0.1
               else rng.randrange(50_000) for _ in range(rng.randrange(0, 700))]
        block, parent = rng.choice([1, 7, 16, 64]), rng.choice([0, rng.randrange(-(1 << 63), 1 << 63)])
        assert c_keys(ids, block, 128) == py_chain_keys(ids, block) == c_keys(tuple(ids), block, 128)
        assert c_keys(ids, block, 1 << 40, parent) == py_chain_keys(ids, block, parent, 1 << 40)  # keys_after: KV-event filing
    mixed = prompt(9, 3 * BLOCK)
    mixed[70] = "a"
    mixed[150] = (1, 2)
    assert c_keys(mixed, BLOCK, 128) == py_chain_keys(mixed) and chain_keys(prompt(9, 9000)) == py_chain_keys(prompt(9, 9000))
    assert len(c_keys(list(range(10)), 2, 3)) == 3 and c_keys([1, 2], 64, 128) == []
    for bad, error in ((([[1]] * 64, 64, 128), TypeError), ((None, 64, 128), TypeError), (([1], 0, 128), ValueError)):
        with pytest.raises(error):
            c_keys(*bad)


def test_the_keys_implementation_is_the_c_extension_where_a_compiler_is():
    """Which implementation ran is stated here: the project's build compiles _prefix_keys.c
    (pyproject.toml, optional) wherever a C compiler is, and CI's `make setup` installs it."""
    compiler = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
    print(f"chain_keys implementation: {KEYS_IMPL} (C compiler: {compiler})")
    assert KEYS_IMPL == ("c" if compiler else "python") or os.environ.get("DPSERVE_ALLOW_PYTHON_KEYS") == "1"


def test_index_is_bounded_least_recently_used_first():
    index = PrefixIndex(1, max_entries=8)
    old, new = chain_keys(prompt(4, 4 * BLOCK)), chain_keys(prompt(5, 8 * BLOCK))
    index.add(old, 0)
    index.add(new, 0)
    assert len(index.entries) == 8 and index.match(old) == {} and index.match(new) == {0: 8}
    index.add(old[:2], 0)  # the LRU drops new's tail, never its root: what is left is a prefix
    assert index.match(new) == {0: 6} and cheapest_holder(index.entries, new, 0, [0], index.generation, 64.0) == (0, 6)


# ---------------------------------------------------------------- the router


def test_a_conversation_returns_to_its_rank():
    router = live_router(4)
    system = prompt(6, 16 * BLOCK)
    ranks = {}
    for conv in range(24):  # conversations with one system prompt: spread by load while in flight
        turn1 = system + prompt(100 + conv, 2 * BLOCK)
        ranks[conv] = route(router, turn1, finish=False)
    # a hot shared prefix does not pile onto one rank: its only holder takes requests until it is
    # CACHE_WEIGHT x 1,024 tokens busier than an idle rank; then each new holder divides its credit
    per_rank = [list(ranks.values()).count(r) for r in range(4)]
    assert min(per_rank) >= 2 and max(per_rank) <= 9, per_rank
    for conv in range(24):
        router.on_finish(ranks[conv], len(system) + 2 * BLOCK + 16)
    for conv in range(24):  # turn 2 extends turn 1: back to turn 1's rank
        router.update_table(LoadTable(2 + conv, 4, [RankLoad(r, f"i{r}", True) for r in range(4)]))  # idle again
        turn2 = system + prompt(100 + conv, 2 * BLOCK) + prompt(200 + conv, 3 * BLOCK)
        assert route(router, turn2) == ranks[conv]


def test_a_much_busier_rank_loses_its_affinity():
    router = live_router(2)
    conv = prompt(7, 10 * BLOCK)
    first = route(router, conv)
    other = 1 - first
    # its cache saves 640 prefill tokens, worth CACHE_WEIGHT x 640 = 5,120 load tokens (it alone holds
    # them); 6,000 tokens of queued work outweigh that
    assert CACHE_WEIGHT * 640 < 6_000
    router.update_table(LoadTable(2, 2, [RankLoad(first, f"i{first}", True, num_waiting_prefill_tokens=6_000)]))
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


def test_an_api_server_the_coordinator_counts_alone_shares_nothing_until_another_registers():
    a = live_router(2)
    shared: list[tuple[int, list[int]]] = []
    a.on_routed = lambda rank, keys: shared.append((rank, keys))
    a.update_table(LoadTable(2, 2, [], num_api_servers=1))
    route(a, prompt(12, 4 * BLOCK))
    assert shared == []  # no one to tell
    # a delta (the reader makes it a table that does not say) keeps what the last table said
    a.update_table(LoadTable(3, 2, [RankLoad(0, "i0", True, num_waiting_prefill_tokens=10)]))
    route(a, prompt(13, 4 * BLOCK))
    assert shared == [] and a.prefix.match(chain_keys(prompt(13, 4 * BLOCK)))  # still filed for itself
    a.update_table(LoadTable(4, 2, [], num_api_servers=2))
    rank = route(a, conv := prompt(14, 4 * BLOCK))
    assert shared == [(rank, chain_keys(conv))]


def test_without_cache_aware_nothing_is_hashed_or_shared():
    router = Router(2, "tokens")
    assert router.prefix is None
    router.update_table(LoadTable(1, 2, [RankLoad(r, f"i{r}", True) for r in range(2)]))
    for r in range(2):
        router.engine_hello(r, f"i{r}")
    router.pick(None, prompt(11, 4 * BLOCK))
    assert router._pending_keys is None
