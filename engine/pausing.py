"""Paused requests of the native engine: requests whose clients stopped reading.

Owns which sequences the engine must not step and where a paused sequence
waits. A running one stays in the scheduler's `running` list, keeping its slot
and KV blocks, and the scheduler skips it (Scheduler.paused); a waiting one (or
one that KV pressure preempted while paused) is parked: out of the waiting
queue, owning nothing, until resumed. It must never step or free anything.
"""

from __future__ import annotations

from collections.abc import Iterable

from dpserve.engine.scheduler import Scheduler
from dpserve.engine.sequence import Sequence, SequenceStatus


class PausedRequests:
    """Invariant: every id in `scheduler.paused` is a running sequence's, or a
    preempted one's in `waiting` until the next park_preempted(); `parked` holds
    paused sequences that are in neither queue (the engine core still owns them)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.parked: dict[str, Sequence] = {}

    def pause(self, request_ids: Iterable[str], requests: dict[str, Sequence]) -> None:
        scheduler, parking = self.scheduler, set()
        for rid in request_ids:
            seq = requests.get(rid)
            if seq is None or rid in self.parked or rid in scheduler.paused:
                continue  # finished, aborted, unknown, or paused already
            if seq.status is SequenceStatus.RUNNING:
                scheduler.paused.add(rid)
            else:
                parking.add(rid)
        if parking:
            self._park(parking)

    def resume(self, request_ids: Iterable[str]) -> None:
        """Step these again; a parked one joins the end of the waiting queue (recomputed if preempted)."""
        for rid in request_ids:
            self.scheduler.paused.discard(rid)
            seq = self.parked.pop(rid, None)
            if seq is not None:
                self.scheduler.add(seq)

    def forget(self, request_ids: set[str]) -> None:
        """These requests left the engine (aborted)."""
        self.scheduler.paused -= request_ids
        for rid in request_ids:
            self.parked.pop(rid, None)

    def park_preempted(self) -> None:
        """Before a schedule: paused sequences that preemption sent back to the queue leave it."""
        scheduler = self.scheduler
        if scheduler.paused and scheduler.waiting:
            back = {s.request_id for s in scheduler.waiting if s.request_id in scheduler.paused}
            if back:
                self._park(back)

    def _park(self, ids: set[str]) -> None:
        for seq in [s for s in self.scheduler.waiting if s.request_id in ids]:
            self.parked[seq.request_id] = seq
        self.scheduler.remove(ids)
        self.scheduler.paused -= ids

    @property
    def has_work(self) -> bool:
        """Whether the scheduler has anything to step besides paused sequences."""
        scheduler = self.scheduler
        if not scheduler.paused:
            return scheduler.has_unfinished
        return bool(scheduler.waiting) or len(scheduler.running) > len(scheduler.paused)
