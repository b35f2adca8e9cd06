"""Which connection on an API server's engine socket speaks for which rank, and the
pleas for ranks this API server cannot route to.

Owns the rank <-> ZeroMQ identity table and the list of unroutable ranks; the
EngineClient asks it before it believes a hello, a death notice or outputs, and
applies the verdicts (routing, failed requests). It never sends a request and
never trusts a peer's word about a rank other than the peer's own identity:
a rank connects as "{rank}:{incarnation}" (":{n}" added when it remade the
connection on a GreetAgain), and ZeroMQ (no ROUTER_HANDOVER) never gives an
identity in use to a second connection.

A peer is a route: the frames before a message's body. A rank connected directly
is one frame, its identity; a rank behind its node's hop (`--rank-links node`,
engine/rank/node_hop.py) is two, the hop's identity ("node-{node_rank}-...") and
the rank's, and the hop speaks only for ranks of the node the table names for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dpserve.daemons.api.router import Router
from dpserve.engine.common.protocol import GREET_NO_HELLO, EngineHello, LoadTable
from dpserve.engine.common.sockets import peer_name
from dpserve.engine.rank.node_hop import node_of

Route = tuple[bytes, ...]  # the frames that reach a rank: (identity,) or (node hop, identity)

GREET_AFTER_S = 1.0  # a rank alive in the table but unroutable here this long is asked to reconnect
GREET_BACKOFF_MAX_S = 30.0
STRAY_LOG_EVERY_S = 10.0


class EnginePeers:
    """Invariants: `identities[rank]` is the route whose hello this API server accepted
    for the rank's current incarnation, or None; `peer_rank` is its inverse. `unroutable`
    holds the eligible ranks alive in the table that are not routable here, as
    [since, why, next plea at, backoff]."""

    def __init__(self, router: Router, log) -> None:
        self.router = router
        self.log = log
        self.identities: list[Route | None] = [None] * router.size
        self.peer_rank: dict[Route, int] = {}
        self._heard: dict[tuple[int, str], Route] = {}  # hellos of incarnations the table has not named yet
        self.contested: set[int] = set()  # ranks a second connection said hello for: probe the first
        self.unroutable: dict[int, list] = {}
        self.unreachable: dict[int, str] = {}  # rank -> why its last send failed
        # greet_again(rank, why): ask the rank, through the coordinator, to reconnect (set by the server)
        self.greet_again: Callable[[int, str], None] | None = None
        self._stray_logged = -STRAY_LOG_EVERY_S
        self.num_stray = 0

    @staticmethod
    def speaks_for(peer: bytes, rank: int, incarnation: str) -> bool:
        """Whether the identity `peer` is named as a connection of that rank's incarnation."""
        base = f"{rank}:{incarnation}".encode()
        return peer == base or (peer.startswith(base + b":") and peer[len(base) + 1:].isdigit())

    def route_speaks_for(self, route: Route, rank: int, incarnation: str) -> bool:
        """Whether `route` is that rank's incarnation's: its identity frame names it and, through
        a node's hop, the hop is of the node the table names for the rank."""
        if not self.speaks_for(route[-1], rank, incarnation):
            return False
        if len(route) == 1:
            return True
        load = self.router.loads[rank]
        node = node_of(route[0])
        return len(route) == 2 and node is not None and (load is None or load.node_rank < 0 or load.node_rank == node)

    def hello(self, peer: Route, msg: EngineHello) -> bool:
        """True when the hello is to be accepted now; a hello of an incarnation the table
        has not named yet is kept for take_heard; any other is a stray."""
        rank = msg.rank
        if not 0 <= rank < self.router.size or not self.route_speaks_for(peer, rank, msg.incarnation):
            self.stray(peer, f"a hello for rank {rank} from a connection that is not that rank's")
            return False
        if self.identities[rank] not in (None, peer) and self.router.routable(rank):
            # A second connection for a rank routable through its first: the rank remade its
            # connection (a plea), or an impostor. Never adopted: the caller probes the first;
            # if that one is gone the rank becomes unroutable and is pleaded for, and its
            # next fresh connection greets a rank that is free to take.
            self.contested.add(rank)
            self.stray(peer, f"a hello for rank {rank}, routable through another connection")
            return False
        load = self.router.loads[rank]
        if load is None or load.incarnation != msg.incarnation:
            self._heard[(rank, msg.incarnation)] = peer
            if len(self._heard) > 4 * self.router.size + 16:
                del self._heard[next(iter(self._heard))]
            return False
        return True

    def death_notice(self, peer: Route, rank: int, incarnation: str) -> bool:
        """Whether a death notice for the rank may be believed (else a stray)."""
        if 0 <= rank < self.router.size and self.route_speaks_for(peer, rank, incarnation) and self.identities[rank] in (None, peer):
            return True
        self.stray(peer, f"a death notice for rank {rank}")
        return False

    def outputs_from(self, peer: Route, rank: int) -> bool:
        """Whether outputs said to be from `rank` came from one of its connections (else a stray)."""
        if self.peer_rank.get(peer) == rank or peer[-1].startswith(f"{rank}:".encode()):
            return True
        self.stray(peer, f"outputs for rank {rank}")
        return False

    def bind(self, rank: int, peer: Route) -> None:
        """`peer` now speaks for `rank` (its hello was accepted)."""
        old = self.identities[rank]
        if old is not None:
            self.peer_rank.pop(old, None)
        self.identities[rank] = peer
        self.peer_rank[peer] = rank
        self.unreachable.pop(rank, None)

    def lost(self, rank: int, why: str) -> None:
        """A send to `rank` failed: forget its connection; the next heal pleads at once."""
        identity = self.identities[rank]
        if identity is not None:
            self.peer_rank.pop(identity, None)
            self.identities[rank] = None
        self.unreachable[rank] = why
        self.unroutable.pop(rank, None)

    def take_heard(self, table: LoadTable) -> list[tuple[int, str, Route]]:
        """(rank, incarnation, peer) of kept hellos that the table now names."""
        if not self._heard:
            return []
        found = []
        for entry in table.ranks:
            peer = self._heard.pop((entry.rank, entry.incarnation), None)
            if peer is not None and self.router.hello[entry.rank] != entry.incarnation and self.route_speaks_for(
                peer, entry.rank, entry.incarnation
            ):
                found.append((entry.rank, entry.incarnation, peer))
        return found

    def heal(self, now: float, at_once: tuple[int, ...] = ()) -> None:
        """Plead (backing off to GREET_BACKOFF_MAX_S) for every eligible rank alive in the
        table that this API server has not been able to route to for GREET_AFTER_S."""
        router = self.router
        for rank in router.eligible:
            load = router.loads[rank] if 0 <= rank < router.size else None
            if load is None or not load.is_alive or router.routable(rank):
                self.unroutable.pop(rank, None)
                continue
            why = self.unreachable.get(rank) or f"{GREET_NO_HELLO} {load.incarnation}"
            entry = self.unroutable.setdefault(rank, [now, why, now + GREET_AFTER_S, GREET_AFTER_S])
            entry[1] = why
            if (rank in at_once or now >= entry[2]) and self.greet_again is not None:
                self.greet_again(rank, why)
                entry[3] = min(entry[3] * 2, GREET_BACKOFF_MAX_S)
                entry[2] = now + entry[3]

    def unroutable_ranks(self, now: float) -> list[dict]:
        """For /readyz: eligible ranks alive in the table that this API server cannot route to."""
        self.heal(now)
        return [{"rank": r, "reason": e[1], "for_s": round(now - e[0], 1)} for r, e in sorted(self.unroutable.items())]

    def stray(self, peer: Route, what: str) -> None:
        """A message from a peer that is no rank's: dropped, counted, logged at most every STRAY_LOG_EVERY_S."""
        self.num_stray += 1
        now = time.monotonic()
        if now - self._stray_logged >= STRAY_LOG_EVERY_S:
            self._stray_logged = now
            self.log.warning("message from an unknown peer dropped", peer=route_name(peer), what=what, num_stray=self.num_stray)


def route_name(route: Route) -> str:
    """A route fit for a log line: its frames' names, joined by '/' (a stray's first three)."""
    return "/".join(peer_name(frame) for frame in route[:3]) + ("/..." if len(route) > 3 else "")
