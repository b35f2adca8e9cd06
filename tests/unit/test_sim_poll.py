"""The simulated engine's epoll over ZeroMQ sockets (engine/testing/sim_poll.py): a
socket is reported when a message waits on it, also one its FD will not signal again
(sent on: `recheck`), never a closed one, and the wait ends when a message comes."""

from __future__ import annotations

import time

import zmq
from dpserve.engine.testing.sim_poll import FdPoller


def _pair(ctx, address):
    server = ctx.socket(zmq.ROUTER)
    server.bind(address)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.IDENTITY, b"c")
    client.connect(address)
    return server, client


def _poll_until(poller, want, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = poller.poll(100)
        if want in got:
            return got
    raise AssertionError(f"{want} never reported readable")


def test_a_message_is_reported_once_drained_it_is_not(tmp_path):
    ctx = zmq.Context()
    try:
        server, client = _pair(ctx, f"ipc://{tmp_path}/a")
        quiet = ctx.socket(zmq.DEALER)
        quiet.connect(f"ipc://{tmp_path}/a")
        poller = FdPoller()
        poller.register(client)
        poller.register(quiet)
        client.send(b"hello")
        server.recv_multipart()
        server.send_multipart([b"c", b"ping"])
        got = _poll_until(poller, client)
        assert quiet not in got
        assert client.recv(zmq.NOBLOCK) == b"ping"
        assert poller.poll(0) == []  # drained: nothing waits (it is looked at once more, cheaply)
        assert poller.poll(50) == []
        # a reply that arrives while we send on the socket is found through recheck
        server.send_multipart([b"c", b"again"])
        time.sleep(0.1)
        client.send(b"pong")  # a send may take in the arrival without the FD signalling again
        poller.recheck([client])
        assert _poll_until(poller, client) == [client]
        quiet.close(0)
        poller.recheck([quiet])
        assert quiet not in poller.poll(0)  # closed sockets are skipped, not polled
        poller.close()
    finally:
        ctx.destroy(linger=0)
