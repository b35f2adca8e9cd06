"""KV events from the native engine's block manager into the API server's exact index (issue 29).

The index is checked against the real BlockManager after random store / evict /
lost-batch / restart sequences: for every prompt, the prefix the index credits a
rank with is exactly the prefix the rank's cache would serve, or nothing while
the rank awaits a snapshot; never more.
"""

from __future__ import annotations

import msgspec
from dpserve.daemons.api.kv_index import KVIndex
from dpserve.daemons.api.prefix_index import chain_keys
from dpserve.engine.kv_cache import BlockManager
from dpserve.engine.kv_events import KeysRemoved, KeysStored, KVEventBatch, KVEventLog, KVSnapshot
from hypothesis import given, settings
from hypothesis import strategies as st

BS = 16
ROUTING = 64
PIECES = [[(7 * p + i) % 97 + 1 for i in range(40)] for p in range(6)]  # prompts are joins of these


class Rank:
    """A rank's real BlockManager with its event log, run the way the scheduler uses it."""

    def __init__(self, rank: int, num_blocks: int, incarnation: str) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.log = KVEventLog(BS)
        self.blocks = BlockManager(num_blocks, BS, enable_caching=True, events=self.log)

    def serve(self, prompt: list[int]) -> None:
        """Admit, compute and register every full block, then finish (release)."""
        b = self.blocks
        hashes: list[bytes] = []
        b.extend_hashes(hashes, prompt, len(prompt))
        hits = b.match(hashes, prompt, (len(prompt) - 1) // BS)
        if b.blocks_for(len(prompt)) - len(hits) > b.num_free_blocks - b.num_evictable(hits):
            return  # would not be admitted
        table: list[int] = []
        b.attach(table, hits)
        b.grow(table, len(prompt))
        for i in range(len(prompt) // BS):
            b.register(table[i], hashes[i], prompt[i * BS : (i + 1) * BS], hashes[i - 1] if i else None)
        b.release(table)

    def depth(self, prompt: list[int]) -> int:
        """Routing blocks of `prompt` this cache would serve."""
        hashes: list[bytes] = []
        self.blocks.extend_hashes(hashes, prompt, len(prompt))
        return len(self.blocks.match(hashes, prompt, len(hashes))) * BS // ROUTING

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(self.rank, self.incarnation, self.log.seq, self.log.snapshot(), self.log.block)


def prompt_of(parts: list[int]) -> list[int]:
    return [t for p in parts for t in PIECES[p]]


def check_shape(index: KVIndex) -> None:
    """A one-holder entry is that rank's shared dict, never written; two or more holders own theirs."""
    assert all(solo == {r: 0} for r, solo in enumerate(index._solo))
    for holders in index.entries.values():
        assert holders
        if len(holders) == 1:
            (r,) = holders
            assert holders is index._solo[r]
        else:
            assert all(holders is not solo for solo in index._solo)


op = st.one_of(
    st.tuples(st.just("serve"), st.integers(0, 1), st.lists(st.integers(0, 5), min_size=1, max_size=6)),
    st.tuples(st.just("lose"), st.integers(0, 1), st.just([])),  # the step's batch never arrives
    st.tuples(st.just("restart"), st.integers(0, 1), st.just([])),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(op, min_size=1, max_size=30), st.integers(6, 24))
def test_index_matches_the_real_cache(ops, num_blocks):
    codec_enc, codec_dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch | KVSnapshot)
    ranks = [Rank(r, num_blocks, f"a{r}") for r in range(2)]
    index = KVIndex(2)
    restarts = 0
    for kind, r, parts in ops:
        rank = ranks[r]
        if kind == "serve":
            rank.serve(prompt_of(parts))
        elif kind == "restart":
            restarts += 1
            rank = ranks[r] = Rank(r, num_blocks, f"b{restarts}")
            rank.serve(prompt_of([r, 5]))
        batch = rank.log.take_batch(rank.rank, rank.incarnation)
        if batch is None or kind == "lose":
            continue
        if index.apply(codec_dec.decode(codec_enc.encode(batch))):  # over the wire, as the channel carries it
            assert not index.is_synced(r)
            index.apply_snapshot(codec_dec.decode(codec_enc.encode(rank.snapshot())))
        check_shape(index)
        for parts_q in ([0], [0, 1], [0, 1, 2], [1, 2, 3, 4], [2, 3], [5, 4, 3, 2, 1, 0], [r, 5]):
            prompt = prompt_of(parts_q)
            found = index.match(chain_keys(prompt, ROUTING))
            for q in range(2):
                want = ranks[q].depth(prompt) if index.is_synced(q) else 0
                if index.ranks[q] is None:
                    want = 0
                assert found.get(q, 0) <= ranks[q].depth(prompt)  # never more than the cache holds
                if index.is_synced(q) and index.ranks[q].seq == ranks[q].log.seq:
                    assert found.get(q, 0) == want


def test_shared_holders_come_and_go_without_writing_a_ranks_shared_dict():
    now = [0.0]
    index = KVIndex(3, pending_ttl_s=10.0, clock=lambda: now[0])
    keys = chain_keys(prompt_of([0, 1, 2, 3]), ROUTING)  # two routing blocks
    for r in range(3):
        index.apply(KVEventBatch(r, "x", 1, [KeysStored(keys[:1], ROUTING)]))
    check_shape(index)
    assert index.entries[keys[0]] == {0: 0, 1: 0, 2: 0}
    index.expect(keys, 1)  # a note of its second block, then its events confirm it
    check_shape(index)
    assert index.entries[keys[1]] is index._solo[1]
    index.apply(KVEventBatch(1, "x", 2, [KeysStored(keys[1:], ROUTING)]))
    index.apply(KVEventBatch(0, "x", 2, [KeysRemoved(keys[:1])]))
    index.apply(KVEventBatch(2, "x", 2, [KeysRemoved(keys[:1])]))
    check_shape(index)
    assert index.entries[keys[0]] is index._solo[1] and index.match(keys) == {1: 2}
    index.expect(keys, 2)  # noted at rank 2 while rank 1 holds both
    now[0] = 11.0
    index.expect([], 0)  # (expiry runs on the next note)
    check_shape(index)
    assert index.match(keys) == {1: 2}
    index.forget_rank(1)
    assert index.entries == {} and index._solo == [{0: 0}, {1: 0}, {2: 0}]


def test_gap_then_resync():
    rank = Rank(0, 64, "x")
    index = KVIndex(1)
    a, b = prompt_of([0, 1]), prompt_of([2, 3])
    rank.serve(a)
    assert not index.apply(rank.log.take_batch(0, "x"))
    rank.serve(b)
    rank.log.take_batch(0, "x")  # lost on the way
    rank.serve(a + b)
    late = rank.log.take_batch(0, "x")
    assert index.apply(late) and not index.is_synced(0)
    assert index.match(chain_keys(a, ROUTING)) == {}  # knows nothing rather than something wrong
    index.apply_snapshot(rank.snapshot())
    assert index.is_synced(0)
    assert index.match(chain_keys(b, ROUTING)) == {0: rank.depth(b)} and rank.depth(b) == 1
    assert index.match(chain_keys(a + b, ROUTING)) == {0: rank.depth(a + b)}
    rank.serve(b + a)
    assert not index.apply(rank.log.take_batch(0, "x"))  # numbered after the snapshot: applied
    assert index.match(chain_keys(b + a, ROUTING)) == {0: 2}


def test_restart_empties_until_snapshot():
    index = KVIndex(1)
    old = Rank(0, 64, "old")
    old.serve(prompt_of([0, 1, 2]))
    index.apply(old.log.take_batch(0, "old"))
    assert index.match(chain_keys(prompt_of([0, 1]), ROUTING)) == {0: 1}
    new = Rank(0, 64, "new")  # restarted with an empty cache; its first batch was missed
    new.serve(prompt_of([3, 4]))
    new.log.take_batch(0, "new")
    new.serve(prompt_of([3, 4, 5, 0]))  # (a batch needs a routing block's change: 128 tokens complete a second)
    assert index.apply(new.log.take_batch(0, "new"))
    assert index.match(chain_keys(prompt_of([0, 1]), ROUTING)) == {}


def test_events_batch_per_step_and_evictions_are_removals():
    rank = Rank(0, 4, "x")  # 4 blocks of 16: one 64-token prompt fills the cache
    first = list(range(1, 65))
    rank.serve(first)
    batch = rank.log.take_batch(0, "x")
    assert batch.seq == 1 and batch.events == [KeysStored(chain_keys(first, ROUTING), ROUTING)]
    rank.serve(list(range(100, 164)))  # evicts the first prompt's blocks, tail first: its one routing block goes
    events = rank.log.take_batch(0, "x").events
    assert events[0] == KeysRemoved(chain_keys(first, ROUTING)) and rank.log.snapshot() == chain_keys(list(range(100, 164)), ROUTING)
    assert rank.log.take_batch(0, "x") is None  # nothing happened: no batch, no number used


def test_the_log_keys_a_branch_from_mid_block_and_drops_what_hangs_under_a_removed_block():
    """Two prompts share 96 tokens (a routing block and a half): the second's keys chain from
    the shared half-block's partial tokens. Removing a shared block drops both prompts'
    later keys; parents' child sets do not grow with churn."""
    log = KVEventLog(BS)
    a, b = list(range(1, 129)), list(range(1, 97)) + list(range(500, 532))  # 128 tokens each
    ha, hb = [("a", i) for i in range(8)], [("a", i) if i < 6 else ("b", i) for i in range(8)]
    for hashes, ids in ((ha, a), (hb, b)):
        for i, h in enumerate(hashes):
            log.stored(h, hashes[i - 1] if i else None, ids[i * BS : (i + 1) * BS])
    ka, kb = chain_keys(a, ROUTING), chain_keys(b, ROUTING)
    assert ka[0] == kb[0] and ka[1] != kb[1] and sorted(log.snapshot()) == sorted({*ka, *kb})
    log.take_batch(0, "x")
    for _ in range(50):  # churn under a long-lived parent
        log.removed(("b", 6))
        log.stored(("b", 6), ("a", 5), b[96:112])
    assert log.children[("a", 5)] == {("a", 6), ("b", 6)}
    log.take_batch(0, "x")
    log.stored(("b", 7), ("b", 6), b[112:128])
    log.removed(("a", 4))  # the second routing block's first engine block: both branches lose it
    events = log.take_batch(0, "x").events
    assert events[0] == KeysStored([kb[1]], ROUTING) and sorted(events[1].keys) == sorted([ka[1], kb[1]])
    assert log.snapshot() == [ka[0]]
    log.stored(("x", 0), ("gone", 1), a[:16])  # its parent is not filed: unreachable, not filed
    log.stored(("y", 0), None, a[:8])  # not a block of this cache's size
    assert log.nodes.keys() == {("a", i) for i in range(4)} and log.take_batch(0, "x") is None


def test_a_sent_prompt_counts_until_its_events_confirm_it_or_its_note_expires():
    now = [0.0]
    index = KVIndex(2, pending_ttl_s=10.0, clock=lambda: now[0])
    a, b = prompt_of([0, 1]), prompt_of([2, 3])
    index.expect(chain_keys(a, ROUTING), 1)  # sent, not computed yet
    assert index.match(chain_keys(a, ROUTING)) == {1: 1}
    rank = Rank(1, 64, "x")
    rank.serve(a)
    index.apply(rank.log.take_batch(1, "x"))
    assert not index.notes  # confirmed: the events speak for it now
    rank.serve(list(range(500, 500 + 64 * 16)))  # evicts a: the note is gone, so the index forgets it
    index.apply(rank.log.take_batch(1, "x"))
    assert index.match(chain_keys(a, ROUTING)) == {}
    index.expect(chain_keys(b, ROUTING), 0)  # never computed (the request failed): ends with its note
    assert index.match(chain_keys(b, ROUTING)) == {0: 1}
    now[0] = 11.0
    index.expect([], 0)  # (any later send sweeps expired notes)
    assert index.match(chain_keys(b, ROUTING)) == {} and not index.notes


def test_a_peers_late_note_never_outlives_what_the_events_say():
    """Another API server's note of a send arrives after the rank's events: for a key they
    confirmed already it is not kept (it would never be confirmed, and would hold the key
    past its removal for pending_ttl_s), nor for a key they removed just before; later it is."""
    now = [100.0]
    index = KVIndex(2, pending_ttl_s=30.0, clock=lambda: now[0])
    a = prompt_of([0, 1])
    keys = chain_keys(a, ROUTING)
    rank = Rank(1, 64, "x")
    rank.serve(a)
    index.apply(rank.log.take_batch(1, "x"))
    index.expect(keys, 1, peer=True)  # the peer sent it before the events came: they confirm it
    assert not index.notes
    rank.serve(list(range(500, 500 + 64 * 16)))  # evicted
    index.apply(rank.log.take_batch(1, "x"))
    assert index.match(keys) == {}
    now[0] += 0.5
    index.expect(keys, 1, peer=True)  # a note from before the removal, arriving after it
    assert index.match(keys) == {} and not index.notes
    index.expect(keys, 1)  # this API server's own send is fresh: noted
    assert index.match(keys) == {1: 1}
    index.notes.clear()
    index.entries.clear()
    now[0] += 2.0
    index.expect(keys, 1, peer=True)  # long after the removal: a new send, noted
    assert index.match(keys) == {1: 1}


def test_router_on_events_goes_where_the_prefix_is_and_leaves_when_it_is_evicted():
    from dpserve.daemons.api.router import Router
    from dpserve.engine.common.protocol import LoadTable, RankLoad

    router = Router(3, "cache-aware")
    router.update_table(LoadTable(1, 3, [RankLoad(r, f"i{r}", True, num_waiting_prefill_tokens=100 * r) for r in range(3)]))
    for r in range(3):
        router.engine_hello(r, f"i{r}")
    rank = Rank(2, 64, "i2")  # the busiest rank holds the prompt's first 320 tokens (5 routing blocks)
    prompt = prompt_of([0, 1, 2, 3, 4, 5, 0, 1])
    rank.serve(prompt[:320])
    router.kv.apply(rank.log.take_batch(2, "i2"))
    assert router.pick(None, prompt + [1, 2]) == 2
    router.on_send(2, len(prompt))
    assert router.sent_tokens[2] == len(prompt) - 320  # only what it must prefill counts as its load
    router.on_finish(2, len(prompt))
    rank.serve(list(range(500, 500 + 64 * 16)))  # evicted
    router.kv.apply(rank.log.take_batch(2, "i2"))
    router.kv.forget_rank(2)  # (and the note of our send: a restart forgets it too)
    assert router.pick(None, prompt + [1, 2]) == 0


def test_a_simulated_rank_with_a_prefix_cache_publishes_what_it_holds():
    """`dpserve sim-engine --kv-cache-blocks`: cached blocks are not prefilled again, its events feed
    the index, its snapshot equals what the events built, and finished or aborted requests give
    their blocks back."""
    from dpserve.engine.common.protocol import AddRequest, SamplingParams
    from dpserve.engine.kv_events import KVPublisher
    from dpserve.engine.testing.sim import SimConfig, SimCore
    from dpserve.engine.testing.sim_cache import caching_core

    core = caching_core(SimCore)(SimConfig(ranks=[0], coordinator_address="", fingerprint="", kv_cache_blocks=12,
                                           prefill_tokens_per_s=1600, decode_step_ms=10))  # 16 tokens a step
    prompt = PIECES[0] + PIECES[1]  # 80 tokens: 5 full blocks, one routing block
    index, fresh = KVIndex(1, ROUTING), KVIndex(1, ROUTING)

    def run(rid: str, ids: list[int]) -> int:
        core.add_request(AddRequest(rid, ids, SamplingParams(max_tokens=2), 0.0))
        steps = 0
        while core.has_unfinished():
            core.step()
            steps += 1
            batch = core.kv_events.take_batch(0, "i0")
            if batch is not None:
                index.apply(batch)
        return steps

    assert run("a", prompt) == 6 and index.match(chain_keys(prompt, ROUTING)) == {0: 1}
    assert run("b", prompt) == 2  # 79 of 80 tokens cached: one prefill step, one decode step
    fresh.apply_snapshot(KVSnapshot(0, "i0", core.kv_events.seq, core.kv_events.snapshot(), ROUTING))
    assert fresh.match(chain_keys(prompt, ROUTING)) == {0: 1} and core.cache.num_free + len(core.cache.cached) == 12
    core.add_request(AddRequest("c", PIECES[2] * 4, SamplingParams(max_tokens=2), 0.0))  # 160 tokens: evicts
    core.abort_requests(["c"])
    assert not core.requests and core.cache.num_free + len(core.cache.cached) == 12
    index.apply(core.kv_events.take_batch(0, "i0"))
    assert index.match(chain_keys(prompt, ROUTING)) == {}  # evicted: the index follows

    class IO:  # what KVPublisher uses of RankIO (sim.py calls after_step after every step)
        rank, incarnation, sent = 0, "i0", []

        def send_to(self, index: int, msg: object) -> None:
            self.sent.append((index, type(msg)))

    publisher, io = KVPublisher(0, "i0"), IO()
    publisher.on_request(io, 3, core)  # an API server asks: a snapshot, then every step's batch
    core.add_request(AddRequest("d", prompt, SamplingParams(max_tokens=1), 0.0))
    while core.has_unfinished():
        core.step()
        publisher.after_step(io, core)
    assert io.sent == [(3, KVSnapshot), (3, KVEventBatch)]


def test_a_steps_events_ride_with_its_outputs_and_reach_a_subscriber_without_outputs_alone(tmp_path):
    """On real sockets (RankIO against two API servers' ROUTERs, both subscribed): the API
    server that owns the step's output gets one message, its outputs with the step's batch;
    the other gets the same batch alone. Each index, fed what it received, finds the prompt."""
    import structlog
    import zmq
    from dpserve.engine.common.codec import Codec
    from dpserve.engine.common.protocol import AddRequest, EngineOutputs, EngineToApi, SamplingParams
    from dpserve.engine.rank.io import RankIO
    from dpserve.engine.testing.sim import SimConfig, SimCore
    from dpserve.engine.testing.sim_cache import caching_core

    core = caching_core(SimCore)(SimConfig(ranks=[0], coordinator_address="", fingerprint="", kv_cache_blocks=12,
                                           prefill_tokens_per_s=16000, decode_step_ms=10))
    ctx, codec = zmq.Context(), Codec(EngineToApi)
    try:
        apis, addresses = [], []
        for i in range(2):
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            addresses.append(f"ipc://{tmp_path}/api-{i}.engines")
            sock.bind(addresses[-1])
            apis.append(sock)
        io = RankIO(ctx, None, rank=0, incarnation="i0", fingerprint="f", node_rank=0,
                    coordinator_address=f"ipc://{tmp_path}/coordinator", log=structlog.get_logger(),
                    watch=lambda sock: None, watch_monitors=False)
        io.connect_api_servers(addresses)

        def received(sock) -> list:
            got = []
            while sock.poll(2000 if not got else 300):
                msg = codec.decode(sock.recv_multipart()[-1])
                if type(msg).__name__ != "EngineHello":
                    got.append(msg)
            return got

        indexes = [KVIndex(1, ROUTING), KVIndex(1, ROUTING)]
        for i in range(2):
            io.kv.on_request(io, i, core)
            (snapshot,) = received(apis[i])
            indexes[i].receive(snapshot)
        prompt = PIECES[0] + PIECES[1]  # 80 tokens: one routing block
        core.add_request(AddRequest("a", prompt, SamplingParams(max_tokens=1), 0.0))
        io.owner["a"] = 0
        outputs = core.step()
        assert outputs and outputs[0].finish_reason is not None
        io.send_outputs(outputs, core)
        (mine,), (other,) = received(apis[0]), received(apis[1])
        assert type(mine) is EngineOutputs and [o.request_id for o in mine.outputs] == ["a"]
        assert type(other) is KVEventBatch and mine.kv == other and other.seq == 1
        for index, batch in zip(indexes, (mine.kv, other)):
            assert not index.apply(batch)  # in sequence after the snapshot: no resync asked
            assert index.match(chain_keys(prompt, ROUTING)) == {0: 1}
    finally:
        ctx.destroy(linger=0)
