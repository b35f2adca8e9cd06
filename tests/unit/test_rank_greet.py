"""A rank's answer to a plea (GreetAgain) on a young connection (issue 30): a missing
hello is sent again on the same connection; a failed send still remakes it. Remaking a
connection whose hello was only late turned a loaded cluster's start into a loop of
pleas and reconnects."""

from __future__ import annotations

import structlog
import zmq
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import GREET_NO_HELLO, EngineHello, EngineToApi, GreetAgain
from dpserve.engine.rank.io import RankIO

TO_API = Codec(EngineToApi)


def test_a_late_hello_is_sent_again_and_a_failed_send_remakes_the_connection(tmp_path):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/api-0.engines"
    api = ctx.socket(zmq.ROUTER)
    api.setsockopt(zmq.LINGER, 0)
    api.bind(address)
    accepted = api.get_monitor_socket(zmq.EVENT_ACCEPTED)
    io = RankIO(ctx, None, rank=0, incarnation="incA", fingerprint="f", node_rank=0,
                coordinator_address=f"ipc://{tmp_path}/coordinator", log=structlog.get_logger(), watch=lambda sock: None,
                watch_monitors=False)

    def hellos(timeout_ms: int) -> list[bytes]:
        got = []
        while api.poll(timeout_ms):
            identity, data = api.recv_multipart()
            if isinstance(TO_API.decode(data), EngineHello):
                got.append(identity)
            timeout_ms = 200
        return got

    def connections(timeout_ms: int) -> int:
        n = 0
        while accepted.poll(timeout_ms):
            accepted.recv_multipart()
            n += 1
            timeout_ms = 200
        return n

    try:
        io.connect_api_servers([address])
        assert hellos(5000) == [b"0:incA"] and connections(2000) == 1
        io.on_coordinator(GreetAgain(0, address, f"{GREET_NO_HELLO} incA"))
        assert hellos(5000) == [b"0:incA"] and connections(300) == 0  # the same connection, its hello again
        io._reconnected.clear()  # (past the one-plea-a-second limit)
        io.on_coordinator(GreetAgain(0, address, "a send failed: Host unreachable"))
        assert hellos(5000) == [b"0:incA:1"] and connections(5000) == 1  # a fresh connection
    finally:
        ctx.destroy(linger=0)
