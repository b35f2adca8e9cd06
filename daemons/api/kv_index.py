"""What each rank's prefix cache really holds, fed by its KV events: the exact side of cache-aware routing.

Owns, per API server, one index of routing-block keys -> the ranks whose
caches hold that prefix, kept from every rank's numbered KVEventBatch
(engine/kv_events.py). It must never guess: a gap in a rank's batch numbers
or a new incarnation empties that rank's entries until a KVSnapshot replaces
them (the caller sends the KVSnapshotRequest `apply` asks for), so the index
may know less than a rank holds for a moment, never more.

Keys are prefix_index.chain_keys over blocks of `block` tokens (a multiple of
the engine's block size, 64 by default): the prompt is hashed once per
request and each block is one dict probe, whatever the number of ranks. The
rank computes the keys of what it caches and keeps them prefix-closed
(dropping a block drops what was filed under it), which the router's walk
relies on; this side files a few ints per 64 tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from dpserve.daemons.api.prefix_index import BLOCK, leading_holders
from dpserve.engine.kv_events import AllBlocksCleared, KeysRemoved, KeysStored, KVEventBatch, KVSnapshot

# Another API server's note of a send (Router.learn) arrives a few ms after the send, through the
# coordinator. A rank that removed the key within this long may have removed it after that send:
# the note is taken as stale rather than held against the removal for pending_ttl_s.
PEER_NOTE_LATE_S = 2.0
REMOVED_KEEP = 4096  # recently removed keys remembered per rank (the oldest go first)


class _RankKV:
    """One rank's state as its events told it: the routing keys its cache holds."""

    __slots__ = ("incarnation", "seq", "synced", "keys", "removed")

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self.seq = 0
        self.synced = True  # False between a gap and the snapshot that repairs it
        self.keys: set[int] = set()  # the routing keys its events confirm
        self.removed: OrderedDict[int, float] = OrderedDict()  # routing key -> when its events removed it (REMOVED_KEEP newest)


