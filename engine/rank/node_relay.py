"""One node's ranks speak to the coordinator in one message (issue 30): their load
reports and heartbeats gather here and leave as a NodeLoad: the changes at most
every flush interval (so within the report interval), and a heartbeat every
`beat_s`. The heartbeat need not follow the ranks' report interval: it only has
to beat the coordinator's silence limit a few times over (the default owner
setting is a quarter of it), so a quiet cluster's coordinator idles. Pure state: the
owner hands it reports and the clock and sends what flush() returns; it never
sends, never polls and never judges a rank's membership (registration,
readiness and deaths still go from each rank to the coordinator).

Why per node and not per rank: the coordinator's cost is per message (~15 us of
ZeroMQ wake-ups and syscalls, RESULTS §12), so 512 nodes x 8 ranks reporting
every 100 ms cost it 5,120 messages/s instead of 40,960.
"""

from __future__ import annotations

import math
import struct

import zmq
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import LoadReport, NodeLoad, OpenHop
from dpserve.engine.common.sockets import make_socket
from dpserve.engine.rank.node_hop import hop_address

# While loads change a node sends at most this often: 512 nodes under full load
# -> at most 25,600 messages/s (the coordinator publishes changes at most every
# 20-100 ms at 1,024-4,096 ranks, so a faster flush would not route sooner).
NODE_FLUSH_S = 0.02
RESYNC_EVERY = 10  # every rank's report, not only the changed ones, every this many intervals


# A NodeLoad's rows travel packed (issue 30, third round): the coordinator reads a
# whole drain of them as one array (numpy, no Python step a row). A row is the rank
# (u32), its incarnation (ascii, at most 12 bytes, NUL-padded: dpserve's are 12 hex
# digits) and the LoadDelta row as 11 int64; ranks and ages are u32 lists.
ROW = struct.Struct("<I12s11q")
U32 = struct.Struct("<I")


def incarnation_key(incarnation: str) -> bytes:
    """An incarnation as a packed row holds it (and as the coordinator compares it)."""
    return incarnation.encode()[:12]


def pack_rows(rows: list[tuple]) -> bytes:
    """NodeLoad.loads from rows as row_of_report makes them."""
    pack = ROW.pack
    return b"".join(pack(r[0], incarnation_key(r[1]), *r[2:]) for r in rows)


def unpack_rows(packed: bytes) -> list[tuple]:
    """NodeLoad.loads back as (rank, incarnation, *LoadDelta row) tuples (tests, tools)."""
    return [(r[0], r[1].rstrip(b"\0").decode(errors="replace"), *r[2:]) for r in ROW.iter_unpack(packed)]


def pack_u32(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def unpack_u32(packed: bytes) -> list[int]:
    """NodeLoad.alive or .heard_ms_ago as a list."""
    return [v for (v,) in U32.iter_unpack(packed)]


def row_of_report(r: LoadReport) -> tuple:
    """A rank's report as one NodeLoad row: (rank, incarnation, *LoadDelta row), usages
    in permille. Built where the report is made or aggregated (the node), so that the
    coordinator stores and forwards it without touching a field."""
    return (
        r.rank, r.incarnation, r.num_running, r.num_waiting, r.num_waiting_prefill_tokens,
        r.num_remaining_decode_tokens, round(r.slot_usage * 1000), r.num_requests_finished, r.num_requests_aborted,
        round(r.kv_usage * 1000), r.num_preemptions, r.num_prefix_queries, r.num_prefix_hits,
    )


class NodeAggregator:
    """Invariants: `latest[rank]` is the rank's newest report as a NodeLoad row; `heard[rank]` when it
    came (the owner's monotonic clock); `changed` the ranks whose report differs
    from the one the last NodeLoad carried. A rank is listed alive while its last
    report is younger than `silence_s`."""

    def __init__(
        self, node_rank: int, interval_s: float, silence_s: float, flush_s: float = NODE_FLUSH_S, beat_s: float = 0.0
    ) -> None:
        """`interval_s`: the ranks' report interval; `silence_s`: a rank unheard this long
        is not listed alive; `beat_s`: the heartbeat's period (default: the interval)."""
        self.node_rank = node_rank
        self.interval_s = max(interval_s, beat_s)  # between two heartbeats
        self.silence_s = silence_s
        self.flush_s = min(flush_s, interval_s)
        self.latest: dict[int, tuple] = {}
        self.sent: dict[int, tuple] = {}
        self.heard: dict[int, float] = {}
        self.changed: set[int] = set()
        self.seq = 0
        self.last_flush = -math.inf
        self.last_beat = -math.inf

    def note(self, report: LoadReport, now: float) -> None:
        """A rank's report (a change or a heartbeat)."""
        rank, row = report.rank, row_of_report(report)
        self.latest[rank] = row
        self.heard[rank] = now
        if self.sent.get(rank) != row:
            self.changed.add(rank)

    def forget(self, rank: int) -> None:
        """The rank is gone (its death was announced): not alive in the next NodeLoad."""
        for held in (self.latest, self.sent, self.heard):
            held.pop(rank, None)
        self.changed.discard(rank)

    def next_due(self) -> float:
        """When flush() has something to send at the latest (monotonic)."""
        due = self.last_beat + self.interval_s
        if self.changed:
            due = min(due, self.last_flush + self.flush_s)
        return due

    def flush(self, now: float) -> NodeLoad | None:
        """The NodeLoad due now, or None: the heartbeat every interval (with the
        changes, and every rank's report each RESYNC_EVERY-th), changes when the
        last message is flush_s old (a heartbeat too past half the interval)."""
        since_beat = now - self.last_beat
        if since_beat < self.interval_s and not (self.changed and now - self.last_flush >= self.flush_s):
            return None
        # A message that goes anyway beats too once half the period has passed: under
        # changing loads the heartbeat rides on the changes (no message of its own).
        beat = since_beat >= self.interval_s / 2
        self.seq += 1
        if beat:
            self.last_beat = now
        heard, limit = self.heard, now - self.silence_s
        alive = [r for r in sorted(heard) if heard[r] > limit] if beat else []
        # the resync repeats the fresh ranks' rows only: a silent rank's must not revive it
        ranks = alive if beat and self.seq % RESYNC_EVERY == 1 else sorted(self.changed)
        loads = [self.latest[r] for r in ranks]
        for row in loads:
            self.sent[row[0]] = row
        self.changed.clear()
        self.last_flush = now
        ago = [min(0xFFFFFFFF, int((now - heard[r]) * 1000)) for r in alive]
        return NodeLoad(self.node_rank, self.seq, pack_u32(alive), pack_rows(loads), pack_u32(ago))


class RelayLink:
    """A rank's way to its node's relay (node-local, a PUSH): its LoadReports go there,
    not to the coordinator. Never blocks: a report that cannot be queued is dropped
    (the next one carries the same load), as on the coordinator's socket."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.codec = Codec(LoadReport | OpenHop)
        self.sock = make_socket(ctx, zmq.PUSH, connect=address, sndhwm=1000)

    def send(self, report: LoadReport | OpenHop) -> None:
        try:
            self.sock.send(self.codec.encode(report), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def hop(self, api_address: str) -> str:
        """RankIO's `hop` (`--rank-links node`): ask the node for its hop to that API
        server and return where to connect for it (engine/rank/node_hop.py). The
        connection waits for the hop's bind (ZeroMQ retries), so nothing here blocks."""
        self.send(OpenHop(api_address))
        return hop_address(self.address, api_address)
