"""One connection per node per API server (issue 30, `--rank-links node`): a rank asks its
node's relay for the hop to an API server (OpenHop), connects to it node-locally, and
the API server's ROUTER sees the hop's identity and the rank's as a two-frame route;
its replies on that route reach the rank, a message for a rank that is not behind
the hop is dropped there (the hop never fails a send), and every hop ends with the
relay. Real ZeroMQ sockets, the supervisor's real LoadRelay and the rank's real RankIO."""

from __future__ import annotations

import time

import pytest
import zmq
from dpserve.daemons.supervisor.relays import LoadRelay
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.logs import setup_logging
from dpserve.engine.common.protocol import EngineHello, EngineInput, EngineToApi, LoadReport, Ping, Pong
from dpserve.engine.rank.io import RankIO
from dpserve.engine.rank.node_hop import hop_address, hop_identity, is_api_address, node_of
from dpserve.engine.rank.node_relay import RelayLink


def test_names():
    assert hop_address("ipc:///run/dpserve/x/node.loads", "tcp://10.0.0.1:5000").startswith("ipc:///run/dpserve/x/hop-")
    assert hop_address("ipc:///a/node.loads", "tcp://h:1") != hop_address("ipc:///a/node.loads", "tcp://h:2")
    assert node_of(hop_identity(16, "ab12cd34", 3)) == 16
    assert [node_of(f) for f in (b"node-", b"node-x-1", b"1:abc", b"node-1234567890-a")] == [None, None, None, None]
    assert is_api_address("tcp://127.0.0.1:5000") and is_api_address("ipc:///tmp/x")
    assert not any(is_api_address(a) for a in ("inproc://x", "tcp://", "tcp://a\nb", "ipc://" + "x" * 300))


def _recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing arrived"
    return sock.recv_multipart()


def test_a_rank_reaches_an_api_server_through_its_node_s_hop(tmp_path):
    log = setup_logging("test-hop")
    ctx = zmq.Context()
    api_address = f"ipc://{tmp_path}/api-engines"
    api = ctx.socket(zmq.ROUTER)
    api.setsockopt(zmq.ROUTER_MANDATORY, 1)
    api.setsockopt(zmq.LINGER, 0)
    api.bind(api_address)
    relay_address = f"ipc://{tmp_path}/node.loads"
    relay = LoadRelay(4, relay_address, f"ipc://{tmp_path}/coord", None, beat_s=0.2, stale_after_s=1.0, log=log)
    relay.start()
    socks: list[zmq.Socket] = []
    io = RankIO(
        ctx, None, rank=5, incarnation="inc5", fingerprint="fp", node_rank=4, coordinator_address=f"ipc://{tmp_path}/coord",
        log=log, watch=socks.append, watch_monitors=False, monitors=False, hop=RelayLink(ctx, relay_address).hop,
    )
    out, into = Codec(EngineToApi), Codec(EngineInput)
    try:
        io.connect_api_servers([api_address])
        assert io.api_targets == [hop_address(relay_address, api_address)]
        # the hello, queued at once, arrives through the hop: [hop identity, rank identity, body]
        hop, rank_id, body = _recv(api)
        assert node_of(hop) == 4 and rank_id == b"5:inc5" and out.decode(body) == EngineHello(5, "inc5")
        # the API server answers on that route; the rank reads it from its own socket
        api.send_multipart([hop, rank_id, into.encode(Ping(7))], zmq.NOBLOCK)
        assert io.api[0].poll(5000)
        (index, msg), = io.read(io.api[0])
        assert index == 0 and msg == Ping(7)
        io.deliver(index, msg, engine=None)  # a Pong goes back the same way
        assert out.decode(_recv(api)[2]) == Pong(5, 7)
        # a message for a rank not behind the hop is dropped by the hop; the hop lives on
        api.send_multipart([hop, b"6:gone", into.encode(Ping(1))], zmq.NOBLOCK)
        io.send_to(0, EngineHello(5, "inc5"))
        assert _recv(api)[1] == b"5:inc5"
        # a second rank's ask opens no second hop; a hostile address is refused
        link = RelayLink(ctx, relay_address)
        link.hop(api_address)
        link.hop("inproc://nope")
        link.send(LoadReport(6, "inc6", 0, 0, 0, 0, 0.0, 0.0))  # after both asks, in order on one link
        deadline = time.monotonic() + 5
        while relay.num_reports == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.num_reports == 1 and list(relay.hops.hops) == [api_address]
    finally:
        relay.stop()
        assert not relay.thread.is_alive() and not any(t.is_alive() for t in relay.hops.hops.values())
        ctx.destroy(0)


def test_rank_links_auto_takes_the_hops_from_256_ranks_and_the_ranks_are_told(tmp_path):
    import socket

    import msgspec
    from dpserve.daemons.addresses import Addresses
    from dpserve.daemons.config import NODE_LINKS_FROM_RANKS, ServeConfig
    from dpserve.daemons.supervisor.plan import plan_children
    from dpserve.engine.common.config import EngineProcessConfig

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')

    def config(size: int, links: str = "auto") -> ServeConfig:
        return ServeConfig(model=str(tmp_path), served_model_name="m", data_parallel_size=size, rank_links=links)

    assert NODE_LINKS_FROM_RANKS == 256
    assert [config(n).node_hops for n in (1, 64, 255, 256, 4096)] == [False, False, False, True, True]
    assert config(2, "node").node_hops and not config(4096, "direct").node_hops
    with pytest.raises(ValueError, match="--rank-links"):
        config(2, "hops").validate()
    for links, told in (("node", True), ("direct", False)):
        node = config(2, links)
        with socket.create_server(("127.0.0.1", 0)) as listen:
            children = {c.name: c for c in plan_children(node, Addresses.for_node(node, "/run/x", "127.0.0.1"), [listen], 256, 0.5)}
        engine = msgspec.json.decode(children["engine-dp1"].config_json, type=EngineProcessConfig)
        assert engine.node_hop is told and engine.node_relay_address == "ipc:///run/x/node.loads"


def test_a_hop_that_could_not_start_is_started_again_when_a_rank_asks_again(tmp_path):
    from dpserve.engine.rank.node_hop import NodeHops

    ctx = zmq.Context()
    hops = NodeHops(ctx, f"ipc://{tmp_path}/later/node.loads", 0, None, setup_logging("test-hop"))
    try:
        assert hops.open("ipc:///nowhere/api-0.engines")  # its local socket's directory is missing: the bind fails
        first = hops.hops["ipc:///nowhere/api-0.engines"]
        first.join(5)
        assert not first.is_alive()
        (tmp_path / "later").mkdir()
        assert hops.open("ipc:///nowhere/api-0.engines")
        again = hops.hops["ipc:///nowhere/api-0.engines"]
        assert again is not first and again.is_alive() and hops.num_opened == 2
        assert hops.open("ipc:///nowhere/api-0.engines") and hops.hops["ipc:///nowhere/api-0.engines"] is again
    finally:
        ctx.term()  # ends the live hop's proxy
    again.join(5)
    assert not again.is_alive()