class KVIndex:
    """routing key -> {rank: 0} for the ranks that hold that prefix; the same face as PrefixIndex.

    Invariant: for a synced rank, its entries are exactly the routing keys
    its events (or snapshot) reported stored and not removed since; for a
    rank awaiting a snapshot, none.

    Besides what events confirmed, `expect` notes prompts this API server sent
    and their rank has yet to compute (a long prefill takes seconds; without
    the note every request of a tenant arriving meanwhile would look uncached
    everywhere and compute the prefix again elsewhere). A note ends when the
    rank's events file that block, or after pending_ttl_s.
    """

    def __init__(self, size: int, block: int = BLOCK, pending_ttl_s: float = 30.0, clock=time.monotonic) -> None:
        self.size = size
        self.block = block
        self.generation = [0] * size  # entries are removed, never left stale: one generation
        # key -> {rank: 0}. Most keys have one holder (distinct prefixes), and a dict of its own
        # was over half of an entry's memory: a one-holder entry is the rank's shared dict in
        # _solo, which is never written (a second holder replaces it; the last but one restores it)
        self.entries: dict[int, dict[int, int]] = {}
        self._solo = [{rank: 0} for rank in range(size)]
        self.notes: dict[int, dict[int, float]] = {}  # key -> {rank: deadline}: sent there, not confirmed yet
        self.expiring: deque[tuple[float, int, list[int]]] = deque()  # (deadline, rank, keys) in deadline order
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self.ranks: list[_RankKV | None] = [None] * size
        self.num_snapshots_asked = 0
        self.ranks_seen = False  # some rank published events: the router trusts this index from then on

    # ------------------------------------------------------------ feeding

    def apply(self, batch: KVEventBatch) -> bool:
        """File one batch; True when the rank's state is unknown and a snapshot must be asked for."""
        rank = batch.rank
        if not 0 <= rank < self.size:
            return False
        self.ranks_seen = True
        state = self.ranks[rank]
        if state is None or state.incarnation != batch.incarnation:
            self.forget_rank(rank)
            state = self.ranks[rank] = _RankKV(batch.incarnation)
            if batch.seq != 1:  # we joined late, or the rank restarted: its history is not ours
                return self._await_snapshot(state)
        elif not state.synced:
            return False  # asked already; batches until the snapshot's are covered by it
        elif batch.seq <= state.seq:
            return False  # a duplicate, or older than the snapshot we hold
        elif batch.seq != state.seq + 1:
            self._clear(rank, state)
            return self._await_snapshot(state)
        state.seq = batch.seq
        for event in batch.events:
            if type(event) is KeysStored:
                self._stored(rank, state, event.keys, event.block)
            elif type(event) is KeysRemoved:
                self._removed(rank, state, event.keys)
            elif type(event) is AllBlocksCleared:
                self._clear(rank, state)
        return False

    def receive(self, msg: KVEventBatch | KVSnapshot) -> bool:
        """A rank's message; True when a snapshot must be asked for."""
        if type(msg) is KVSnapshot:
            self.apply_snapshot(msg)
            return False
        return self.apply(msg)

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        """Replace what we knew of the rank by its snapshot; batches after snap.seq follow it."""
        if not 0 <= snap.rank < self.size:
            return
        self.ranks_seen = True
        old = self.ranks[snap.rank]
        if old is not None:
            self._clear(snap.rank, old)  # (notes of what we sent it stay: the snapshot may predate them)
        state = self.ranks[snap.rank] = _RankKV(snap.incarnation)
        state.seq = snap.seq
        self._stored(snap.rank, state, snap.keys, snap.block)

    def forget_rank(self, rank: int) -> None:
        """The rank died or restarted: its cache is gone, and what we sent it with it."""
        state = self.ranks[rank]
        if state is not None:
            self._clear(rank, state)
            self.ranks[rank] = None
        for key in [k for k, noted in self.notes.items() if rank in noted]:
            self._unnote(key, rank)

    def _await_snapshot(self, state: _RankKV) -> bool:
        state.synced = False
        self.num_snapshots_asked += 1
        return True

    # A holder entry exists while the rank's events confirm the key OR a live note expects it.

    def _hold(self, key: int, rank: int) -> None:
        entries = self.entries
        holders = entries.get(key)
        if holders is None:
            entries[key] = self._solo[rank]
        elif rank not in holders:
            if len(holders) == 1:  # a shared one-holder dict: never written, replaced
                entries[key] = {**holders, rank: 0}
            else:
                holders[rank] = 0

    def _unhold(self, key: int, rank: int) -> None:
        entries = self.entries
        holders = entries.get(key)
        if holders is None or rank not in holders:
            return
        n = len(holders)
        if n == 1:
            del entries[key]
        elif n == 2:
            for other in holders:
                if other != rank:
                    entries[key] = self._solo[other]
        else:
            del holders[rank]

    def _unnote(self, key: int, rank: int) -> None:
        noted = self.notes[key]
        del noted[rank]
        if not noted:
            del self.notes[key]
        state = self.ranks[rank]
        if state is None or key not in state.keys:
            self._unhold(key, rank)

    def _clear(self, rank: int, state: _RankKV) -> None:
        notes = self.notes
        for key in state.keys:
            if rank not in notes.get(key, ()):
                self._unhold(key, rank)
        state.keys.clear()

    def _stored(self, rank: int, state: _RankKV, keys: list[int], block: int) -> None:
        if block != self.block:
            if self.entries:
                return  # ranks of two routing-block sizes: only the first size's are filed
            self.block = block  # vLLM's CPU blocks may be larger than 64 (the rank chose lcm(64, its blocks))
        entries, notes, held, removed = self.entries, self.notes, state.keys, state.removed
        solo = self._solo[rank]
        for key in keys:  # (_hold inlined: a few keys a step, every step)
            holders = entries.get(key)
            if holders is None:
                entries[key] = solo
            elif rank not in holders:
                if len(holders) == 1:
                    entries[key] = {**holders, rank: 0}
                else:
                    holders[rank] = 0
            held.add(key)
            if removed:
                removed.pop(key, None)
            if notes:
                noted = notes.get(key)
                if noted is not None and rank in noted:
                    self._unnote(key, rank)  # confirmed: the note has done its job

    def _removed(self, rank: int, state: _RankKV, keys: list[int]) -> None:
        notes, held, removed, unhold = self.notes, state.keys, state.removed, self._unhold
        now = self.clock()
        for key in keys:
            held.discard(key)
            removed.pop(key, None)  # (note_removed inlined)
            removed[key] = now
            if notes and rank in notes.get(key, ()):
                continue  # a live note keeps the entry until it expires
            unhold(key, rank)
        while len(removed) > REMOVED_KEEP:
            removed.popitem(last=False)  # (a dict's next(iter()) crawls over the deleted slots at its front)

    # ------------------------------------------------------------ notes and lookups

    def expect(self, keys: list[int], rank: int, peer: bool = False) -> None:
        """This API server (or, `peer`, another one) sent `rank` a prompt with these keys: count
        them held until the rank's events confirm them, or for pending_ttl_s. Also ends the
        notes that expired.

        A peer's note comes late: the rank's events may have confirmed a key already (a note
        for it would never be confirmed, and would outlive the key's removal), or removed it
        since (the note would bring it back). Such keys are not noted."""
        now = self.clock()
        state = self.ranks[rank] if peer else None
        if state is not None:
            confirmed, removed = state.keys, state.removed
            keys = [k for k in keys if k not in confirmed and (k not in removed or now - removed[k] >= PEER_NOTE_LATE_S)]
        expiring = self.expiring
        while expiring and expiring[0][0] <= now:
            _, r, old = expiring.popleft()
            for key in old:
                noted = self.notes.get(key)
                if noted is not None and noted.get(r, now + 1) <= now:
                    self._unnote(key, r)
        deadline = now + self.pending_ttl_s
        notes = self.notes
        for key in keys:
            noted = notes.get(key)
            if noted is None:
                notes[key] = {rank: deadline}
            else:
                noted[rank] = deadline
            self._hold(key, rank)
        if keys:
            expiring.append((deadline, rank, keys))

    def match(self, keys: list[int]) -> dict[int, int]:
        """rank -> how many leading routing blocks of `keys` it holds, for ranks holding at least one
        (one probe per block; the router reads prefix_index.cheapest_holder over `entries` instead)."""
        found: dict[int, int] = {}
        for depth, holders in enumerate(leading_holders(self.entries, keys), 1):
            for rank in holders:
                if found.get(rank, 0) == depth - 1:
                    found[rank] = depth
        return found

    def is_synced(self, rank: int) -> bool:
        state = self.ranks[rank]
        return state is not None and state.synced
