"""One message per node (issue 30): a node relay's NodeLoad through the coordinator's
RankTable to an API server's Router, with a fake clock. A rank's change reaches
routing, a silent rank and a silent node leave it, a restarted node registers again."""

from __future__ import annotations

from dpserve.daemons.api.router import Router
from dpserve.daemons.coordinator.delta import expand, runs_of
from dpserve.daemons.coordinator.registry import RankTable
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import (
    PROTOCOL_VERSION,
    CoordinatorInput,
    EngineReady,
    EngineRegister,
    LoadDelta,
    LoadReport,
    LoadTable,
    NodeLoad,
    TableChannel,
)
from dpserve.engine.rank.node_relay import NodeAggregator, unpack_rows, unpack_u32

WIRE, TABLE = Codec(CoordinatorInput), Codec(TableChannel)
INTERVAL, STALE = 0.1, 1.5
NODES, PER_NODE = 4, 8  # nodes 0, 8, 16, 24


def report(rank: int, inc: str = "a", running: int = 0, kv: float = 0.0) -> LoadReport:
    return LoadReport(rank, inc, running, 0, 0, 0, running / 64, 0.0, kv_usage=kv)


class Cluster:
    """A coordinator's table, one relay per node, one API server's router; messages go
    through their codecs as on the wire."""

    def __init__(self) -> None:
        self.table = RankTable(NODES * PER_NODE, "fp", STALE)
        self.router = Router(NODES * PER_NODE, "tokens")
        self.relays = {n: NodeAggregator(n, INTERVAL, silence_s=2.5 * INTERVAL) for n in range(0, NODES * PER_NODE, PER_NODE)}
        self.now = 0.0
        self.published: list = []
        for rank in range(NODES * PER_NODE):
            self.start(rank, "a")
        self.publish(full=True)

    def start(self, rank: int, inc: str) -> None:
        node = rank - rank % PER_NODE
        assert self.table.register(EngineRegister(rank, inc, "fp", 1, "h", node, PROTOCOL_VERSION), self.now) == ""
        assert self.table.ready(EngineReady(rank, inc), self.now)
        self.router.engine_hello(rank, inc)
        self.relays[node].note(report(rank, inc), self.now)

    def publish(self, full: bool = False) -> list:
        msgs = [TABLE.decode(TABLE.encode(m)) for m in self.table.tables(full)]
        for m in msgs:
            if type(m) is LoadDelta:
                m = LoadTable(m.seq, m.data_parallel_size, expand(m, self.router.loads))
            self.router.update_table(m)
        return msgs

    def tick(self, silent: tuple[int, ...] = (), quiet_ranks: tuple[int, ...] = ()) -> list:
        """One report interval: every rank not in `quiet_ranks` repeats its report to its
        relay, every relay not in `silent` flushes; then the expiry scan and a publish."""
        self.now += INTERVAL
        unknown = []
        for node, relay in self.relays.items():
            for rank in range(node, node + PER_NODE):
                if rank not in quiet_ranks and rank in relay.latest:
                    relay.note(self.last_report(relay, rank), self.now)
            msg = relay.flush(self.now)
            if msg is not None and node not in silent:
                unknown += self.table.node_load(WIRE.decode(WIRE.encode(msg)), self.now)
        self.table.expire(self.now)
        self.published = self.publish()
        return unknown

    @staticmethod
    def last_report(relay: NodeAggregator, rank: int) -> LoadReport:
        row = relay.latest[rank]  # (rank, incarnation, running, ..., kv permille at 9, ...)
        return report(rank, row[1], row[2], kv=row[9] / 1000)

    def routable(self) -> set[int]:
        return {r for r in range(NODES * PER_NODE) if self.router.routable(r)}


def test_a_relay_sends_one_message_an_interval_with_only_the_changes():
    relay = NodeAggregator(8, INTERVAL, silence_s=0.25, flush_s=0.02)
    for rank in range(8, 16):
        relay.note(report(rank), 0.0)
    first = relay.flush(0.0)
    assert unpack_u32(first.alive) == list(range(8, 16)) and [row[0] for row in unpack_rows(first.loads)] == list(range(8, 16))
    relay.note(report(9, running=3), 0.001)
    assert relay.flush(0.005) is None  # within the flush interval: held back
    change = relay.flush(0.021)
    assert change.alive == b"" and [row[:3] for row in unpack_rows(change.loads)] == [(9, "a", 3)]
    for rank in range(8, 16):
        relay.note(report(rank, running=3 if rank == 9 else 0), 0.05)
    beat = relay.flush(0.1)
    assert unpack_u32(beat.alive) == list(range(8, 16)) and beat.loads == b""  # a heartbeat: nothing changed
    assert relay.flush(0.15) is None


