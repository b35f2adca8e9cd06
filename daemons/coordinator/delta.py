"""The load table's compact form (issue 30): a rank whose load changed while its
membership did not travels as one LoadDelta row, ~1/3 of a LoadTable entry's
bytes. Pure functions of protocol structs, shared by the coordinator (rows out)
and by every reader of the table (rows back into RankLoads); no sockets. A row
never carries membership (incarnation, liveness, node, address): that only
travels in LoadTables, so a reader never guesses it.
"""

from __future__ import annotations

import msgspec
import numpy as np
from dpserve.engine.common.protocol import LoadDelta, RankLoad

MAX_RANKS_PER_DELTA = 1024  # ~20 KiB of msgpack
ROW_WIDTH = 11  # ints a rank in LoadDelta.loads


def runs_of(ranks) -> list[tuple[int, int]]:
    """Sorted ranks (a list or an array) as (first, count) runs of consecutive ranks:
    2-6 bytes a run instead of up to 3 a rank (the ranks of a busy cluster change together)."""
    r = np.asarray(ranks, np.int64)
    if not len(r):
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(r) != 1) + 1))
    counts = np.diff(np.concatenate((starts, [len(r)])))
    return list(zip(r[starts].tolist(), counts.tolist()))


def expand(delta: LoadDelta, held: list[RankLoad | None]) -> list[RankLoad]:
    """The delta's rows as entries that replace `held[rank]` (membership kept);
    rows for ranks outside `held` or not held yet are skipped (their LoadTable
    comes with the next resync)."""
    out = []
    replace, size = msgspec.structs.replace, len(held)
    rows = zip(*[iter(delta.loads)] * ROW_WIDTH)  # the flat list, ROW_WIDTH at a time
    for rank, row in zip(delta.ranks, rows):
        if not 0 <= rank < size or (old := held[rank]) is None:
            continue
        run, wait, prefill, decode, slot, fin, abort, kv, pre, pq, ph = row
        out.append(replace(
            old, num_running=run, num_waiting=wait, num_waiting_prefill_tokens=prefill,
            num_remaining_decode_tokens=decode, slot_usage=slot / 1000, num_requests_finished=fin,
            num_requests_aborted=abort, kv_usage=kv / 1000, num_preemptions=pre, num_prefix_queries=pq,
            num_prefix_hits=ph,
        ))
    return out
