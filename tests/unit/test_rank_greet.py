"""A rank's answer to a plea (GreetAgain), on real sockets: RankIO against an API server's
ROUTER. A plea reconnects the rank (a fresh identity) and it says hello; pleas are
rate-limited; with a request of that API server in flight it only says hello again.
On a young connection (issue 30) a missing hello is sent again on the same connection,
while a failed send still remakes it: remaking a connection whose hello was only late
turned a loaded cluster's start into a loop of pleas and reconnects."""

from __future__ import annotations

import time

import pytest
import structlog
import zmq
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import GREET_API_RESTARTED, GREET_NO_HELLO, EngineHello, EngineToApi, GreetAgain
from dpserve.engine.rank.io import RankIO

TO_API = Codec(EngineToApi)


class Greeted:
    """Rank 0's RankIO connected to one API server's ROUTER; counts the hellos and the
    connections that server accepts."""

    def __init__(self, tmp_path) -> None:
        self.ctx = zmq.Context()
        self.address = f"ipc://{tmp_path}/api-0.engines"
        self.api = self.ctx.socket(zmq.ROUTER)
        self.api.setsockopt(zmq.LINGER, 0)
        self.api.bind(self.address)
        self.accepted = self.api.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self.io = RankIO(self.ctx, None, rank=0, incarnation="incA", fingerprint="f", node_rank=0,
                         coordinator_address=f"ipc://{tmp_path}/coordinator", log=structlog.get_logger(),
                         watch=lambda sock: None, watch_monitors=False)

    def hellos(self, timeout_ms: int) -> list[bytes]:
        got = []
        while self.api.poll(timeout_ms):
            identity, data = self.api.recv_multipart()
            if isinstance(TO_API.decode(data), EngineHello):
                got.append(identity)
            timeout_ms = 200
        return got

    def connections(self, timeout_ms: int) -> int:
        n = 0
        while self.accepted.poll(timeout_ms):
            self.accepted.recv_multipart()
            n += 1
            timeout_ms = 200
        return n


@pytest.fixture
def greeted(tmp_path):
    g = Greeted(tmp_path)
    try:
        g.io.connect_api_servers([g.address])
        assert g.hellos(5000) == [b"0:incA"] and g.connections(2000) == 1
        yield g
    finally:
        g.ctx.destroy(linger=0)  # every socket, the monitors' pairs included


def test_a_plea_reconnects_and_greets_at_most_once_a_second_and_only_greets_when_busy(greeted):
    g = greeted
    g.io.on_coordinator(GreetAgain(0, g.address, "a send failed"))
    assert b"0:incA:1" in g.hellos(5000)  # a fresh identity for the fresh connection
    assert g.connections(5000) == 1, "no fresh connection"
    g.io.on_coordinator(GreetAgain(0, g.address, "again at once"))
    assert g.hellos(500) == [] and g.connections(300) == 0  # rate-limited
    time.sleep(1.1)
    g.io.owner["req-1"] = 0  # a request of this API server in flight: greet only
    g.io.on_coordinator(GreetAgain(0, g.address, "busy link"))
    assert g.hellos(5000) == [b"0:incA:1"] and g.connections(500) == 0


def test_a_late_hello_is_sent_again_and_a_failed_send_remakes_the_connection(greeted):
    g = greeted
    g.io.on_coordinator(GreetAgain(0, g.address, f"{GREET_NO_HELLO} incA"))
    assert g.hellos(5000) == [b"0:incA"] and g.connections(300) == 0  # the same connection, its hello again
    g.io._reconnected.clear()  # (past the one-plea-a-second limit)
    g.io.on_coordinator(GreetAgain(0, g.address, "a send failed: Host unreachable"))
    assert g.hellos(5000) == [b"0:incA:1"] and g.connections(5000) == 1  # a fresh connection


def test_a_restarted_api_server_is_greeted_at_once_only_where_no_monitor_saw_it(greeted):
    """The coordinator's GREET_API_RESTARTED: a rank whose own monitored connection saw the
    new handshake has greeted already and stays quiet; one that cannot see it (behind its
    node's hop, or without monitors) says hello on the connection it has, never remade."""
    g = greeted
    g.io.on_coordinator(GreetAgain(0, g.address, GREET_API_RESTARTED))
    assert g.hellos(500) == [] and g.connections(300) == 0
    g.io.use_monitors = False
    for _ in range(2):  # not a plea: no one-a-second limit, no new identity
        g.io.on_coordinator(GreetAgain(0, g.address, GREET_API_RESTARTED))
    assert g.hellos(5000) == [b"0:incA", b"0:incA"] and g.connections(300) == 0
