"""Rank selection and the coordinator's rank table: pure state, no sockets."""

from __future__ import annotations

import pytest
from dpserve.daemons.api.openai_types import ApiError
from dpserve.daemons.api.router import NoRankAvailable, QueueFull, RankNotEligible, Router
from dpserve.daemons.api.serving import parse_rank_header, routing_error
from dpserve.daemons.coordinator.registry import RankTable
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import PROTOCOL_VERSION, EngineReady, EngineRegister, LoadReport, LoadTable, RankLoad

TABLE_CODEC = Codec(LoadTable)


def table(seq: int, *loads: RankLoad) -> LoadTable:
    return LoadTable(seq, 4, list(loads))


def live_router(n: int = 4, policy: str = "queue", **kw) -> Router:
    router = Router(n, policy, **kw)
    router.update_table(table(1, *(RankLoad(r, f"i{r}", True) for r in range(n))))
    for r in range(n):
        router.engine_hello(r, f"i{r}")
    return router


def test_queue_policy_picks_lowest_four_waiting_plus_running():
    router = live_router()
    router.update_table(table(2, RankLoad(0, "i0", True, 3, 0), RankLoad(1, "i1", True, 0, 1), RankLoad(2, "i2", True, 5, 0), RankLoad(3, "i3", True, 2, 1)))
    # scores: 3, 4, 5, 6
    assert router.pick() == 0


def test_own_unreported_sends_spread_a_burst():
    router = live_router()
    picks = []
    for _ in range(8):
        rank = router.pick()
        router.on_send(rank, 10)
        picks.append(rank)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_new_table_resets_unreported_counts_but_not_inflight():
    router = live_router(2)
    router.on_send(0, 5)
    router.update_table(table(2, RankLoad(0, "i0", True), RankLoad(1, "i1", True)))
    assert router.sent == [0, 0] and router.inflight == [1, 0]
    assert router.pick() == 1  # rank 0 still holds our in-flight request


def test_tokens_policy_sees_prompt_length_skew():
    router = live_router(2, "tokens")
    # rank 0: one 10,000-token prompt waiting; rank 1: two 1,000-token prompts waiting
    router.update_table(table(2, RankLoad(0, "i0", True, 0, 1, 10_000, 0), RankLoad(1, "i1", True, 0, 2, 2_000, 0)))
    assert router.pick() == 1
    queue = live_router(2, "queue")
    queue.update_table(table(2, RankLoad(0, "i0", True, 0, 1, 10_000, 0), RankLoad(1, "i1", True, 0, 2, 2_000, 0)))
    assert queue.pick() == 0  # queue counts requests, not work


def test_rank_is_routable_only_when_alive_and_greeted_by_same_incarnation():
    router = Router(2)
    router.update_table(table(1, RankLoad(0, "a", True), RankLoad(1, "b", True)))
    assert router.routable_ranks == []
    router.engine_hello(0, "a")
    router.engine_hello(1, "old")
    assert router.routable_ranks == [0]
    lost = router.update_table(table(2, RankLoad(0, "a", False, down_reason="gone"), RankLoad(1, "b", True)))
    assert lost == [(0, "gone")]
    with pytest.raises(NoRankAvailable):
        router.pick()


def test_restarted_incarnation_fails_old_requests():
    router = live_router(2)
    lost = router.update_table(table(2, RankLoad(0, "new", True), RankLoad(1, "i1", True)))
    assert lost == [(0, "rank restarted")]


def test_admission_control_gives_429_when_every_rank_is_full():
    router = live_router(2, max_waiting_per_rank=2)
    router.update_table(table(2, RankLoad(0, "i0", True, 0, 2), RankLoad(1, "i1", True, 0, 5)))
    with pytest.raises(QueueFull):
        router.pick()


def test_eligible_ranks_and_pins():
    router = live_router(4, eligible=[2, 3])
    assert {router.pick() for _ in range(4)} <= {2, 3}
    with pytest.raises(RankNotEligible) as err:
        router.check_pin(0)
    assert err.value.eligible == [2, 3]
    router.check_pin(3)
    with pytest.raises(NoRankAvailable) as pin:
        Router(4).pick(1)  # pinned to a rank no table has named yet
    assert pin.value.rank == 1


