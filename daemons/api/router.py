"""Rank selection for one API server: load table + own unreported sends -> a rank.

Pure state and arithmetic, no sockets and no HTTP, so it is tested directly;
failures are its own exceptions (NoRankAvailable, RankLost, QueueFull, RankNotEligible),
which the API server turns into HTTP statuses. A rank is routable only while
the coordinator says it is alive AND this API server has heard the same
engine incarnation say hello on its own channel; otherwise a request could be
sent into a socket nobody reads.

Cost: a decision must not grow with the cluster (a linear scan
took 355 us at 1,024 ranks). Every eligible rank that can take a request (a
"candidate": routable, under its waiting-queue limit) sits in a bucket keyed
by its score, and a heap holds the scores; every event that changes a rank's
score (send, progress, finish, its table entry, hello, death) moves that one
rank in O(log n). A pick reads the lowest score's bucket and takes the first
rank at or after the rotation point, which is exactly what a scan from that
point keeping the first strictly lower score returns (tests/unit/test_routing.py
checks this against such a scan).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort

from dpserve.daemons.api.kv_index import KVIndex
from dpserve.daemons.api.prefix_index import BLOCK, PrefixIndex, chain_keys, cheapest_holder
from dpserve.engine.common.protocol import LoadTable, PrefixRouted, RankLoad

QUEUE_WAITING_WEIGHT = 4  # vLLM's `4 x waiting + running`
CACHE_WEIGHT = 8.0  # a cached prompt token held by one rank is worth 8 load tokens; by k ranks, max(1, 8 / k)
# cache-aware: the tokens policy's score, less the prompt tokens a rank probably holds (prefix_index.py)
POLICIES = ("tokens", "queue", "round-robin", "cache-aware")


class RoutingError(Exception):
    """No rank can take this request now; `retry_after_s` is a fair wait."""

    retry_after_s = 1


class NoRankAvailable(RoutingError):
    """No eligible rank is routable (or the pinned `rank` is not); waiting may help."""

    def __init__(self, rank: int | None = None, unreachable: bool = False) -> None:
        self.rank = rank
        self.unreachable = unreachable  # routable on paper, but its socket refused the send
        self.retry_after_s = 1 if rank is not None or unreachable else 2
        super().__init__(f"rank {rank} is not routable" if rank is not None else "no rank is routable")


class RankLost(RoutingError):
    """A pin to a rank the table holds as lost (it died, was drained or went silent):
    failing at once beats waiting --wait-for-engine-s for a rank that may never return.
    A rank that is starting or registering again is waited for (NoRankAvailable)."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"rank {rank} is lost: {reason}")


class QueueFull(RoutingError):
    """Every routable eligible rank is at its waiting-queue limit."""

    def __init__(self, max_waiting_per_rank: int) -> None:
        self.max_waiting_per_rank = max_waiting_per_rank
        super().__init__(f"every rank has {max_waiting_per_rank} requests waiting")


class RankNotEligible(RoutingError):
    """A pin to a rank this API server does not route to (the client's mistake)."""

    def __init__(self, rank: int, eligible: list[int]) -> None:
        self.rank = rank
        self.eligible = eligible
        super().__init__(f"rank {rank} is not eligible here")


