"""The coordinator's registry: every rank's registration, liveness and last load,
and the LoadTable messages that publish them. Pure state and rules: no sockets;
callers pass the monotonic `now` (the wall clock only stamps `since`, for
display), so it is tested alone. It must never block or send: server.py owns
the sockets and decides when to publish.
"""

from __future__ import annotations

import time

import numpy as np
from dpserve.daemons.coordinator.delta import MAX_RANKS_PER_DELTA, runs_of
from dpserve.engine.common.protocol import (
    PROTOCOL_VERSION,
    EngineReady,
    EngineRegister,
    LoadDelta,
    LoadReport,
    LoadTable,
    NodeLoad,
    RankLoad,
)
from dpserve.engine.rank.node_relay import ROW, incarnation_key, row_of_report

PUBLISH_MIN_INTERVAL_S = 0.002
LOOP_MIN_INTERVAL_S = 0.002  # see wake_interval
LOOP_WAKES_PER_PUBLISH = 4
# Under load every busy rank's entry changes every step, and each API server
# pays ~3 us an entry it applies. Publishing changes at most every size x this
# (2 ms up to 100 ranks, 5 ms at 256, 20 ms at 1,024) bounds that to ~50,000
# entries/s per API server whatever the cluster size; API servers count their
# own sends in between (vLLM's coordinator publishes every 100 ms).
PUBLISH_INTERVAL_PER_RANK_S = 0.00002
PUBLISH_MAX_INTERVAL_S = 0.1
PUBLISH_KEEPALIVE_S = 1.0  # an (empty) table at least this often: nodes hear the head
# Every rank's full entry (the resync, for a subscriber that missed a message) every
# size / this many seconds, at least every second: 8 s at 4,096 ranks, where a
# resync each second was ~10 MB/s to 32 subscribers (issue 30).
RESYNC_RANKS_PER_S = 512
MAX_RANKS_PER_TABLE = 256  # ~16 KiB of msgpack
EXPIRE_EVERY_S = 0.1  # the staleness scan visits every rank: not on every message
DELIVERY_S = 0.05  # a published table reaching every API server and being applied, on a busy node


def publish_interval(data_parallel_size: int) -> float:
    """The shortest gap between two publishes of changed ranks, for this cluster size."""
    return min(PUBLISH_MAX_INTERVAL_S, max(PUBLISH_MIN_INTERVAL_S, data_parallel_size * PUBLISH_INTERVAL_PER_RANK_S))


def wake_interval(data_parallel_size: int) -> float:
    """The coordinator's loop wakes at most this often: LOOP_WAKES_PER_PUBLISH times a
    publish interval, at least every LOOP_MIN_INTERVAL_S (5 ms at 1,024 ranks, 20 ms at
    4,096). Its wake-ups, not its messages, were 1.2-2.9 points of a core at rest at
    4,096 ranks with a 5 ms floor (~150 a second, issue 30); node messages wait for
    their batch anyway (server.NODE_APPLY_MAX_S)."""
    return max(LOOP_MIN_INTERVAL_S, publish_interval(data_parallel_size) / LOOP_WAKES_PER_PUBLISH)


# A NodeLoad row as numpy reads it (node_relay.ROW): a drain's rows are one array.
# The incarnation is compared as 3 u32s: a bytes comparison in numpy is ~10x slower.
ROW_DTYPE = np.dtype([("rank", "<u4"), ("incarnation", "<u4", (3,)), ("load", "<i8", (11,))])
assert ROW_DTYPE.itemsize == ROW.size


def resync_interval(data_parallel_size: int) -> float:
    """Seconds between two publishes of every rank's full entry."""
    return max(PUBLISH_KEEPALIVE_S, data_parallel_size / RESYNC_RANKS_PER_S)


def silence_limit(stale_after_s: float, data_parallel_size: int) -> float:
    """How long a rank may be silent before it is declared lost, so that every API
    server has dropped it within `stale_after_s` (interval x threshold) of its
    death: a rank dies after its last report, and the scan that notices, the
    loop's wake-up, the publish and the delivery come on top of the silence (measured 1.91 s against
    a 1.5 s limit at 256 ranks before). Never below half the limit, so a
    late report is still not mistaken for a death."""
    slack = EXPIRE_EVERY_S + publish_interval(data_parallel_size) + wake_interval(data_parallel_size) + DELIVERY_S
    return max(stale_after_s / 2, stale_after_s - slack)


