"""The node's two relays (issue 30), hosted by its supervisor, each on a thread of
its own: the load relay (the node's ranks' LoadReports in, one NodeLoad an interval
out to the coordinator) and, when the node runs enough API servers for it to pay,
the table relay (one subscription to the head's load table, re-published on a
node-local socket). Both only move messages: neither reads or writes the
supervisor's state, and the supervisor's loop never waits on them.

Why the supervisor and not a process of its own: it already lives exactly as long
as the node's ranks (they die with it), so the node's silence is its ranks'
silence; a thread costs no fork, no config and no restart policy. The load relay
is a few messages per interval (~40 us each in Python); the table relay runs in C
(zmq.proxy) with the GIL released.
"""

from __future__ import annotations

import threading
import time
import uuid

import zmq
from dpserve.daemons.coordinator.table_relay import relay
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import CoordinatorInput, LoadReport, OpenHop
from dpserve.engine.common.sockets import make_socket
from dpserve.engine.rank.node_hop import NodeHops
from dpserve.engine.rank.node_relay import NodeAggregator

# The table relay pays when the head sends one copy instead of this many (the node's
# API servers and its supervisor). benchmarks/table_relay_bench.py found no gain for the
# publisher at 1-16 local subscribers on ipc (within its noise, load 11) and a relay
# costing the node 34-113 us a message; cluster_bench found the head 3 points lighter
# at 32 (RESULTS, issue 30). So only from 16 subscribers on.
TABLE_RELAY_MIN_SUBSCRIBERS = 16


def load_beat_s(heartbeat_interval_s: float, stale_after_s: float) -> float:
    """The load relay's heartbeat: as often as one rank's (so staleness is judged no
    later than with direct reports), and at least 4 times within the silence limit."""
    return min(heartbeat_interval_s, stale_after_s / 4)


class LoadRelay:
    """Invariant: only the relay's thread touches its sockets, aggregator and hops after
    start(); stop() ends it by terminating the context, which wakes its poll and ends
    every hop's proxy.

    The node's hops (engine/rank/node_hop.py, `--rank-links node`) are opened here, on
    a rank's OpenHop through the same node-local socket as its reports: the relay's
    thread is the one place of the node that hears every rank, and lives as long."""

    def __init__(
        self, node_rank: int, bind: str, coordinator_address: str, keys: CurveKeys | None,
        beat_s: float, stale_after_s: float, log,
    ) -> None:
        self.log = log
        self.ctx = zmq.Context()
        self.agg = NodeAggregator(node_rank, beat_s, silence_s=stale_after_s)
        self.pull = make_socket(self.ctx, zmq.PULL, bind=bind, rcvhwm=10_000)  # node-local: no CURVE
        self.out = make_socket(
            self.ctx, zmq.DEALER, keys, connect=coordinator_address,
            identity=f"node-{node_rank}-{uuid.uuid4().hex[:8]}".encode(), reconnect_ms=(100, 2000),
        )
        self.num_reports = self.num_sent = 0
        self.hops = NodeHops(self.ctx, bind, node_rank, keys, log)
        self.thread = threading.Thread(target=self._run, name="load-relay", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        agg, pull, out = self.agg, self.pull, self.out
        decode, encode = Codec(LoadReport | OpenHop, "node relay").decode_or_none, Codec(CoordinatorInput).encode
        try:
            while True:
                # 1. Wait for reports, never past the next flush or heartbeat.
                wait_ms = int(max(0.0, agg.next_due() - time.monotonic()) * 1000 + 0.999)
                if pull.poll(wait_ms):
                    now = time.monotonic()
                    while True:  # 2. Take every report waiting.
                        try:
                            data = pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if type(report := decode(data)) is LoadReport:
                            agg.note(report, now)
                            self.num_reports += 1
                        elif type(report) is OpenHop:
                            self.hops.open(report.address)
                # 3. Send what is due: the changes, at most every flush interval; the heartbeat.
                msg = agg.flush(time.monotonic())
                if msg is not None:
                    try:
                        out.send(encode(msg), zmq.NOBLOCK)
                        self.num_sent += 1
                    except zmq.Again:
                        pass  # no head yet: the next heartbeat carries the same
        except zmq.ContextTerminated:
            pass
        except Exception:
            self.log.exception("the node's load relay failed; its ranks go stale at the coordinator")
        finally:
            pull.close(0)
            out.close(0)

    def stop(self, timeout_s: float = 1.0) -> None:
        if not self.thread.is_alive():  # never started (a failed boot), or already ended
            self.pull.close(0)
            self.out.close(0)
        self.ctx.term()  # raises ContextTerminated in the thread's poll; returns once it closed its sockets
        self.thread.join(timeout_s)


class TableRelay:
    """daemons/coordinator/table_relay.py's proxy on a thread: the C proxy loop holds no GIL."""

    def __init__(self, upstream: str, bind: str, keys: CurveKeys | None) -> None:
        self.ctx = zmq.Context()
        self.bind = bind
        self.thread = threading.Thread(target=relay, args=(self.ctx, upstream, bind, keys), name="table-relay", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        self.ctx.term()
        self.thread.join(timeout_s)