class Router:
    __slots__ = (
        "size",
        "policy",
        "max_waiting_per_rank",
        "loads",
        "hello",
        "sent",
        "sent_tokens",
        "inflight",
        "inflight_tokens",
        "_rotate",
        "table_seq",
        "eligible",
        "_pos",
        "_key",
        "_buckets",
        "_heap",
        "_is_routable",
        "num_routable",
        "_token_scores",
        "prefix",
        "kv",
        "cache_weight",
        "_pending_credit",
        "_pending_keys",
        "origin",
        "on_routed",
        "num_api_servers",
        "on_room",
        "count_running",
    )

    def __init__(self, size: int, policy: str = "tokens", max_waiting_per_rank: int = 4096, eligible: list[int] | None = None,
                 kv_events: bool | None = None, cache_weight: float | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}")
        self.size = size
        # the ranks this API server routes to: all (internal, global), its node's (hybrid), one (external)
        self.eligible = list(eligible) if eligible is not None else list(range(size))
        self.policy = policy
        self.max_waiting_per_rank = max_waiting_per_rank
        self.loads: list[RankLoad | None] = [None] * size
        self.hello: list[str | None] = [None] * size  # incarnation heard on our channel
        self.sent = [0] * size  # requests sent since the rank's last table entry
        self.sent_tokens = [0] * size
        self.inflight = [0] * size  # this API server's requests not yet finished
        self.inflight_tokens = [0] * size
        self._rotate = 0
        self.table_seq = 0
        # The index. _pos: rank -> its place in `eligible` (-1: not eligible), the
        # order rotation follows. _key[rank]: the score it is filed under, None
        # while it is no candidate. _buckets: score -> sorted places of the
        # candidates with that score. _heap: scores, lazily cleaned (a score whose
        # bucket emptied stays until it reaches the top).
        self._pos = [-1] * size
        for i, rank in enumerate(self.eligible):
            if 0 <= rank < size:
                self._pos[rank] = i
        self._key: list[int | None] = [None] * size
        self._buckets: dict[int, list[int]] = {}
        self._heap: list[int] = []
        self._is_routable = [False] * size
        self.num_routable = 0  # eligible ranks that are routable, candidates or full
        self._token_scores = policy in ("tokens", "cache-aware")
        self.prefix = PrefixIndex(size) if policy == "cache-aware" else None
        # exact: what the ranks' KV events say they hold (kv_index.py), asked of every rank
        # under cache-aware unless kv_events is False; the approximate index above decides
        # only until the first rank's events arrive (engines without them: never)
        self.kv = KVIndex(size) if policy == "cache-aware" and kv_events is not False else None
        self.cache_weight = cache_weight  # load tokens a cached token one rank alone holds is worth; None: CACHE_WEIGHT
        self._pending_credit = 0  # prompt tokens the last pick's rank holds (exact): not load there
        self._pending_keys: list[int] | None = None  # the last pick's prompt, recorded on its send
        # Sharing with the other API servers (through the coordinator): what this one
        # routed goes to on_routed(rank, keys); what the others routed comes to learn().
        self.origin = ""
        self.on_routed = None
        self.num_api_servers = 0  # registered with the coordinator, as its tables say (0: not known yet)
        # Called when a rank becomes a candidate again (it had no room, or was not routable):
        # requests held at the frontend may go (admission.py). It must not route from inside.
        self.on_room = None
        # Admission held at the frontend: a rank's running sequences count against
        # max_waiting_per_rank too, which is then its batch's places plus the waiting allowed.
        self.count_running = False

    # ---------------------------------------------------------------- the index

    def _refresh(self, rank: int) -> None:
        """Re-file `rank` after anything that feeds its routability or score changed."""
        pos = self._pos[rank]
        if pos < 0:
            return
        load = self.loads[rank]
        routable = load is not None and load.is_alive and self.hello[rank] == load.incarnation
        if routable != self._is_routable[rank]:
            self._is_routable[rank] = routable
            self.num_routable += 1 if routable else -1
            if not routable and self.prefix is not None:
                self.prefix.forget_rank(rank)  # dead or restarting: its cache is gone
        if routable:
            count = load.num_waiting + self.sent[rank]
            if self.count_running:  # (and never fewer than our own in flight there: a table older than our sends reset `sent`)
                count += load.num_running
                if count < self.inflight[rank]:
                    count = self.inflight[rank]
        if not routable or count >= self.max_waiting_per_rank:
            key = None
        elif self._token_scores:  # score(), inlined: this runs for every event
            key = load.num_waiting_prefill_tokens + load.num_remaining_decode_tokens + self.sent_tokens[rank]
            if key < self.inflight_tokens[rank]:
                key = self.inflight_tokens[rank]
        elif self.policy == "queue":
            key = QUEUE_WAITING_WEIGHT * load.num_waiting + load.num_running + self.sent[rank]
            if key < self.inflight[rank]:
                key = self.inflight[rank]
        else:
            key = 0
        old = self._key[rank]
        if key == old:
            return
        buckets = self._buckets
        if old is not None:
            bucket = buckets[old]
            if len(bucket) == 1:
                del buckets[old]
            else:
                del bucket[bisect_left(bucket, pos)]
        if key is not None:
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = [pos]
                heapq.heappush(self._heap, key)
                if len(self._heap) > 2 * len(buckets) + 64:  # too many stale scores: rebuild
                    self._heap = list(buckets)
                    heapq.heapify(self._heap)
            else:
                insort(bucket, pos)
        self._key[rank] = key
        if old is None and self.on_room is not None:
            self.on_room()

    def _lowest_bucket(self) -> list[int] | None:
        heap, buckets = self._heap, self._buckets
        while heap:
            bucket = buckets.get(heap[0])
            if bucket is not None:
                return bucket
            heapq.heappop(heap)
        return None

    # ---------------------------------------------------------------- state changes

    def update_table(self, table: LoadTable) -> list[tuple[int, str]]:
        """Apply a table (every rank, or a delta naming the ranks that changed);
        returns (rank, reason) for ranks that stopped being routable.

        A rank's entry replaces what we knew of it and clears our sends counted
        since its previous entry (the engine has reported since); ranks the
        table does not name keep both. Cost: proportional to the entries.
        """
        if table.seq <= self.table_seq and table.seq != 1:
            return []  # stale or duplicate (seq 1: the coordinator restarted)
        self.table_seq = table.seq
        if table.num_api_servers:  # (a delta, made a table by the reader, does not say)
            self.num_api_servers = table.num_api_servers
        lost = []
        size, loads, hello, sent, sent_tokens, pos = self.size, self.loads, self.hello, self.sent, self.sent_tokens, self._pos
        refresh = self._refresh
        for entry in table.ranks:  # the hot loop of a table: routable() and friends inlined
            rank = entry.rank
            if not 0 <= rank < size:
                continue
            old = loads[rank]
            if old == entry and not sent[rank]:
                continue  # a resync repeating what we hold: nothing to re-file
            loads[rank] = entry
            sent[rank] = 0
            sent_tokens[rank] = 0
            if old is not None and old.is_alive and hello[rank] == old.incarnation:  # it was routable
                if old.incarnation != entry.incarnation:
                    lost.append((rank, "rank restarted"))
                elif not (entry.is_alive and hello[rank] == entry.incarnation):
                    lost.append((rank, entry.down_reason or "rank went down"))
            if pos[rank] >= 0:
                refresh(rank)
        return lost

    def learn(self, msg: PrefixRouted) -> None:
        """Another API server routed these prompts: their ranks hold them (on events: noted until confirmed)."""
        if self.prefix is None or msg.origin == self.origin:
            return
        index = self.kv if self.kv is not None and self.kv.ranks_seen else None
        for rank, keys in msg.routed:
            if 0 <= rank < self.size:
                index.expect(keys, rank, peer=True) if index is not None else self.prefix.add(keys, rank)

    def engine_hello(self, rank: int, incarnation: str) -> bool:
        """Returns True when this hello replaces another incarnation (its requests are lost)."""
        if not 0 <= rank < self.size:
            return False
        replaced = self.hello[rank] is not None and self.hello[rank] != incarnation
        self.hello[rank] = incarnation
        self._refresh(rank)
        return replaced

    def engine_dead(self, rank: int, incarnation: str | None) -> bool:
        if 0 <= rank < self.size and self.hello[rank] == incarnation:
            self.hello[rank] = None
            self._refresh(rank)
            return True
        return False

    def on_send(self, rank: int, tokens: int) -> None:
        credit, self._pending_credit = self._pending_credit, 0
        if self._pending_keys is not None:
            keys, self._pending_keys = self._pending_keys, None
            if self.kv is not None and self.kv.ranks_seen:  # only what it does not hold yet, until its events confirm it
                self.kv.expect(keys := keys[credit // self.kv.block :], rank)
            else:
                self.prefix.add(keys, rank)
            if self.on_routed is not None and keys and self.num_api_servers != 1:  # (alone: no one to tell)
                self.on_routed(rank, keys)
        self.sent[rank] += 1
        # until the rank's next report, what it will prefill: the events say it holds the rest
        self.sent_tokens[rank] += tokens - credit if tokens > credit else 0
        self.inflight[rank] += 1
        self.inflight_tokens[rank] += tokens
        self._refresh(rank)

    def on_progress(self, rank: int, tokens: int) -> None:
        """`tokens` of a request's work on `rank` are done (its prefill, or answer tokens)."""
        self.inflight_tokens[rank] -= tokens
        if self._token_scores:
            self._refresh(rank)

    def on_finish(self, rank: int, tokens: int) -> None:
        self.inflight[rank] -= 1
        self.inflight_tokens[rank] -= tokens
        self._refresh(rank)

    # ---------------------------------------------------------------- queries

    def routable(self, rank: int) -> bool:
        load = self.loads[rank]
        return load is not None and load.is_alive and self.hello[rank] == load.incarnation

    def lost_reason(self, rank: int) -> str:
        """Why the table holds `rank` as lost, or '' (alive, never seen, or registering again)."""
        load = self.loads[rank]
        if load is None or load.is_alive or load.down_reason == "registering":
            return ""
        return load.down_reason or "rank went down"

    def check_pin(self, rank: int) -> None:
        """A pin to a rank this API server does not route to is the client's error."""
        if not 0 <= rank < self.size or self._pos[rank] < 0:
            raise RankNotEligible(rank, self.eligible)

    @property
    def alive_ranks(self) -> list[int]:
        """Ranks the coordinator says are alive, whether or not we heard them yet."""
        return [r for r, load in enumerate(self.loads) if load is not None and load.is_alive]

    @property
    def routable_ranks(self) -> list[int]:
        return [r for r in self.eligible if self.routable(r)]

    def score(self, rank: int) -> int:
        load = self.loads[rank]
        if self._token_scores:
            # Outstanding work in tokens; our own unreported sends count in full,
            # and never less than what we alone still have in flight there: a
            # prompt admitted at once is never reported as waiting, so without
            # this floor a rank busy prefilling a long prompt looks light.
            reported = load.num_waiting_prefill_tokens + load.num_remaining_decode_tokens + self.sent_tokens[rank]
            return max(reported, self.inflight_tokens[rank])
        # queue: the table's counts plus what we sent since it was published,
        # never less than what we alone still have in flight there.
        reported = QUEUE_WAITING_WEIGHT * load.num_waiting + load.num_running + self.sent[rank]
        return max(reported, self.inflight[rank])

    def pick(self, pinned: int | None = None, prompt: list[int] | None = None) -> int:
        """The rank for the next request: the lowest score among the candidates,
        ties going to the first at or after the rotation point (which advances
        by one every pick). Raises NoRankAvailable or QueueFull.

        cache-aware, given the prompt: a rank that probably holds the first d
        blocks of it scores d x BLOCK x max(1, CACHE_WEIGHT / k) tokens less, k
        the ranks holding as much (prefix_index.cheapest_holder), so a
        conversation returns to its rank while that rank is not busier than
        another by more than what its cache is worth; the pin still wins.
        """
        keys = None
        index = self.prefix
        if index is not None and prompt is not None:
            kv = self.kv
            if kv is not None and kv.ranks_seen:
                index, keys = kv, chain_keys(prompt, kv.block)
                self._pending_keys = keys
            else:
                keys = self._pending_keys = chain_keys(prompt)
        if pinned is not None:
            if not self.routable(pinned):
                reason = self.lost_reason(pinned)
                raise RankLost(pinned, reason) if reason else NoRankAvailable(pinned)
            return pinned
        start = self._rotate
        n = len(self.eligible)
        self._rotate = start + 1 if start + 1 < n else 0
        bucket = self._lowest_bucket()
        if bucket is None:
            if self.num_routable:
                raise QueueFull(self.max_waiting_per_rank)
            raise NoRankAvailable()
        i = bisect_left(bucket, start)
        best = self.eligible[bucket[i] if i < len(bucket) else bucket[0]]
        if keys:
            block = index.block if index is self.kv else BLOCK
            best, depth = cheapest_holder(index.entries, keys, best, self._key, index.generation, block,
                                          self.cache_weight or CACHE_WEIGHT)
            if index is self.kv:
                self._pending_credit = depth * block
        return best

    def soonest(self) -> tuple[int, int | None]:
        """(rank, count) of the routable eligible rank with the fewest sequences running and waiting
        (the table's, plus this API server's sends since, never less than its own in flight there);
        (-1, None) when none is routable. A scan (admission.py's soonest_rank, has_place)."""
        best, best_key = -1, None
        for rank in self.eligible:
            if not 0 <= rank < self.size or not self.routable(rank):
                continue
            load = self.loads[rank]
            key = load.num_running + load.num_waiting + self.sent[rank]
            if key < self.inflight[rank]:  # (a table older than our last sends, which reset `sent`)
                key = self.inflight[rank]
            if best_key is None or key < best_key:
                best, best_key = rank, key
        return best, best_key

    def pick_urgent(self, pinned: int | None = None, prompt: list[int] | None = None) -> int:
        """The rank where a request more urgent than the default (priority < 0, under
        --scheduling-policy priority) starts soonest. It passes every waiting request of a
        lower priority there and may preempt running ones, so what delays it is the rank's
        running batch, not its queue: the candidate with the fewest running sequences (plus
        our unreported sends) wins, ties to the lower usual score, then the rotation. A scan
        of the candidates: only such requests pay for it. Raises as pick() does."""
        n = len(self.eligible)
        if pinned is not None or not n:
            return self.pick(pinned, prompt)
        start = self._rotate
        self._rotate = start + 1 if start + 1 < n else 0
        best, best_key = -1, None
        for j in range(n):
            rank = self.eligible[start + j - n if start + j >= n else start + j]
            score = self._key[rank] if 0 <= rank < self.size else None
            if score is None:
                continue  # no candidate: not routable, or at its queue limit
            key = (self.loads[rank].num_running + self.sent[rank], score)
            if best_key is None or key < best_key:
                best, best_key = rank, key
        if best_key is None:
            return self.pick(pinned, prompt)  # raises NoRankAvailable or QueueFull
        if self.prefix is not None and prompt is not None:
            self._pending_keys = chain_keys(prompt, self.kv.block if self.kv is not None and self.kv.ranks_seen else BLOCK)
        return best
