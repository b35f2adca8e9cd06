"""Requests that outlive their rank: a request whose rank is lost or drained moves on.

When a rank goes (it announced its death, the load table says it is down, it came
back as a new incarnation, or a worker node vanished), each request it held is sent
again to another rank as a continuation: the prompt's ids plus every id the request
produced so far (those the handler took and those still pending), with the original
sampling parameters and AddRequest.num_prior_outputs saying how many of the ids are
outputs. The engine prefills them and goes on (engine/sequence.py: max_tokens,
min_tokens, penalties, the seeded position and the grammar all count them), so the
client sees a pause, never an error, a duplicate or a gap.

The RequestState stays the same object across the move: its handler keeps waiting
on it, with its detokenizer, stop strings, logprobs and usage, and never knows. What
moves is bounded: --max-migrations per request (then a clear 503), pinned requests
only with --migrate-pinned, and a request with no rank to go to waits at most
--wait-for-engine-s for one.

Invariant: a moving state is either in flight on exactly one rank (EngineClient.requests)
or in `waiting` here, never both; an abort from its handler removes it from either.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
import zmq
from dpserve.daemons.api.router import RoutingError
from dpserve.engine.common.protocol import AddRequest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from dpserve.daemons.api.engine_client import EngineClient
    from dpserve.daemons.api.request_state import RequestState


def continuation(state: RequestState) -> AddRequest:
    """The message that resumes `state` elsewhere: its Generation's prompt and every output so far."""
    gen = state.owner
    produced = gen.output_ids + state.pending
    if not produced:  # nothing came back yet: the same request again (prompt logprobs and all)
        return AddRequest(state.request_id, gen.prompt_ids, gen.params, time.time())
    # Prompt logprobs came with the first output, which the client has.
    params = gen.params if gen.params.prompt_logprobs is None else msgspec.structs.replace(gen.params, prompt_logprobs=None)
    return AddRequest(state.request_id, gen.prompt_ids + produced, params, time.time(), len(produced))


class Migrator:
    """Moves the requests of lost ranks. Owned by the EngineClient, which calls
    move() instead of failing a request, and forget() when a handler aborts one."""

    def __init__(self, client: EngineClient, max_migrations: int, migrate_pinned: bool, wait_s: float, log) -> None:
        self.client = client
        self.max_migrations = max_migrations
        self.migrate_pinned = migrate_pinned
        self.wait_s = wait_s
        self.log = log
        self.waiting: dict[str, tuple[RequestState, float]] = {}  # moving, with no rank yet: (state, deadline)
        self._task: asyncio.Task | None = None
        self.num_moved = 0  # requests sent again (metrics)
        self.num_failed = 0  # requests that could not move

    def why_not(self, state: RequestState) -> str | None:
        """None if `state` may move, else why it fails instead."""
        if state.owner is None:
            return "it cannot be resent"
        if not self.max_migrations:
            return "migration is off (--max-migrations 0)"
        if state.pinned and not self.migrate_pinned:
            return "it is pinned by X-data-parallel-rank (--migrate-pinned lets it move)"
        if state.migrations >= self.max_migrations:
            return f"it already moved {state.migrations} times (--max-migrations {self.max_migrations})"
        return None

    def move(self, state: RequestState, reason: str) -> bool:
        """Send `state` (no longer in flight anywhere) to another rank, now or once one can
        take it; False (nothing done) when it may not move: the caller fails it."""
        if self.why_not(state) is not None:
            return False
        state.migrations += 1
        if not self._send(state):
            self.waiting[state.request_id] = (state, time.monotonic() + self.wait_s)
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._place_waiting(), name="migrate")
        return True

    def forget(self, state: RequestState) -> bool:
        """Its handler gave up on a moving request (client gone, stop string): True if it was here."""
        return self.waiting.pop(state.request_id, None) is not None

    def _send(self, state: RequestState) -> bool:
        """Route and send a continuation; False when no rank can take it right now."""
        client = self.client
        req = continuation(state)
        for _ in range(client.router.size):
            try:
                rank = client.router.pick(None, req.prompt_token_ids)
            except RoutingError:  # none routable, every queue full: wait (_place_waiting)
                return False
            try:
                client.send(state, req, rank)
            except zmq.ZMQError:
                client.router.engine_dead(rank, client.router.hello[rank])
                continue
            self.num_moved += 1
            if state.paused:  # its client is still behind: the new rank holds it too
                client.pause([state])
            return True
        return False

    async def _place_waiting(self) -> None:
        """Send the moving requests as ranks become routable; fail each that waited its
        --wait-for-engine-s (the wait a new request gets too)."""
        while self.waiting:
            now = time.monotonic()
            for rid, (state, deadline) in list(self.waiting.items()):
                if self._send(state):
                    del self.waiting[rid]
                elif now >= deadline:
                    del self.waiting[rid]
                    self.num_failed += 1
                    state._fail(f"its rank was lost and no other rank could take it within {self.wait_s:g} s")
            if self.waiting:
                await self.client.wait_routes(min(d for _, d in self.waiting.values()) - now + 0.001)

    def fail_all(self, reason: str) -> None:
        for state, _ in self.waiting.values():
            state._fail(reason)
        self.waiting.clear()
        if self._task is not None:
            self._task.cancel()


class MigrationCollector:
    """The moves on /metrics (labelled with the API server's index)."""

    def __init__(self, migrator: Migrator, index: int) -> None:
        self.migrator, self.label = migrator, [str(index)]

    def collect(self):
        m, label = self.migrator, self.label
        moved = CounterMetricFamily("dpserve_api_requests_migrated", "Requests sent again to another rank after theirs was lost or stopped.", labels=["api_server"])
        moved.add_metric(label, m.num_moved)
        failed = CounterMetricFamily("dpserve_api_requests_migration_failed", "Requests whose rank was lost and that could not move (pinned, moved too often, no rank in time).", labels=["api_server"])
        failed.add_metric(label, m.num_failed)
        moving = GaugeMetricFamily("dpserve_api_requests_moving", "Requests whose rank was lost, waiting for another rank now.", labels=["api_server"])
        moving.add_metric(label, len(m.waiting))
        yield from (moved, failed, moving)