# The API server's face of each routing failure: statuses, bodies and Retry-After
# exactly as clients saw them when the router raised HTTP errors itself.
@pytest.mark.parametrize(
    "exc, status, kind, code, message, retry",
    [
        (NoRankAvailable(), 503, "service_unavailable", "no_rank_available", "No engine rank is serving right now.", "2"),
        (NoRankAvailable(3), 503, "service_unavailable", "rank_unavailable", "Rank 3 is not serving right now.", "1"),
        (NoRankAvailable(unreachable=True), 503, "service_unavailable", "rank_unavailable", "No engine rank is reachable right now.", "1"),
        (QueueFull(4), 429, "rate_limit_error", "overloaded", "Every rank is at its waiting-queue limit; retry shortly.", "1"),
        (RankNotEligible(0, [2, 3]), 400, "invalid_request_error", "invalid_rank",
         "X-data-parallel-rank 0 is not served through this API server; it routes to rank(s) 2, 3.", None),
    ],
)
def test_routing_errors_map_to_openai_errors(exc, status, kind, code, message, retry):
    err = routing_error(exc)
    assert isinstance(err, ApiError)
    assert (err.status, err.type, err.code, err.message) == (status, kind, code, message)
    assert (err.headers or {}).get("Retry-After") == retry


@pytest.mark.parametrize("value, expected", [(None, None), ("0", 0), ("3", 3), ("03", 3)])
def test_rank_header_valid(value, expected):
    assert parse_rank_header(value, 4) == expected


# ASCII digits only: int() alone would take the signs, spaces, underscores and
# non-ASCII digits here; a long run of digits must not reach int() either.
@pytest.mark.parametrize("value", ["x", "1.0", "", "4", "-1", "+1", " 1 ", "0_1", "\uff11", "\u0661", "1" * 5000])
def test_rank_header_invalid(value):
    with pytest.raises(ApiError) as err:
        parse_rank_header(value, 4)
    assert err.value.status == 400


def register(rank: int, inc: str, fp: str = "fp", version: int = PROTOCOL_VERSION) -> EngineRegister:
    return EngineRegister(rank, inc, fp, 1, "host", 0, version)


def test_rank_table_registration_rules():
    t = RankTable(2, "fp", stale_after_s=5)
    assert "fingerprint" in t.register(register(0, "a", fp="other"), 0)
    assert "protocol version" in t.register(register(0, "a", version=PROTOCOL_VERSION + 1), 0)
    assert "outside" in t.register(register(2, "a"), 0)
    assert t.register(register(0, "a"), 0) == ""
    assert t.ready(EngineReady(0, "a"), 0)
    # a second live engine claiming rank 0 is refused ...
    assert "already served" in t.register(register(0, "b"), 1)
    # ... unless the holder went quiet
    assert t.register(register(0, "b"), 10) == ""


def test_rank_table_expiry_and_reregistration():
    t = RankTable(1, "fp", stale_after_s=1)
    t.register(register(0, "a"), 0)
    t.ready(EngineReady(0, "a"), 0)
    assert t.expire(0.5) == []
    assert t.expire(2.0) == [0]
    snap = t.snapshot()
    assert snap.ranks[0].is_alive is False and "no load report" in snap.ranks[0].down_reason
    # a lost engine's reports are not taken back silently: it must register again
    assert not t.load(LoadReport(0, "a", 0, 0, 0, 0, 0.0, 0.0), 2.1)
    assert t.register(register(0, "a"), 2.2) == ""
    assert t.ready(EngineReady(0, "a"), 2.2)
    assert t.snapshot().ranks[0].is_alive


def test_tokens_policy_counts_own_inflight_work_the_table_has_not_seen():
    # a long prompt admitted at once never shows up as waiting; our in-flight count does
    router = live_router(2, "tokens")
    router.on_send(0, 1800)
    router.update_table(table(2, RankLoad(0, "i0", True, 1, 0, 0, 0), RankLoad(1, "i1", True, 1, 0, 0, 40)))
    assert router.pick() == 1


def test_tokens_policy_forgets_a_prefill_once_it_is_done():
    router = live_router(2, "tokens")
    router.on_send(0, 1800 + 16)  # a long prompt, 16 answer tokens allowed
    router.on_send(1, 20 + 16)
    router.on_send(1, 20 + 16)
    router.update_table(table(2, RankLoad(0, "i0", True, 1, 0, 0, 16), RankLoad(1, "i1", True, 2, 0, 0, 32)))
    assert router.pick() == 1  # rank 0 is still prefilling 1,800 tokens
    router.on_progress(0, 1800 + 1)  # its first token came back: only 15 answer tokens remain
    router.on_progress(1, 20 + 1)
    router.on_progress(1, 20 + 1)
    assert router.inflight_tokens == [15, 30]
    assert router.pick() == 0
    router.on_finish(0, 15)
    assert router.inflight_tokens[0] == 0 and router.inflight[0] == 0