class RankTable:
    """Every rank's registration and last load. Pure state: no sockets, testable alone.

    Invariant: a rank is alive only between its EngineReady and the next
    RankDown (or a newer registration, or going stale). A rank's load and liveness
    live in arrays indexed by rank (`loads`, `last_seen`, `accepted`, `node_of`,
    `load_changed`), so that a drain of node messages is applied in a few numpy
    steps, not a Python step a row (issue 30); its RankLoad entry gets the load
    only when a LoadTable needs it (_sync).
    """

    def __init__(self, data_parallel_size: int, fingerprint: str, stale_after_s: float) -> None:
        self.size = data_parallel_size
        self.fingerprint = fingerprint
        self.stale_after_s = stale_after_s
        self.silence_limit_s = silence_limit(stale_after_s, data_parallel_size)
        self.ranks: dict[int, RankLoad] = {}
        size = max(0, data_parallel_size)
        self.last_seen = np.full(size, -np.inf)  # when the rank was last heard (monotonic); -inf: never
        self.loads = np.zeros((size, 11), np.int64)  # each rank's last load as a LoadDelta row
        self.load_changed = np.zeros(size, bool)  # ranks whose load changed since the last publish
        self.alive = np.zeros(size, bool)  # mirrors ranks[r].is_alive: the staleness scan reads it
        self.node_of = np.full(size, -1, np.int64)  # the node a registered rank belongs to: only its relay speaks for it
        self.accepted = np.zeros((size, 3), "<u4")  # incarnation_key of the incarnation whose reports count; 0s: none
        self.seq = 0
        self.dirty = True
        self.members: set[int] = set()  # ranks whose membership changed (a LoadTable, not a LoadDelta)
        self.accepting: dict[int, str] = {}  # rank -> the incarnation whose reports count (registering or alive)
        self.node_addresses: dict[int, str] = {}  # node_rank -> address, from NodeHello (for /status)

    def register(self, msg: EngineRegister, now: float) -> str:
        """'' when accepted, else the reason for refusal."""
        if msg.protocol_version != PROTOCOL_VERSION:
            return f"protocol version {msg.protocol_version} != coordinator's {PROTOCOL_VERSION}"
        if msg.fingerprint != self.fingerprint:
            return f"config fingerprint {msg.fingerprint} != head's {self.fingerprint} (model, dtype, max-model-len or data-parallel-size differ)"
        if not 0 <= msg.rank < self.size:
            return f"rank {msg.rank} is outside data-parallel-size {self.size}"
        held = self.ranks.get(msg.rank)
        if (
            held is not None
            and held.is_alive
            and held.incarnation != msg.incarnation
            and now - self.last_seen[msg.rank] < self.stale_after_s
        ):
            return f"rank {msg.rank} is already served by a live engine (incarnation {held.incarnation})"
        self.loads[msg.rank] = 0
        self.load_changed[msg.rank] = False
        self.alive[msg.rank] = False
        self.node_of[msg.rank] = msg.node_rank
        self._accept(msg.rank, msg.incarnation)
        self.ranks[msg.rank] = RankLoad(
            msg.rank, msg.incarnation, is_alive=False, down_reason="registering",
            node_rank=msg.node_rank, host=msg.host, address=self.node_addresses.get(msg.node_rank, ""), since=time.time(),
        )
        self.last_seen[msg.rank] = now
        self._touch(msg.rank)
        return ""

    def _touch(self, rank: int) -> None:
        self.members.add(rank)
        self.dirty = True

    def _accept(self, rank: int, incarnation: str | None) -> None:
        """Whose reports count for `rank` from now on (None: nobody's)."""
        if incarnation is None:
            self.accepting.pop(rank, None)
            self.accepted[rank] = 0
        else:
            self.accepting[rank] = incarnation
            self.accepted[rank] = np.frombuffer(incarnation_key(incarnation).ljust(12, b"\0"), "<u4")

    def ready(self, msg: EngineReady, now: float) -> bool:
        entry = self.ranks.get(msg.rank)
        if entry is None or entry.incarnation != msg.incarnation:
            return False
        entry.is_alive = True
        self.alive[msg.rank] = True
        entry.down_reason = ""
        self._accept(msg.rank, msg.incarnation)
        entry.since = time.time()
        self.last_seen[msg.rank] = now
        self._touch(msg.rank)
        return True

    def load(self, msg: LoadReport, now: float) -> bool:
        """A rank's own report. False when it comes from an engine this table does not hold."""
        return self.load_row(row_of_report(msg), now)

    def load_row(self, row: tuple, now: float) -> bool:
        """A report as a NodeLoad row, (rank, incarnation, *LoadDelta row). False when
        it comes from an engine this table does not hold."""
        return not self._rows((row,), now)

    def _rows(self, rows: list[tuple] | tuple, now: float) -> list[tuple]:
        """Apply a rank's own report rows (they hear the rank now); returns those of
        engines this table does not hold. A Python step a row: for ranks that report
        directly (a few, or Ray actors); node relays' rows go through node_loads()."""
        accepting, last_seen, loads, unknown = self.accepting, self.last_seen, self.loads, []
        for row in rows:
            rank = row[0]
            if accepting.get(rank) != row[1]:
                unknown.append(row)  # not registered, another incarnation, or declared lost
                continue
            last_seen[rank] = now
            load = row[2:]
            if tuple(loads[rank].tolist()) != load:  # (unchanged: a heartbeat, nothing to publish)
                loads[rank] = load
                self.load_changed[rank] = True  # its load only: a LoadDelta row
                self.dirty = True
        return unknown

    def _sync(self, rank: int) -> RankLoad:
        """The rank's entry, with its last load row written in."""
        entry = self.ranks[rank]
        (entry.num_running, entry.num_waiting, entry.num_waiting_prefill_tokens, entry.num_remaining_decode_tokens,
         slot, entry.num_requests_finished, entry.num_requests_aborted, kv, entry.num_preemptions,
         entry.num_prefix_queries, entry.num_prefix_hits) = self.loads[rank].tolist()
        entry.slot_usage, entry.kv_usage = slot / 1000, kv / 1000
        return entry

    def node_load(self, msg: NodeLoad, now: float) -> list[tuple[int, str]]:
        """One node's aggregate (see node_loads)."""
        return self.node_loads([msg], now)

    def node_loads(self, msgs: list[NodeLoad], now: float) -> list[tuple[int, str]]:
        """Nodes' aggregates, a drain of them at once: their changed loads applied, their
        fresh ranks heard from. A node speaks only for the ranks registered on it: a
        row counts only for a rank whose node and incarnation it names, a rank listed
        alive only when registered on that node. Returns (rank, incarnation) of the
        rows this table does not hold (they must register again). A rank counts as
        heard when its relay last heard it (`heard_ms_ago`), so a hung rank and a dead
        node go stale on the rank's own clock; a relay's rows say nothing of when.
        A message whose packed fields do not parse is skipped whole."""
        size = ROW.size
        msgs = [m for m in msgs if not (len(m.loads) % size or len(m.alive) % 4 or len(m.heard_ms_ago) not in (0, len(m.alive)))]
        rows = np.frombuffer(b"".join(m.loads for m in msgs), ROW_DTYPE)
        unknown: list[tuple[int, str]] = []
        if len(rows):
            rank = rows["rank"].astype(np.int64)
            node = np.repeat([m.node_rank for m in msgs], [len(m.loads) // size for m in msgs])
            held = rank < self.size
            at = np.where(held, rank, 0)
            accepted, incarnation = self.accepted[at], rows["incarnation"]
            on_node = self.node_of[at] == node
            ok = held & on_node & (accepted == incarnation).all(axis=1) & accepted.any(axis=1)
            if not ok.all():  # (a row for a rank of another node is dropped: no node asks another's ranks to register)
                ask = ~ok & (on_node | ~held | (self.node_of[at] < 0))
                unknown = [(int(r), i.tobytes().rstrip(b"\0").decode(errors="replace")) for r, i in zip(rank[ask], incarnation[ask])]
            rank, load = rank[ok], rows["load"][ok]
            moved = (self.loads[rank] != load).any(axis=1)  # (unchanged: a heartbeat, nothing to publish)
            if moved.any():
                self.loads[rank[moved]] = load[moved]
                self.load_changed[rank[moved]] = True
                self.dirty = True
        alive = np.frombuffer(b"".join(m.alive for m in msgs), "<u4").astype(np.int64)
        if len(alive):
            ago = np.frombuffer(b"".join(m.heard_ms_ago or bytes(len(m.alive)) for m in msgs), "<u4")
            node = np.repeat([m.node_rank for m in msgs], [len(m.alive) // 4 for m in msgs])
            held = alive < self.size
            at = np.where(held, alive, 0)
            ok = held & (self.node_of[at] == node)
            # the heartbeat; never back: a registration or a rank's own report may be newer than the relay's news
            alive, heard = alive[ok], now - ago[ok] / 1000
            self.last_seen[alive] = np.maximum(self.last_seen[alive], heard)
        return unknown

    def node_address(self, node_rank: int, address: str) -> None:
        """A node's supervisor said where it is: its ranks' entries name it."""
        if self.node_addresses.get(node_rank) == address:
            return
        self.node_addresses[node_rank] = address
        for rank, entry in self.ranks.items():
            if entry.node_rank == node_rank:
                entry.address = address
                self._touch(rank)

    def down(self, rank: int, reason: str, incarnation: str | None = None) -> bool:
        """Out of routing (`incarnation`: only if the table holds that one). A rank
        still registering goes down too: its announced death must not wait for staleness."""
        entry = self.ranks.get(rank)
        if entry is None or (incarnation is not None and entry.incarnation != incarnation):
            return False
        if not entry.is_alive and entry.down_reason != "registering":
            return False
        entry.is_alive = False
        self.alive[rank] = False
        entry.down_reason = reason
        entry.since = time.time()
        self._zero(rank)
        return True

    def retire(self, rank: int, reason: str) -> bool:
        """The rank left the cluster on purpose (`dpserve retire`): out of routing and of
        every node's membership until an engine registers for it again (a replacement)."""
        entry = self.ranks.get(rank)
        if entry is None or entry.down_reason == reason:
            return False
        entry.is_alive = False
        self.alive[rank] = False
        entry.down_reason = reason
        entry.since = time.time()
        self._zero(rank)
        return True

    def _zero(self, rank: int) -> None:
        """A rank out of routing holds no requests (its counters stay)."""
        self.loads[rank, :2] = 0
        self._sync(rank)
        self._accept(rank, None)
        self._touch(rank)

    def expire(self, now: float) -> list[int]:
        """Ranks that stopped reporting: marked down, returned for the log."""
        gone = np.flatnonzero(self.alive & (self.last_seen < now - self.silence_limit_s)).tolist()
        for rank in gone:
            self.down(rank, f"no load report for {self.silence_limit_s:.1f} s")
        return gone

    def snapshot(self) -> LoadTable:
        """Every rank in one table (tests and tools; publishing uses tables())."""
        self.seq += 1
        self.dirty = False
        self.load_changed[:] = False
        self.members.clear()
        return LoadTable(self.seq, self.size, [self._sync(r) for r in sorted(self.ranks)])

    def tables(self, full: bool, keepalive: bool = False) -> list[LoadTable | LoadDelta]:
        """The next messages to publish, each with its own seq: the ranks whose
        membership changed since the last call (or every rank, when `full`) as
        LoadTables of at most MAX_RANKS_PER_TABLE entries, then the ranks whose
        load alone changed as LoadDeltas of at most MAX_RANKS_PER_DELTA rows.
        Empty when nothing changed, unless `keepalive` (then an empty table)."""
        members = sorted(self.ranks) if full else sorted(self.members)
        changed = self.load_changed
        if not full and members:
            changed[members] = False  # their whole entry goes in a LoadTable
        loads = np.empty(0, np.int64) if full else np.flatnonzero(changed)
        changed[:] = False
        self.members.clear()
        self.dirty = False
        out: list[LoadTable | LoadDelta] = []
        for i in range(0, len(members), MAX_RANKS_PER_TABLE):
            self.seq += 1
            out.append(LoadTable(self.seq, self.size, [self._sync(r) for r in members[i : i + MAX_RANKS_PER_TABLE]]))
        for i in range(0, len(loads), MAX_RANKS_PER_DELTA):
            self.seq += 1
            part = loads[i : i + MAX_RANKS_PER_DELTA]
            # one flat list: ~half the cost of a list a row (4,096 rows: ~1.3 of ~3 ms a publish)
            out.append(LoadDelta(self.seq, self.size, runs_of(part), self.loads[part].ravel().tolist()))
        if (full or keepalive) and not out:
            self.seq += 1
            out.append(LoadTable(self.seq, self.size, []))  # nodes hear the head, even before any rank registered
        return out

