"""The whole cluster as this node sees it: every rank of the deployment, from
the coordinator's load table.

Every node's supervisor subscribes to the table the API servers read
(producers.read_table posts TableSeen), so the head and each worker see the
same ranks the routers see. The loop is the only writer (apply, check_head);
the NodeView reads it for /status, /readyz, /metrics, the STATUS= line and
`dpserve status`, which therefore never disagree.

A rank's state (field names are a documented contract, see README "Status"):
    absent      the coordinator has never held it (its node has not started)
    registered  registered, loading or connecting to the API servers
    ready       in the coordinator's routing table: API servers route to it
    lost        was registered, now out of routing (stopped reporting, its
                process exited, its node is gone); since = when it was lost
    drained     out of routing on purpose (`dpserve drain`): stays down until undrained
Membership: the ranks the head starts with (--data-parallel-size) and every rank
that joined since (up to --data-parallel-size-max), less the retired ones
(`dpserve retire`: drained, then out of the tables). Only members are shown and
counted: a slot past the starting size that nobody took is no rank of the cluster.
`since` is when the coordinator saw the state change (its wall clock, the
same on every node); for `absent`, when this node started.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpserve.engine.common.protocol import RankLoad

RANK_STATES = ("absent", "registered", "ready", "lost", "drained")
DRAINED_PREFIX = "drained"  # a down_reason saying the rank was drained (engine/rank/process.DRAINED_REASON)
RETIRED_PREFIX = "retired"  # ... that it left the cluster (draining.RETIRED_REASON): no member any more
# The coordinator publishes every rank at least once a second; a node that
# hears nothing for this long (or the probe budget, if longer) has lost the head.
HEAD_SILENCE_MIN_S = 3.0


@dataclass(slots=True)
class RankView:
    """One rank as this node last heard of it: its state, since when, and the
    coordinator's last entry for it (load, node, host, address), kept whole."""

    rank: int
    load: RankLoad
    state: str = "absent"
    since: float = 0.0  # wall clock: the coordinator's state change (absent: this node's start)


def state_of(entry: RankLoad) -> str:
    if entry.is_alive:
        return "ready"
    if entry.down_reason == "registering":
        return "registered"
    if entry.down_reason.startswith(RETIRED_PREFIX):
        return "retired"
    return "drained" if entry.down_reason.startswith(DRAINED_PREFIX) else "lost"


class ClusterState:
    """Written by the supervisor's loop only."""

    def __init__(self, data_parallel_size: int, head_silence_s: float, wall: float, size_max: int = 0) -> None:
        self.initial_size = data_parallel_size
        self.size = max(size_max, data_parallel_size)  # every slot a rank may join
        self.head_silence_s = max(HEAD_SILENCE_MIN_S, head_silence_s)
        self.ranks = [RankView(r, RankLoad(r, "", False), since=wall) for r in range(self.size)]
        # Kept with every change: the STATUS= line and /readyz read them after
        # each wake of the loop, which must not cost a pass over 1,024 ranks.
        # Members only (is_member); `num_members` is the deployment's size now.
        self.counts = {state: 0 for state in RANK_STATES}
        self.counts["absent"] = data_parallel_size
        self.num_members = data_parallel_size
        self.last_table_at = 0.0  # monotonic; 0: never
        self.head_connected = False
        self.head_reached = False  # a table has ever come: silence before it is not a lost head
        self.head_since = wall  # when head_connected last changed

    def apply(self, entries: list[RankLoad], mono: float, wall: float) -> None:
        """One LoadTable's entries: each replaces what this node held for the rank."""
        self.last_table_at = mono
        if not self.head_connected:
            self.head_connected, self.head_reached, self.head_since = True, True, wall
        for e in entries:
            if not 0 <= e.rank < self.size:
                continue
            r = self.ranks[e.rank]
            state = state_of(e)
            if state != r.state:
                self._count(r, -1)
                r.state, r.since = state, wall
                self._count(r, +1)
            if e.since:
                r.since = e.since  # the coordinator's: every node shows the same time
            r.load = e

    def is_member(self, r: RankView) -> bool:
        """A rank the head started with or one that joined since, and not retired."""
        return r.state != "retired" and (r.rank < self.initial_size or r.state != "absent")

    @property
    def members(self) -> list[RankView]:
        return [r for r in self.ranks if self.is_member(r)]

    def _count(self, r: RankView, sign: int) -> None:
        if self.is_member(r):
            self.counts[r.state] += sign
            self.num_members += sign

    def check_head(self, mono: float, wall: float) -> bool:
        """A loop verb on every tick: True when the head just went silent."""
        if self.head_connected and mono - self.last_table_at > self.head_silence_s:
            self.head_connected, self.head_since = False, wall
            return True
        return False

    def count(self, state: str) -> int:
        return self.counts[state]

    def routable(self, ranks: list[int] | None = None) -> int:
        """Ranks in the routing table (of `ranks`, when given); none while the head is silent."""
        if not self.head_connected:
            return 0
        if ranks is None or len(ranks) == self.size:
            return self.counts["ready"]
        return sum(self.ranks[r].state == "ready" for r in ranks)