def test_rank_table_publishes_only_what_changed():
    t = RankTable(600, "fp", stale_after_s=5)
    for r in range(600):
        t.register(register(r, "a"), 0)
        t.ready(EngineReady(r, "a"), 0)
    full = t.tables(full=True)
    assert [len(m.ranks) for m in full] == [256, 256, 88]  # bounded messages
    assert [m.seq for m in full] == [1, 2, 3]
    assert t.tables(full=False) == []
    # a report that repeats the load is a heartbeat: nothing to publish
    assert t.load(LoadReport(7, "a", 0, 0, 0, 0, 0.0, 0.0), 1)
    assert not t.dirty and t.tables(full=False) == []
    assert t.load(LoadReport(7, "a", 2, 1, 30, 8, 0.1, 1.0), 1)
    t.down(9, "gone")
    delta = t.tables(full=False)  # a membership change as a table entry, a load change as a compact row
    assert [type(m).__name__ for m in delta] == ["LoadTable", "LoadDelta"]
    assert [e.rank for e in delta[0].ranks] == [9] and not delta[0].ranks[0].is_alive
    assert delta[1].runs == [(7, 1)] and len(delta[1].loads) == 11 and delta[1].loads[2] == 30  # one flat row


def wire(table: LoadTable) -> LoadTable:
    """What an API server holds: a decoded copy, not the coordinator's own objects."""
    return TABLE_CODEC.decode(TABLE_CODEC.encode(table))


def test_router_applies_deltas_and_resyncs():
    t = RankTable(3, "fp", stale_after_s=5)
    router = Router(3, "tokens")
    for r in range(3):
        t.register(register(r, "a"), 0)
        t.ready(EngineReady(r, "a"), 0)
        router.engine_hello(r, "a")
    for m in t.tables(full=True):
        router.update_table(wire(m))
    t.load(LoadReport(0, "a", 1, 1, 500, 0, 0.0, 0.0), 1)
    t.load(LoadReport(1, "a", 1, 1, 400, 0, 0.0, 0.0), 1)
    t.tables(full=False)  # this delta is lost on the way ...
    assert router.pick() == 0  # ... so the router still sees the old, equal loads
    for m in t.tables(full=True):  # ... until the next resync
        router.update_table(wire(m))
    assert [router.pick() for _ in range(3)] == [2, 2, 2]
    lost = [router.update_table(wire(m)) for m in (t.down(2, "gone") and t.tables(full=False))]
    assert lost == [[(2, "gone")]] and router.pick() == 1


def test_publish_interval_grows_with_the_cluster_within_bounds():
    from dpserve.daemons.coordinator.registry import publish_interval

    assert publish_interval(8) == 0.002  # small deployments: as before
    assert publish_interval(256) == pytest.approx(0.00512)
    assert publish_interval(1024) == pytest.approx(0.02048)
    assert publish_interval(100_000) == 0.1


@pytest.mark.parametrize(
    ("mode", "api_nodes", "words"),
    [
        ("internal", [0], "head"),  # API servers on the head only
        ("global", [0, 2], "all nodes"),
        ("hybrid", [0, 2], "node 2"),
        ("external", [0, 2], "node 2 api-1"),
    ],
)
def test_the_coordinator_and_status_apply_one_routing_rule(mode, api_nodes, words):
    """A rank on node 2 (ranks 2 and 3): the engine connects to the API servers
    the coordinator lists, and /status `routed_by` names those same servers."""
    from types import SimpleNamespace

    from dpserve.daemons.coordinator.routing import routed_by
    from dpserve.daemons.coordinator.server import Coordinator

    coord = SimpleNamespace(cfg=SimpleNamespace(lb_mode=mode), api_servers={(n, i): f"tcp://n{n}:{i}" for n in api_nodes for i in (0, 1)})
    listed = Coordinator._addresses_for(coord, 2)
    assert routed_by(mode, 3, 2) == words
    if words in ("head", "all nodes"):
        assert listed == [f"tcp://n{n}:{i}" for n in api_nodes for i in (0, 1)]  # every API server
    else:
        assert listed == ["tcp://n2:0", "tcp://n2:1"]  # its own node's only
    assert routed_by(mode, 3, -1) == ("-" if mode in ("hybrid", "external") else words)  # node not known yet


# ------------------------------------------------------------------ which connection speaks for a rank


def test_peer_names_in_logs_are_printable():
    from dpserve.engine.common.sockets import peer_name

    assert peer_name(b"0:1a2b") == "0:1a2b"
    assert peer_name(b"engine-3-abc") == "engine-3-abc"
    assert peer_name(b"\x00k\xff") == "0x006bff"
    assert peer_name(b"a b") == "0x612062"  # a space could pose as two log fields
    assert peer_name(b"") == "0x"
    assert peer_name(b"\x01" * 100) == "0x" + "01" * 64 + "..."


def _peers():
    from dpserve.daemons.api.engine_peers import EnginePeers

    class Log:
        def __getattr__(self, level):
            return lambda *a, **kw: None

    router = Router(2, "queue")
    router.update_table(table(1, RankLoad(0, "incA", True), RankLoad(1, "incB", True)))
    return router, EnginePeers(router, Log())


