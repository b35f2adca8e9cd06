"""An API server's link to every engine rank and to the coordinator's load table.

Owns the ROUTER socket the engines connect to, the SUB socket for the load
table, the Router, and the table of in-flight RequestStates. Only this module
moves bytes between ZeroMQ and RequestStates; handlers see typed objects.
Invariant: a RequestState is in `requests` from send until it finishes,
fails or is aborted, and its rank's in-flight count covers exactly that span;
until its first output arrives it also holds a timer that fails it (bounded wait).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from dpserve.daemons.api.engine_peers import EnginePeers, Route, route_name
from dpserve.daemons.api.migration import Migrator
from dpserve.daemons.api.request_state import RequestState
from dpserve.daemons.api.router import Router
from dpserve.daemons.coordinator.delta import expand
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineHello,
    EngineInput,
    EngineOutputs,
    EngineToApi,
    LoadDelta,
    LoadTable,
    PauseRequests,
    Ping,
    PrefixRouted,
    ResumeRequests,
    TableChannel,
    TenantTotals,
    TenantUsage,
)
from dpserve.engine.common.sockets import make_socket
from dpserve.engine.kv_events import KVEventBatch, KVSnapshot, KVSnapshotRequest

ACCEPT_BACKLOG = 4096  # pending rank connections (ZeroMQ's default 100 overflowed when 1,024 ranks connect at once)
# Idle ranks pinged a heartbeat (probe_idle): every rank each second up to this many; at
# 1,024 ranks each every 4 s. Through zmq.asyncio a ping costs an API server ~50-75 us:
# at 1,024 ranks a ping each a second was ~1/3 of its CPU after its imports (issue 30).
PROBE_PER_ROUND = 256


def _retrieve(sent: asyncio.Future) -> None:
    if not sent.cancelled():
        sent.exception()  # read, so asyncio does not log it as never retrieved


_TENANT_NEWS = (TenantUsage, TenantTotals)

class EngineClient:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        router: Router,
        engine_address: str,
        table_address: str,
        log,
        keys: CurveKeys | None = None,
        first_token_timeout_s: float = 0.0,
        max_migrations: int = 0,
        migrate_pinned: bool = False,
        wait_for_engine_s: float = 0.0,
    ) -> None:
        self.ctx = ctx
        self.router = router
        self.log = log
        self.requests: dict[str, RequestState] = {}
        self._in_codec = Codec(EngineToApi, "engine outputs")
        self._out_codec = Codec(EngineInput)
        self._table_codec = Codec(TableChannel, "load table")
        # Unbounded queues: a request's outputs are never dropped; an unknown peer is an
        # error (not a silent drop). No handover: a rank connects as "{rank}:{incarnation}"
        # (a restart brings a new identity), and a second peer claiming an identity a
        # live connection holds is ignored by ZeroMQ instead of taking its messages.
        self.engines = make_socket(ctx, zmq.ROUTER, keys, server=True, sndhwm=0, rcvhwm=0, router_mandatory=True)
        self.engines.setsockopt(zmq.BACKLOG, ACCEPT_BACKLOG)  # every rank connects at once at start (issue 30)
        self.engines.bind(engine_address)
        # The same socket without asyncio's futures, to drain what already arrived
        # (~1 us a message instead of ~30 for an await each). Only for receiving:
        # a send through it would skip pyzmq's re-check of the edge-triggered FD,
        # and the reader could then sleep through a reply (measured: a hang).
        self._engines_now = zmq.Socket.shadow(self.engines.underlying)
        self.table = make_socket(ctx, zmq.SUB, keys, connect=table_address, subscribe=b"", reconnect_ms=(100, 2000))
        # Which connection speaks for which rank; a rank is routed only through the identity
        # whose hello named the incarnation the coordinator's table has.
        self.peers = EnginePeers(router, log)
        self._tasks: list[asyncio.Task] = []
        self.table_received = asyncio.Event()
        self.first_token_timeout_s = first_token_timeout_s  # 0: unbounded
        # Set (and replaced) whenever a rank may have become routable; only while
        # someone waits for one, so the table's hot path pays one comparison.
        self._routes_changed = asyncio.Event()
        self.num_route_waiters = 0
        # Requests of lost ranks move on instead of failing (migration.py).
        self.migrator = Migrator(self, max_migrations, migrate_pinned, wait_for_engine_s, log)
        self.on_step: Callable[[int, int], None] | None = None  # (rank, tokens) per engine step's outputs (metrics)
        self.on_tenants: Callable[[object], None] | None = None  # TenantUsage / TenantTotals (tenants/sync.py)
        self._probe_next = 0  # where the next probe_idle round starts in router.eligible

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read_engines(), name="read-engines"),
            asyncio.create_task(self._read_table(), name="read-table"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.fail_all("API server shutting down")
        self.engines.close(0)
        self.table.close(0)

    # ---------------------------------------------------------------- requests

    def _send_now(self, rank: int, data: bytes) -> None:
        """One message to `rank`'s engine; raises zmq.ZMQError when it cannot leave.

        zmq.asyncio never raises from a send: it puts the error (EHOSTUNREACH for
        an identity no peer holds, thanks to ROUTER_MANDATORY) on the returned
        future, which a NOBLOCK send resolves at once. Reading it here is what
        turns a lost send into an error instead of a request that waits forever.
        """
        route = self.peers.identities[rank]
        if route is None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        sent = self.engines.send_multipart([*route, data], zmq.NOBLOCK)
        if sent.done():
            try:
                sent.result()
            except zmq.ZMQError as exc:
                self._lost(rank, f"a send failed: {exc}")
                raise
        else:  # queued behind another send (none of ours block): judge it when it resolves
            sent.add_done_callback(_retrieve)

    def send(self, state: RequestState, req: AddRequest, rank: int) -> None:
        """Hand a request to `rank`; raises zmq.ZMQError if the rank is unreachable
        (then nothing is recorded: the request is neither in flight nor counted)."""
        self._send_now(rank, self._out_codec.encode(req))
        state.rank = rank
        self.requests[state.request_id] = state
        if req.num_prior_outputs or state.migrations:  # a continuation: its prompt and what is left
            state.prefill_left = len(req.prompt_token_ids)
            state.remaining = state.prefill_left + req.params.max_tokens - req.num_prior_outputs
        if not state.t_sent:
            state.t_sent = time.monotonic()
        self.router.on_send(rank, state.remaining)
        if self.first_token_timeout_s > 0:
            loop = asyncio.get_running_loop()
            state.first_token_timer = loop.call_later(self.first_token_timeout_s, self._first_token_overdue, state)

    def _first_token_overdue(self, state: RequestState) -> None:
        state.first_token_timer = None
        if state.request_id not in self.requests or not state.prefill_left or state.is_finished:
            return
        self.abort(state)
        state._fail(f"no output from engine rank {state.rank} within {self.first_token_timeout_s:g} s; the request was aborted", 504)

    def abort(self, state: RequestState) -> None:
        """Forget a request that is not finished (client gone, stop string hit)."""
        state.owner = None
        if self.requests.pop(state.request_id, None) is None:
            self.migrator.forget(state)
            return
        self._stop_timer(state)
        self.router.on_finish(state.rank, state.remaining)
        try:
            self._send_now(state.rank, self._out_codec.encode(AbortRequests([state.request_id])))
        except zmq.ZMQError:
            pass  # the rank is gone, and with it the request

    def pause(self, states: list[RequestState]) -> None:
        """Ask the ranks to stop stepping these requests (their client stopped reading)."""
        for state in states:
            state.paused = True
        self._tell_ranks(states, PauseRequests)

    def resume(self, states: list[RequestState]) -> None:
        """Ask the ranks to step these paused requests again."""
        for state in states:
            state.paused = False
        self._tell_ranks(states, ResumeRequests)

    def _tell_ranks(self, states: list[RequestState], kind: type[PauseRequests] | type[ResumeRequests]) -> None:
        by_rank: dict[int, list[str]] = {}
        for state in states:
            if state.request_id in self.requests:  # (finished or aborted ones are the rank's no more)
                by_rank.setdefault(state.rank, []).append(state.request_id)
        for rank, ids in by_rank.items():
            try:
                self._send_now(rank, self._out_codec.encode(kind(ids)))
            except zmq.ZMQError:
                pass  # the rank is gone, and with it the requests

    # ---------------------------------------------------------------- identities (engine_peers.py)

    def _lost(self, rank: int, why: str) -> None:
        """`rank`'s connection is gone (a send failed): no routing to it until it greets
        again, and a plea for that at once (through the coordinator)."""
        self.peers.lost(rank, why)
        if self.router.engine_dead(rank, self.router.hello[rank]):
            self.log.warning("engine rank unreachable; asking it to reconnect", rank=rank, reason=why)
        self.peers.heal(time.monotonic(), at_once=(rank,))

    def probe_idle(self) -> None:
        """A Ping to every routable rank with none of our requests in flight, PROBE_PER_ROUND
        ranks a call (each heartbeat), round robin: a connection that went away shows as a
        failed send within size / PROBE_PER_ROUND heartbeats (at once up to 256 ranks), then
        _lost pleads, not at the next request. Busy ranks need none: their next send tells."""
        router, ping = self.router, None
        eligible = router.eligible
        if len(eligible) > PROBE_PER_ROUND:
            start = self._probe_next % len(eligible)
            eligible = (eligible[start:] + eligible[:start])[:PROBE_PER_ROUND]
            self._probe_next = start + PROBE_PER_ROUND
        for rank in eligible:
            if 0 <= rank < router.size and router.inflight[rank] == 0 and router.routable(rank):
                ping = ping or self._out_codec.encode(Ping(0))
                try:
                    self._send_now(rank, ping)
                except zmq.ZMQError:
                    pass

    def _accept(self, rank: int, incarnation: str, peer: Route) -> None:
        self.peers.bind(rank, peer)
        if self.router.engine_hello(rank, incarnation):
            self.lose_rank(rank, f"engine rank {rank} restarted")
        if len(peer) > 1:  # through its node's hop (--rank-links node)
            self.log.info("engine connected", rank=rank, incarnation=incarnation, via=route_name(peer[:-1]))
        else:
            self.log.info("engine connected", rank=rank, incarnation=incarnation)
        self.notify_routes()
        if self.router.kv is not None:
            self._ask_kv_snapshot(rank)  # and its KV events from then on (kv_index.py)

    def _ask_kv_snapshot(self, rank: int) -> None:
        try:
            self._send_now(rank, self._out_codec.encode(KVSnapshotRequest(rank)))
        except zmq.ZMQError:
            pass  # gone: its hello will ask again

    # ---------------------------------------------------------------- waiting for a rank

    def notify_routes(self) -> None:
        """Wake requests waiting for a rank (routing may have changed, or we drain)."""
        if self.num_route_waiters:
            self._routes_changed.set()
            self._routes_changed = asyncio.Event()

    async def wait_routes(self, timeout: float) -> bool:
        """Wait until routing may have changed; False once `timeout` passed without."""
        if timeout <= 0:
            return False
        self.num_route_waiters += 1
        try:
            async with asyncio.timeout(timeout):
                await self._routes_changed.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self.num_route_waiters -= 1

    def lose_rank(self, rank: int, reason: str, abort: bool = False) -> tuple[int, int]:
        """`rank` no longer holds its in-flight requests: each moves to another rank
        (migration.py) or, if it may not, ends with an error. `abort`: the rank may
        still be running them (it is judged down, not known dead): ask it to stop.
        Returns (moved, failed)."""
        lost = [s for s in self.requests.values() if s.rank == rank]
        if abort and lost:
            try:
                self._send_now(rank, self._out_codec.encode(AbortRequests([s.request_id for s in lost])))
            except zmq.ZMQError:
                pass
        failed = 0
        for state in lost:
            self._finish(state)
            if not self.migrator.move(state, reason):
                failed += 1
                self.migrator.num_failed += 1
                why = self.migrator.why_not(state)
                state._fail(f"{reason}; the request could not move to another rank: {why}" if why else reason)
        return len(lost) - failed, failed

    def fail_all(self, reason: str) -> None:
        self.migrator.fail_all(reason)
        for state in list(self.requests.values()):
            self._finish(state)
            state._fail(reason)

    def _finish(self, state: RequestState) -> None:
        if self.requests.pop(state.request_id, None) is not None:
            self._stop_timer(state)
            self.router.on_finish(state.rank, state.remaining)

    @staticmethod
    def _stop_timer(state: RequestState) -> None:
        if state.first_token_timer is not None:
            state.first_token_timer.cancel()
            state.first_token_timer = None

    # ---------------------------------------------------------------- readers

    async def _read_engines(self) -> None:
        requests = self.requests
        now = self._engines_now
        while True:
            frames = await self.engines.recv_multipart(copy=False)
            while True:
                # The route: the rank's identity, or its node hop's and its own (--rank-links node).
                route = (frames[0].bytes,) if len(frames) == 2 else tuple(f.bytes for f in frames[:-1])
                try:
                    self._handle_engine_message(route, frames[-1], requests)
                except Exception:  # a peer's message must never end the reader (and with it every request)
                    self.peers.stray(route, "a message that could not be applied")
                    self.log.exception("engine message could not be applied", peer=route_name(route))
                try:
                    frames = now.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break

    def _handle_engine_message(self, peer: Route, data, requests: dict[str, RequestState]) -> None:
        """Apply one message from an engine (outputs, hello, death) to the requests;
        what a peer says about a rank counts only from that rank's connection."""
        try:
            msg = self._in_codec.decode(data.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):  # counted and logged (rate-limited), with its peer
            msg = self._in_codec.decode_or_none(data.buffer, route_name(peer))
        if type(msg) is EngineOutputs:
            if not self.peers.outputs_from(peer, msg.rank):
                return
            step_tokens = 0  # this API server's share of the step's tokens (vllm:iteration_tokens_total)
            for out in msg.outputs:
                state = requests.get(out.request_id)
                if state is None or state.rank != msg.rank:  # (a rank it moved from)
                    continue
                step_tokens += len(out.new_token_ids) + state.prefill_left
                if state.first_token_timer is not None:
                    self._stop_timer(state)
                if out.finish_reason is not None:
                    self._finish(state)
                    state.owner = None
                else:
                    done = min(len(out.new_token_ids) + state.prefill_left, state.remaining)
                    state.prefill_left = 0
                    state.remaining -= done
                    self.router.on_progress(state.rank, done)
                state.push(out)
            if self.on_step is not None:
                self.on_step(msg.rank, step_tokens)
            kv = msg.kv
            if kv is not None and kv.rank == msg.rank and self.router.kv is not None and self.router.kv.apply(kv):
                self._ask_kv_snapshot(msg.rank)  # (the step's KV events ride with its outputs: issue 29)
        elif type(msg) is EngineHello:
            if self.peers.hello(peer, msg):
                self._accept(msg.rank, msg.incarnation, peer)
            elif msg.rank in self.peers.contested:
                self.peers.contested.discard(msg.rank)
                try:  # is the first connection still there? (a send to a gone one fails: _lost pleads)
                    self._send_now(msg.rank, self._out_codec.encode(Ping(0)))
                except zmq.ZMQError:
                    pass
        elif type(msg) is KVEventBatch or type(msg) is KVSnapshot:  # issue 29: a step's without outputs, or a snapshot
            if self.peers.outputs_from(peer, msg.rank) and self.router.kv is not None and self.router.kv.receive(msg):
                self._ask_kv_snapshot(msg.rank)
        elif type(msg) is EngineDead:
            if self.peers.death_notice(peer, msg.rank, msg.incarnation) and self.router.engine_dead(msg.rank, msg.incarnation):
                moved, failed = self.lose_rank(msg.rank, msg.reason)
                # A stop that was asked for is news, not trouble: `journalctl -p warning` stays quiet.
                say = self.log.info if msg.clean and not failed else self.log.warning
                say("engine announced its death", rank=msg.rank, reason=msg.reason, moved_requests=moved, failed_requests=failed)

    async def _read_table(self) -> None:
        now = zmq.Socket.shadow(self.table.underlying)
        while True:
            data = await self.table.recv(copy=False)
            while True:
                self._apply_table(data)
                try:
                    data = now.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break

    def _apply_table(self, data) -> None:
        table = self._table_codec.decode_or_none(data.buffer)
        if table is None:
            return
        if type(table) is PrefixRouted:
            self.router.learn(table)
            return
        if type(table) in _TENANT_NEWS:
            if self.on_tenants is not None:
                self.on_tenants(table)  # tenants/sync.py: the other API servers' usage, the cluster's totals
            return
        if type(table) is LoadDelta:  # loads only: the entries we hold, with their new load
            table = LoadTable(table.seq, table.data_parallel_size, expand(table, self.router.loads))
        for rank, reason in self.router.update_table(table):
            moved, failed = self.lose_rank(rank, f"engine rank {rank} is down: {reason}", abort=True)
            self.log.warning("rank left routing", rank=rank, reason=reason, moved_requests=moved, failed_requests=failed)
        for rank, incarnation, peer in self.peers.take_heard(table):
            self._accept(rank, incarnation, peer)
        self.table_received.set()
        self.notify_routes()
