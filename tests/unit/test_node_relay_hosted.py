"""Real ranks report through their node's relay (issue 30, second round): the
supervisor hosts the load relay on a thread, ranks' configs point their reports at
it, and the coordinator judges a rank's staleness on the rank's own clock (the
relay says how long ago it heard each rank), so a hung rank behind a relay that
still beats goes stale as fast as one reporting directly. `serve` starts the table
relay where the node has enough API servers for it to pay."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq
from dpserve.daemons.addresses import Addresses
from dpserve.daemons.config import ApiServerConfig, ServeConfig
from dpserve.daemons.coordinator.registry import RankTable
from dpserve.daemons.supervisor.plan import plan_children
from dpserve.daemons.supervisor.relays import TABLE_RELAY_MIN_SUBSCRIBERS, LoadRelay, TableRelay, load_beat_s
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.config import EngineProcessConfig
from dpserve.engine.common.logs import setup_logging
from dpserve.engine.common.protocol import PROTOCOL_VERSION, CoordinatorInput, EngineReady, EngineRegister, LoadReport, NodeLoad
from dpserve.engine.rank.node_relay import RelayLink, pack_u32, unpack_rows, unpack_u32

WIRE = Codec(CoordinatorInput)


def report(rank: int, running: int = 0, inc: str = "a") -> LoadReport:
    return LoadReport(rank, inc, running, 0, 0, 0, running / 64, 0.0)


def test_a_hung_rank_behind_a_beating_relay_goes_stale_on_its_own_clock():
    """The relay keeps listing rank 1 (its silence limit is long) and even resends its
    row; the coordinator still drops it within its silence limit of the rank's last
    report, and keeps rank 0, which reports, alive."""
    from dpserve.engine.rank.node_relay import NodeAggregator

    table = RankTable(2, "fp", stale_after_s=1.0)
    for rank in (0, 1):
        assert table.register(EngineRegister(rank, "a", "fp", 1, "h", 0, PROTOCOL_VERSION), 0.0) == ""
        assert table.ready(EngineReady(rank, "a"), 0.0)
    relay = NodeAggregator(0, 0.1, silence_s=60.0)
    now, dropped_at = 0.0, None
    while now < 3.0 and dropped_at is None:
        now = round(now + 0.1, 3)
        relay.note(report(0, running=int(now * 10) % 3), now)
        if now <= 0.5:
            relay.note(report(1), now)  # rank 1's last report: 0.5 s
        msg = relay.flush(now)
        if msg is not None:
            assert table.node_load(WIRE.decode(WIRE.encode(msg)), now) == []
        if table.expire(now):
            dropped_at = now
    assert not table.ranks[1].is_alive and table.ranks[0].is_alive
    assert dropped_at - 0.5 <= table.silence_limit_s + 0.1 + 1e-9, dropped_at  # + one scan


def test_the_relay_never_moves_a_ranks_last_report_back():
    table = RankTable(1, "fp", stale_after_s=1.0)
    table.register(EngineRegister(0, "b", "fp", 1, "h", 0, PROTOCOL_VERSION), 5.0)  # a new incarnation, just now
    table.node_load(NodeLoad(0, 1, pack_u32([0]), b"", pack_u32([900])), 5.0)  # the relay last heard the old one 0.9 s ago
    assert table.last_seen[0] == 5.0


@pytest.fixture
def log():
    return setup_logging("test-relay")


def test_the_hosted_load_relay_sends_its_ranks_reports_as_one_node_load(tmp_path, log):
    ctx = zmq.Context()
    head = ctx.socket(zmq.ROUTER)
    head.bind(f"ipc://{tmp_path}/coord")
    relay = LoadRelay(8, f"ipc://{tmp_path}/loads", f"ipc://{tmp_path}/coord", None, beat_s=0.2, stale_after_s=1.0, log=log)
    relay.start()
    try:
        links = [RelayLink(ctx, f"ipc://{tmp_path}/loads") for _ in range(2)]
        got: list[NodeLoad] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(unpack_u32(m.alive) == [8, 9] for m in got):
            for i, link in enumerate(links):
                link.send(report(8 + i, running=i + 1))
            if head.poll(100):
                got.append(WIRE.decode(head.recv_multipart()[1]))
        beat = next(m for m in got if unpack_u32(m.alive) == [8, 9])
        ago = unpack_u32(beat.heard_ms_ago)
        assert beat.node_rank == 8 and len(ago) == 2 and max(ago) < 500
        rows = {row[0]: row for m in got for row in unpack_rows(m.loads)}
        assert rows[8][:3] == (8, "a", 1) and rows[9][:3] == (9, "a", 2)  # (rank, incarnation, num_running)
        assert relay.num_sent <= relay.num_reports  # one message for many reports, never more
    finally:
        t0 = time.monotonic()
        relay.stop()
        ctx.destroy(linger=0)
    assert not relay.thread.is_alive() and time.monotonic() - t0 < 1.0


def test_the_hosted_table_relay_forwards_the_heads_table(tmp_path):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/table")
    relay = TableRelay(f"ipc://{tmp_path}/table", f"ipc://{tmp_path}/node.table", None)
    relay.start()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/node.table")
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pub.send(b"table")  # the subscription travels up through the relay first: repeat until heard
            if sub.poll(50):
                break
        assert sub.recv(zmq.NOBLOCK) == b"table"
    finally:
        relay.stop()
        ctx.destroy(linger=0)
    assert not relay.thread.is_alive()


@pytest.mark.parametrize("api_servers", [1, TABLE_RELAY_MIN_SUBSCRIBERS])
def test_serve_points_ranks_at_the_load_relay_and_api_servers_at_the_table_relay_where_it_pays(tmp_path, api_servers):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    node = ServeConfig(model=str(tmp_path), served_model_name="m", data_parallel_size=2, api_server_count=api_servers)
    addr = Addresses.for_node(node, "/run/x", "127.0.0.1")
    with socket.create_server(("127.0.0.1", 0)) as listen:
        children = {c.name: c for c in plan_children(node, addr, [listen], 256, 0.5)}
    engine = msgspec.json.decode(children["engine-dp1"].config_json, type=EngineProcessConfig)
    assert engine.node_relay_address == "ipc:///run/x/node.loads"
    api = msgspec.json.decode(children["api-0"].config_json, type=ApiServerConfig)
    relayed = api_servers + 1 >= TABLE_RELAY_MIN_SUBSCRIBERS  # the supervisor subscribes too
    assert api.table_address == ("ipc:///run/x/node.table" if relayed else "ipc:///run/x/coordinator.table")
    assert load_beat_s(0.5, 15.0) == 0.5 and load_beat_s(1.0, 2.0) == 0.5


def test_under_changing_loads_the_heartbeat_rides_on_the_changes():
    """A change sent past half the beat period beats too: a busy node sends one message
    an interval, not its changes and a heartbeat of its own (issue 30: the coordinator's
    cost is per message). Driven as LoadRelay drives it: at each report and at next_due()."""
    from dpserve.engine.rank.node_relay import NodeAggregator

    relay = NodeAggregator(0, 0.25, silence_s=1.0)
    relay.note(report(0), 0.0)
    assert unpack_u32(relay.flush(0.0).alive) == [0]
    sent, now, change_at = [], 0.0, 0.1
    while now < 3.0:
        now = round(min(change_at, relay.next_due()), 6)
        if now >= change_at:  # every 100 ms a change
            relay.note(report(0, running=round(change_at * 10)), now)
            change_at = round(change_at + 0.1, 6)
        if (msg := relay.flush(now)) is not None:
            sent.append(msg)
    assert len(sent) == 30 and all(m.loads for m in sent)  # one message an interval, each with its change
    beats = [i for i, m in enumerate(sent) if m.alive]
    assert beats and max(b - a for a, b in zip([-1, *beats], beats)) <= 2  # a beat at least every 0.2-0.25 s