def test_a_hello_counts_only_from_the_rank_s_own_connection():
    from dpserve.engine.common.protocol import EngineHello

    router, peers = _peers()
    assert peers.speaks_for(b"0:incA", 0, "incA") and peers.speaks_for(b"0:incA:3", 0, "incA")
    assert not any(peers.speaks_for(p, 0, "incA") for p in (b"0", b"0:incA:", b"0:incA:x", b"0:incAB", b"1:incA"))
    for peer in (b"0", b"1:incB", b"0:rogue"):
        assert not peers.hello((peer,), EngineHello(0, "incA"))
    assert not peers.hello((b"5:x",), EngineHello(5, "x"))  # out of range: a stray, not an IndexError
    assert peers.num_stray == 4
    assert peers.hello((b"0:incA",), EngineHello(0, "incA"))
    peers.bind(0, (b"0:incA",))
    router.engine_hello(0, "incA")
    # a second connection of the same form cannot take a routable rank; nor can its death notice
    assert not peers.hello((b"0:incA:1",), EngineHello(0, "incA"))
    assert not peers.death_notice((b"0:incA:1",), 0, "incA") and peers.death_notice((b"0:incA",), 0, "incA")
    assert not peers.death_notice((b"9:x",), 9, "x")
    # nor through a node's hop (another route to the same identity)
    assert not peers.death_notice((b"node-0-b-0", b"0:incA"), 0, "incA")
    # a hello before the table names its incarnation is kept, and taken when it does
    assert not peers.hello((b"1:incC",), EngineHello(1, "incC"))
    assert peers.take_heard(table(2, RankLoad(1, "incC", True))) == [(1, "incC", (b"1:incC",))]


def test_a_node_hop_speaks_only_for_its_own_node_s_ranks():
    """--rank-links node: a rank's route is (its node's hop, its identity); a hop whose
    identity names another node than the table's for the rank is a stray."""
    from dpserve.daemons.api.engine_peers import route_name
    from dpserve.engine.common.protocol import EngineHello

    router, peers = _peers()
    router.update_table(table(2, RankLoad(0, "incA", True, node_rank=0), RankLoad(1, "incB", True, node_rank=1)))
    assert peers.hello((b"node-0-ab12cd34-0", b"0:incA"), EngineHello(0, "incA"))
    peers.bind(0, (b"node-0-ab12cd34-0", b"0:incA"))
    assert peers.outputs_from((b"node-0-ab12cd34-0", b"0:incA"), 0)
    assert not peers.hello((b"node-0-ab12cd34-0", b"1:incB"), EngineHello(1, "incB"))  # node 0's hop, node 1's rank
    for hop in (b"node-x-1-0", b"nod-1-a-0", b"1:incB"):
        assert not peers.hello((hop, b"1:incB"), EngineHello(1, "incB"))
    assert not peers.hello((b"node-1-a-0", b"x", b"1:incB"), EngineHello(1, "incB"))  # three frames: no route of ours
    assert peers.hello((b"node-1-ab12cd34-0", b"1:incB"), EngineHello(1, "incB"))
    assert peers.num_stray == 5
    assert route_name((b"node-1-a-0", b"1:incB")) == "node-1-a-0/1:incB"
    # the same rank directly and through its hop are two routes: the second cannot take it while the first routes
    router.engine_hello(0, "incA")
    assert not peers.hello((b"0:incA",), EngineHello(0, "incA")) and 0 in peers.contested


def test_an_unroutable_rank_is_pleaded_for_with_backoff_and_at_once_after_a_failed_send():
    router, peers = _peers()
    pleas = []
    peers.greet_again = lambda rank, why: pleas.append((rank, why))
    router.engine_hello(1, "incB")  # rank 1 is routable here; rank 0 never greeted
    peers.heal(100.0)
    assert pleas == [] and [r["rank"] for r in peers.unroutable_ranks(100.0)] == [0]
    for now in (100.5, 101.0, 102.0, 103.0, 107.0):
        peers.heal(now)
    assert [p[0] for p in pleas] == [0, 0, 0]  # at 101, 103, 107: 1, 2, 4 s apart
    assert "no hello from incarnation incA" in pleas[0][1]
    peers.bind(1, (b"1:incB",))
    peers.lost(1, "a send failed: Host unreachable")
    router.engine_dead(1, "incB")
    peers.heal(107.1, at_once=(1,))
    assert pleas[-1] == (1, "a send failed: Host unreachable") and peers.identities[1] is None
    router.engine_hello(0, "incA")
    router.engine_hello(1, "incB")
    assert peers.unroutable_ranks(108.0) == []