def test_a_ranks_change_reaches_routing_within_the_interval():
    c = Cluster()
    assert c.routable() == set(range(32))
    c.relays[16].note(report(17, running=40, kv=0.5), c.now + 0.01)
    c.tick()
    deltas = [m for m in c.published if type(m) is LoadDelta]
    assert [m.runs for m in deltas] == [[(17, 1)]]  # only the change travels, as a compact row
    assert c.router.loads[17].num_running == 40 and c.router.loads[17].kv_usage == 0.5
    assert c.router.loads[17].incarnation == "a" and c.router.loads[17].is_alive  # membership kept
    assert c.routable() == set(range(32))
    assert c.table.snapshot().ranks[17].num_running == 40  # the coordinator's own view too


def test_a_rank_missing_from_its_nodes_heartbeat_goes_stale_and_a_silent_node_takes_its_ranks():
    c = Cluster()
    for _ in range(int(STALE / INTERVAL) + 2):
        c.tick(quiet_ranks=(3,), silent=(24,))
    assert c.routable() == set(range(32)) - {3} - set(range(24, 32))
    assert "no load report" in c.router.loads[3].down_reason
    assert c.table.ranks[30].down_reason.startswith("no load report")


def test_a_restarted_node_registers_again_and_its_old_rows_do_not_count():
    c = Cluster()
    for _ in range(int(STALE / INTERVAL) + 2):
        c.tick(silent=(8,))
    assert not c.routable() & set(range(8, 16))
    # the node comes back with new incarnations: its ranks are unknown until they register
    c.relays[8] = NodeAggregator(8, INTERVAL, silence_s=2.5 * INTERVAL)
    for rank in range(8, 16):
        c.relays[8].note(report(rank, "b"), c.now)
    unknown = c.tick()
    assert sorted(row[0] for row in unknown) == list(range(8, 16))  # the coordinator asks them to register
    for rank in range(8, 16):
        c.start(rank, "b")
    c.tick()
    assert c.routable() == set(range(32))
    assert all(c.router.loads[r].incarnation == "b" for r in range(8, 16))


def test_delta_rows_name_their_ranks_in_runs_and_skip_ranks_not_held():
    assert runs_of([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 1), (7, 2)]
    delta = LoadDelta(3, 4, [(1, 2)], [1] * 11 + [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    held = [None, None, Cluster().router.loads[2], None]
    assert delta.ranks == [1, 2]
    [entry] = expand(delta, held)  # rank 1 is not held yet: its LoadTable comes with the resync
    assert entry.rank == 2 and entry.num_running == 2 and entry.slot_usage == 0.006 and entry.num_prefix_hits == 12


def test_a_node_speaks_only_for_its_own_ranks_and_a_malformed_message_is_skipped():
    c = Cluster()
    c.tick()
    # a message whose packed rows are cut short changes nothing
    ok = NodeAggregator(0, INTERVAL, silence_s=60.0)
    ok.note(report(1, running=9), c.now)
    good = ok.flush(c.now)
    assert c.table.node_load(NodeLoad(0, 9, good.alive, good.loads[:-1], good.heard_ms_ago), c.now) == []
    assert c.table.snapshot().ranks[1].num_running == 0
    c.table.node_load(good, c.now)
    assert c.table.snapshot().ranks[1].num_running == 9
    # node 8's relay claims rank 17 (node 16's), with its right incarnation: neither its load nor its beat counts
    spoof = NodeAggregator(8, INTERVAL, silence_s=60.0)
    spoof.note(report(17, running=50), c.now)
    msg = spoof.flush(c.now)
    assert c.table.node_load(WIRE.decode(WIRE.encode(msg)), c.now) == []  # dropped, not asked to register
    c.publish()
    assert c.router.loads[17].num_running == 0
    for _ in range(int(STALE / INTERVAL) + 2):  # rank 17's own node is silent: the spoofed beats do not keep it
        c.now += INTERVAL
        spoof.note(report(17, running=50), c.now)
        c.table.node_load(spoof.flush(c.now) or msg, c.now)
        c.table.expire(c.now)
    assert not c.table.ranks[17].is_alive
