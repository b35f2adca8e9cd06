"""Rank selection for one API server: load table + own unreported sends -> a rank.

Pure state and arithmetic, no sockets, so it is tested directly. A rank is
routable only while the coordinator says it is alive AND this API server has
heard the same engine incarnation say hello on its own channel; otherwise a
request could be sent into a socket nobody reads.
"""

from __future__ import annotations

from dpserve.engine.protocol import LoadTable, RankLoad

from .openai_types import ApiError

QUEUE_WAITING_WEIGHT = 4  # vLLM's `4 x waiting + running`


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
    )

    def __init__(self, size: int, policy: str = "tokens", max_waiting_per_rank: int = 4096, eligible: list[int] | None = None) -> None:
        self.size = size
        # the ranks this API server routes to: all (internal, global), its node's (hybrid), one (external)
        self.eligible = list(eligible) if eligible is not None else list(range(size))
        self.policy = policy
        self.max_waiting_per_rank = max_waiting_per_rank
        self.loads: list[RankLoad | None] = [None] * size
        self.hello: list[str | None] = [None] * size  # incarnation heard on our channel
        self.sent = [0] * size  # requests sent since the last table
        self.sent_tokens = [0] * size
        self.inflight = [0] * size  # this API server's requests not yet finished
        self.inflight_tokens = [0] * size
        self._rotate = 0
        self.table_seq = 0

    # ---------------------------------------------------------------- state changes

    def update_table(self, table: LoadTable) -> list[tuple[int, str]]:
        """Apply a new table; returns (rank, reason) for ranks that stopped being routable."""
        if table.seq <= self.table_seq and table.seq != 1:
            return []  # stale or duplicate (seq 1: the coordinator restarted)
        self.table_seq = table.seq
        lost = []
        for entry in table.ranks:
            if not 0 <= entry.rank < self.size:
                continue
            was = self.routable(entry.rank)
            old = self.loads[entry.rank]
            self.loads[entry.rank] = entry
            if was and old is not None and old.incarnation != entry.incarnation:
                lost.append((entry.rank, "rank restarted"))
            elif was and not self.routable(entry.rank):
                lost.append((entry.rank, entry.down_reason or "rank went down"))
        self.sent = [0] * self.size
        self.sent_tokens = [0] * self.size
        return lost

    def engine_hello(self, rank: int, incarnation: str) -> bool:
        """Returns True when this hello replaces another incarnation (its requests are lost)."""
        if not 0 <= rank < self.size:
            return False
        replaced = self.hello[rank] is not None and self.hello[rank] != incarnation
        self.hello[rank] = incarnation
        return replaced

    def engine_dead(self, rank: int, incarnation: str) -> bool:
        if 0 <= rank < self.size and self.hello[rank] == incarnation:
            self.hello[rank] = None
            return True
        return False

    def on_send(self, rank: int, tokens: int) -> None:
        self.sent[rank] += 1
        self.sent_tokens[rank] += tokens
        self.inflight[rank] += 1
        self.inflight_tokens[rank] += tokens

    def on_progress(self, rank: int, tokens: int) -> None:
        """`tokens` of a request's work on `rank` are done (its prefill, or answer tokens)."""
        self.inflight_tokens[rank] -= tokens

    def on_finish(self, rank: int, tokens: int) -> None:
        self.inflight[rank] -= 1
        self.inflight_tokens[rank] -= tokens

    # ---------------------------------------------------------------- queries

    def routable(self, rank: int) -> bool:
        load = self.loads[rank]
        return load is not None and load.is_alive and self.hello[rank] == load.incarnation

    def check_pin(self, rank: int) -> None:
        """A pin to a rank this API server does not route to is the client's error."""
        if rank not in self.eligible:
            ranks = ", ".join(map(str, self.eligible))
            raise ApiError(
                400,
                f"X-data-parallel-rank {rank} is not served through this API server; it routes to rank(s) {ranks}.",
                param="X-data-parallel-rank",
                code="invalid_rank",
            )

    @property
    def alive_ranks(self) -> list[int]:
        """Ranks the coordinator says are alive, whether or not we heard them yet."""
        return [r for r, load in enumerate(self.loads) if load is not None and load.is_alive]

    @property
    def routable_ranks(self) -> list[int]:
        return [r for r in self.eligible if self.routable(r)]

    def score(self, rank: int) -> int:
        load = self.loads[rank]
        if self.policy == "tokens":
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

    def pick(self, pinned: int | None = None) -> int:
        """The rank for the next request, or an ApiError (503/429) when none can take it."""
        if pinned is not None:
            if not self.routable(pinned):
                raise ApiError(
                    503,
                    f"Rank {pinned} is not serving right now.",
                    type="service_unavailable",
                    code="rank_unavailable",
                    headers={"Retry-After": "1"},
                )
            return pinned
        eligible = self.eligible
        n = len(eligible)
        start = self._rotate
        self._rotate = (start + 1) % n
        best = -1
        best_score = 0
        any_routable = False
        for i in range(n):
            rank = eligible[(start + i) % n]
            if not self.routable(rank):
                continue
            any_routable = True
            load = self.loads[rank]
            if load.num_waiting + self.sent[rank] >= self.max_waiting_per_rank:
                continue
            if self.policy == "round-robin":
                return rank
            s = self.score(rank)
            if best < 0 or s < best_score:
                best, best_score = rank, s
        if best >= 0:
            return best
        if any_routable:
            raise ApiError(
                429,
                "Every rank is at its waiting-queue limit; retry shortly.",
                type="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        raise ApiError(
            503,
            "No engine rank is serving right now.",
            type="service_unavailable",
            code="no_rank_available",
            headers={"Retry-After": "2"},
        )


def parse_rank_header(value: str | None, size: int) -> int | None:
    """X-data-parallel-rank: None when absent, else an int in [0, size) or a 400."""
    if value is None:
        return None
    # ASCII digits only: int() would also take " 1 ", "+1", "0_1" and non-ASCII digits.
    if not (value.isascii() and value.isdigit()):
        raise ApiError(
            400,
            f"X-data-parallel-rank must be an integer in [0, {size}); got {value[:40]!r}.",
            param="X-data-parallel-rank",
            code="invalid_rank",
        )
    # (a long run of digits is out of range without int(), which refuses past 4,300 digits)
    rank = int(value) if len(value) <= 9 else size
    if not 0 <= rank < size:
        raise ApiError(
            400,
            f"X-data-parallel-rank {value[:20]} is out of range: this deployment has ranks 0..{size - 1}.",
            param="X-data-parallel-rank",
            code="invalid_rank",
        )
    return rank
