"""One rank's side of the wire: its sockets, registration, greetings, request
delivery, outputs and load reports. The rank process and the simulated engine
both speak through RankIO, so a protocol change has one place to go.

RankIO never polls and never owns a loop: its owner polls the sockets it is
handed through `watch` (one poller per process; the simulated engine puts many
ranks behind one) and gives each readable socket back to read(). It never
blocks on a send: a gone API server must never stall a step.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable

import zmq
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import (
    GREET_API_RESTARTED,
    GREET_NO_HELLO,
    AbortRequests,
    AddRequest,
    ApiServerList,
    CoordinatorInput,
    CoordinatorToEngine,
    EngineDead,
    EngineHello,
    EngineInput,
    EngineOutputs,
    EngineReady,
    EngineRegister,
    EngineToApi,
    GreetAgain,
    LoadReport,
    PauseRequests,
    Ping,
    PleaseRegister,
    Pong,
    RankDown,
    RegisterReply,
    RequestOutput,
    ResumeRequests,
)
from dpserve.engine.common.sockets import make_socket
from dpserve.engine.interface import RankEngine
from dpserve.engine.kv_events import KVPublisher, KVSnapshotRequest
from zmq.utils.monitor import recv_monitor_message

COORDINATOR = -1  # read()'s index for a message from the coordinator
LOAD_REPORT_MIN_INTERVAL_S = 0.002  # at most one report per 2 ms while load changes
REGISTER_RETRY_S = 2.0
REGISTER_UNSENT_RETRY_S = 0.1  # a hello that found no connection to the head is tried again this soon
REGREET_MIN_INTERVAL_S = 1.0  # a GreetAgain more often than this for one API server is ignored
# A plea for want of a hello (GREET_NO_HELLO) on a connection made this
# recently is answered with a hello, not a new connection: the hello was late (a busy API
# server or rank), not lost to a stale pipe. Remaking it made a loaded cluster's start a
# loop of pleas, reconnects and failed sends to the old identity (1,024 ranks x 8 API
# servers: 70-100 s to routable, issue 30). A failed send still remakes the connection.
FRESH_CONNECTION_S = 10.0

# What on_coordinator() reports about a registration.
WELCOMED = "welcomed"
REFUSED = "refused"


class RankIO:
    """The ZeroMQ sockets of one rank: a DEALER to the coordinator, one DEALER per API server.

    Invariants: `owner[request_id]` is the index of the API-server socket that
    sent the request, for every request the engine still holds. `num_finished`
    and `num_aborted` count this incarnation's requests, as the load report says.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        keys: CurveKeys | None,
        *,
        rank: int,
        incarnation: str,
        fingerprint: str,
        node_rank: int,
        coordinator_address: str,
        log,
        watch: Callable[[zmq.Socket], None],
        watch_monitors: bool = True,
        monitors: bool = True,
        hop: Callable[[str], str] | None = None,
        link: Callable[[str, bytes], object] | None = None,
    ) -> None:
        """`watch(sock)` is called for every socket the owner must poll and hand to
        read(). With `watch_monitors` False the owner does not poll the connection
        monitors: a new connection is greeted at once and reconnections when the
        owner calls greet_reconnections(). With `monitors` False there are none (a
        simulated cluster's thousands of connections): an API server that restarts
        is greeted when it asks, through the coordinator (GreetAgain).
        `sent`, when the owner sets it, collects every socket a message was sent on:
        an owner that polls ZeroMQ's FDs itself must look at them again (a send can
        take in messages without the FD signalling).
        `hop(address)`, when given (`--rank-links node`), returns the node-local address
        through which this rank reaches the API server at `address` (engine/rank/node_hop.py):
        the rank connects there, without CURVE (the node's hop holds the API server's link).
        `link(address, identity)`, when given, makes this rank's link to an API server
        instead of a socket of its own: a simulated node's one connection, shared by its
        ranks (engine/testing/sim.py: send, setsockopt(IDENTITY), connect, disconnect,
        close); the owner hands what arrives for this rank to take()."""
        self.ctx, self.keys, self.log = ctx, keys, log
        self.rank, self.incarnation = rank, incarnation
        self._registration = EngineRegister(rank, incarnation, fingerprint, os.getpid(), socket.gethostname(), node_rank)
        self.coordinator_address = coordinator_address
        self.watch, self.watch_monitors, self.use_monitors = watch, watch_monitors, monitors
        self.hop = hop
        self.link = link
        self.sent: set[zmq.Socket] | None = None
        self.in_codec = Codec(EngineInput, "requests")
        self.out_codec = Codec(EngineToApi)
        self.kv = KVPublisher(rank, incarnation)  # KV events to the API servers that asked (issue 29)
        self.coord_codec = Codec(CoordinatorInput | CoordinatorToEngine, "coordinator")
        self.coordinator = make_socket(
            ctx, zmq.DEALER, keys, identity=f"engine-{rank}-{incarnation}".encode(), reconnect_ms=(100, 2000),
        )
        # IMMEDIATE: with no head yet a send is dropped, not queued, so a worker started
        # before its head does not greet it once per register_and_wait retry when it appears.
        self.coordinator.setsockopt(zmq.IMMEDIATE, 1)
        self.coordinator.connect(coordinator_address)
        watch(self.coordinator)
        self.api: list[zmq.Socket] = []
        self.api_addresses: list[str] = []
        self.api_targets: list[str] = []  # where each API socket connects: the API server, or the node's hop for it
        self.monitors: dict[zmq.Socket, int] = {}  # monitor -> index of the API socket it watches
        self._reconnected: dict[int, float] = {}  # API socket index -> when GreetAgain last reconnected it
        self._connected_at: dict[int, float] = {}  # API socket index -> when its connection was last made
        self._num_reconnects = 0
        self._index: dict[zmq.Socket, int] = {self.coordinator: COORDINATOR}
        self.owner: dict[str, int] = {}
        self.registered = False
        self.last_register = -math.inf
        self.num_finished = 0
        self.num_aborted = 0
        self.load_dirty = False  # the load changed since the last report
        self._last_load: tuple = ()
        self.last_report = -math.inf  # monotonic time of the last LoadReport
        # Where LoadReports go: the coordinator's socket, or the node's relay (issue 30),
        # which sends its ranks' reports in one NodeLoad (engine/rank/node_relay.py).
        self.load_sink: Callable[[LoadReport], None] = self.report

    # ---------------------------------------------------------------- membership

    def register(self) -> None:
        """Send EngineRegister (HELLO); the coordinator answers with RegisterReply.
        With no connection to the head yet the hello is dropped, and last_register
        says to retry within REGISTER_UNSENT_RETRY_S."""
        self.last_register = time.monotonic()
        try:
            self._note_sent(self.coordinator)
            self.coordinator.send(self.coord_codec.encode(self._registration), zmq.NOBLOCK)
        except zmq.Again:
            self.last_register -= REGISTER_RETRY_S - REGISTER_UNSENT_RETRY_S

    def register_and_wait(self, should_stop: Callable[[], bool]) -> bool:
        """HELLO every REGISTER_RETRY_S until the coordinator answers; False if it refused.
        Returns True also when should_stop() ends the wait (the caller checks it)."""
        started = time.monotonic()
        while not should_stop():
            # Writable (IMMEDIATE) once the head's connection is up: the hello goes at once then.
            if self.coordinator.poll(REGISTER_RETRY_S * 1000, zmq.POLLOUT):
                self.register()
                if self.coordinator.poll(REGISTER_RETRY_S * 1000):
                    for msg in self._coordinator_messages():
                        if isinstance(msg, RegisterReply):
                            return self.on_coordinator(msg) == WELCOMED
                    continue
            waited = time.monotonic() - started
            if int(waited) % 10 < REGISTER_RETRY_S:
                self.log.info("waiting for the coordinator", address=self.coordinator_address, waited_s=round(waited, 1))
        return True

    def on_coordinator(self, msg: object) -> str | None:
        """Membership changes: new API servers, a coordinator that lost us, its answer to a
        registration (WELCOMED or REFUSED is returned for that; the owner then reports load)."""
        if isinstance(msg, ApiServerList):
            self.connect_api_servers(msg.api_server_addresses)
        elif isinstance(msg, GreetAgain):
            self.reconnect(msg.address, msg.reason)
        elif isinstance(msg, PleaseRegister):
            self.log.warning("coordinator asks us to register again", reason=msg.reason)
            self.register()
        elif isinstance(msg, RegisterReply):
            if not msg.accepted:
                self.log.error("coordinator refused registration", reason=msg.reason)
                return REFUSED
            self.connect_api_servers(msg.api_server_addresses)
            self.registered = True
            self.report(EngineReady(self.rank, self.incarnation))
            return WELCOMED
        return None

    def connect_api_servers(self, addresses: list[str]) -> None:
        """One DEALER per API server, added as API servers appear (never removed:
        a lost one is simply reconnected by ZeroMQ when it returns). Each
        (re)connection is greeted with EngineHello, so an API server that
        restarted learns this rank again without a new handshake.

        The identity is "{rank}:{incarnation}": an API server takes a rank's hello only
        from the connection holding that identity, and (no ROUTER_HANDOVER) a second
        connection can never take an identity a live one holds."""
        for address in addresses:
            if address in self.api_addresses:
                continue
            target = self.hop(address) if self.hop is not None else address
            if self.link is not None:
                sock, monitor = self.link(address, self.api_identity), None
            else:
                sock = make_socket(
                    self.ctx, zmq.DEALER, None if self.hop is not None else self.keys, identity=self.api_identity,
                    sndhwm=0, rcvhwm=0, reconnect_ms=(50, 1000),
                )
                monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) if self.use_monitors else None
                sock.connect(target)
            index = len(self.api)
            self._connected_at[index] = time.monotonic()
            if monitor is not None:
                self.monitors[monitor] = index
            self._index[sock] = index
            self.api.append(sock)
            self.api_addresses.append(address)
            self.api_targets.append(target)
            if self.link is None:
                self.watch(sock)
            if self.watch_monitors and monitor is not None:
                self.watch(monitor)
            else:  # queued until the connection is up: no wait for the owner's next greeting round
                self.send_to(index, EngineHello(self.rank, self.incarnation))

    @property
    def api_identity(self) -> bytes:
        """This incarnation's ZeroMQ identity on every API server's engine socket (a
        connection remade on a GreetAgain adds ":{n}", see reconnect)."""
        return f"{self.rank}:{self.incarnation}".encode()

    def reconnect(self, address: str, reason: str = "") -> None:
        """A fresh connection to the API server at `address` (it cannot route to us),
        greeted again: the monitor sees the handshake, and a hello is queued at once
        for owners that poll no monitors. While requests of that API server are in
        flight here the link evidently works and a reconnect would drop their queued
        outputs, so it is only greeted again; so is one made within FRESH_CONNECTION_S
        that lacks only our hello (it was late, not lost). A plea repeated within
        REGREET_MIN_INTERVAL_S is ignored (anyone on the coordinator's socket can plead)."""
        if address not in self.api_addresses:
            return
        index = self.api_addresses.index(address)
        if reason.startswith(GREET_API_RESTARTED):  # the coordinator saw it come back: only a hello is wanted
            if self.hop is not None or self.link is not None or not self.use_monitors:
                self.send_to(index, EngineHello(self.rank, self.incarnation))
            return  # (a monitored connection of our own greeted the new handshake already)
        now = time.monotonic()
        if now - self._reconnected.get(index, -math.inf) < REGREET_MIN_INTERVAL_S:
            return
        self._reconnected[index] = now
        sock = self.api[index]
        late = reason.startswith(GREET_NO_HELLO) and now - self._connected_at.get(index, -math.inf) < FRESH_CONNECTION_S
        if index in self.owner.values() or late:
            self.log.info("an api server cannot route to us; greeting it again", api_server=address, reason=reason)
            self.send_to(index, EngineHello(self.rank, self.incarnation))
            return
        # A fresh identity for the fresh connection: the API server may still hold the old
        # one's pipe, and ZeroMQ ignores a second connection claiming an identity in use.
        self._num_reconnects += 1
        sock.setsockopt(zmq.IDENTITY, self.api_identity + f":{self._num_reconnects}".encode())
        self.log.warning("an api server cannot route to us; reconnecting", api_server=address, reason=reason)
        try:
            sock.disconnect(self.api_targets[index])
        except zmq.ZMQError:
            pass  # not connected now: connect() below is the whole cure
        if self.hop is not None:  # through the node's hop: ask for it again (a node that lost it reopens it)
            self.api_targets[index] = self.hop(address)
        sock.connect(self.api_targets[index])
        self._connected_at[index] = now
        self.send_to(index, EngineHello(self.rank, self.incarnation))

    def greet_reconnections(self, monitor: zmq.Socket | None = None) -> None:
        """EngineHello on every completed (re)connection that `monitor` (default: every monitor) saw."""
        for mon in (monitor,) if monitor is not None else self.monitors:
            while True:
                try:
                    recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.send_to(self.monitors[mon], EngineHello(self.rank, self.incarnation))

    # ---------------------------------------------------------------- in

    def read(self, sock: zmq.Socket) -> list[tuple[int, object]]:
        """Every message waiting on one of this rank's sockets, tagged with its
        API-server index (COORDINATOR for the coordinator); a monitor is answered
        with greetings and yields nothing. Undecodable messages are dropped by Codec."""
        if sock in self.monitors:
            self.greet_reconnections(sock)
            return []
        index = self._index[sock]
        if index == COORDINATOR:
            return [(COORDINATOR, msg) for msg in self._coordinator_messages()]
        got = []
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            if (msg := self.in_codec.decode_or_none(frame.buffer, self.api_addresses[index])) is not None:
                got.append((index, msg))

    def is_api_socket(self, sock: object) -> bool:
        """Whether `sock` is one of the API servers' (not the coordinator's, a monitor or another fd)."""
        return self._index.get(sock, COORDINATOR) != COORDINATOR and sock not in self.monitors

    def take(self, link: object, data) -> tuple[int, object] | None:
        """A message that arrived for this rank on a shared `link` (see __init__), tagged
        with its API-server index, or None if it does not decode."""
        index = self._index[link]
        msg = self.in_codec.decode_or_none(data, self.api_addresses[index])
        return None if msg is None else (index, msg)

    def _coordinator_messages(self) -> list[object]:
        got = []
        while True:
            try:
                data = self.coordinator.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            if (msg := self.coord_codec.decode_or_none(data, self.coordinator_address)) is not None:
                got.append(msg)

    def deliver(self, index: int, msg: object, engine: RankEngine) -> None:
        """An API server's message to `engine`: a request, an abort, a pause or resume, or a ping."""
        if isinstance(msg, AddRequest):
            self.owner[msg.request_id] = index
            rejected = engine.add_request(msg)
            if rejected is not None:
                self.send_outputs([rejected], engine)
        elif isinstance(msg, AbortRequests):
            engine.abort_requests(msg.request_ids)
            for rid in msg.request_ids:
                if self.owner.pop(rid, None) is not None:
                    self.num_aborted += 1
        elif isinstance(msg, PauseRequests):
            engine.pause_requests(msg.request_ids)
        elif isinstance(msg, ResumeRequests):
            engine.resume_requests(msg.request_ids)
        elif isinstance(msg, Ping):
            self.send_to(index, Pong(self.rank, msg.nonce))
        elif isinstance(msg, KVSnapshotRequest):
            self.kv.on_request(self, index, engine)

    # ---------------------------------------------------------------- out

    def send_outputs(self, outputs: list[RequestOutput], engine: RankEngine) -> None:
        """Every API server its share of `outputs`, and the step's KV events if it subscribed,
        in one message each (a subscriber with no outputs this step gets the events alone)."""
        by_owner: dict[int, list[RequestOutput]] = {}
        owner = self.owner
        for out in outputs:
            if out.finish_reason is not None:
                self.num_finished += 1
            index = owner.get(out.request_id)
            if index is None:
                continue  # aborted while in flight: the API server forgot it too
            by_owner.setdefault(index, []).append(out)
            if out.finish_reason is not None:
                del owner[out.request_id]
        kv = self.kv.take(engine)
        for index, outs in by_owner.items():
            msg = EngineOutputs(self.rank, outs, engine.num_running, engine.num_waiting)
            if kv is not None and index in self.kv.subscribers:
                msg.kv = kv
            self._send(self.api[index], self.out_codec.encode(msg))
        if kv is not None:
            for index in self.kv.subscribers:
                if index not in by_owner:
                    self.send_to(index, kv)

    def send_to(self, index: int, msg: object) -> None:
        self._send(self.api[index], self.out_codec.encode(msg))

    def broadcast(self, msg: object) -> None:
        data = self.out_codec.encode(msg)
        for sock in self.api:
            self._send(sock, data)

    def announce_death(self, reason: str, linger_s: float | None = None, clean: bool = False) -> None:
        """EngineDead to every API server (`clean`: a stop that was asked for), and
        RankDown to the coordinator, so that routing and every node's readiness
        drop the rank at once, not after the silence limit (the coordinator
        believes it only from this incarnation's own connection). With
        `linger_s`, the sockets are closed with that linger so that the news
        leaves before the process does."""
        self.broadcast(EngineDead(self.rank, self.incarnation, reason, clean))
        if self.registered:
            self.report(RankDown(self.rank, reason))
        if linger_s is not None:
            for sock in (*self.api, self.coordinator):
                sock.close(linger=int(linger_s * 1000))

    def report(self, msg: object) -> None:
        """A message to the coordinator (dropped if it cannot be queued: the next report follows)."""
        try:
            self._note_sent(self.coordinator)
            self.coordinator.send(self.coord_codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _note_sent(self, sock: zmq.Socket) -> None:
        if self.sent is not None:
            self.sent.add(sock)

    def report_load(self, engine: RankEngine, now: float, *, force: bool = False, every_s: float = math.inf) -> bool:
        """A LoadReport if forced, if the last is `every_s` old (the heartbeat), or if the
        load changed and the last is LOAD_REPORT_MIN_INTERVAL_S old; a change held back
        leaves `load_dirty` set. Nothing before registration. Returns whether one went."""
        if not self.registered:
            return False
        load = (engine.num_running, engine.num_waiting, engine.num_waiting_prefill_tokens, self.num_finished,
                self.num_aborted, round(engine.kv_usage, 3))
        changed = load != self._last_load
        since = now - self.last_report
        self.load_dirty = changed
        if not (force or since >= every_s or (changed and since >= LOAD_REPORT_MIN_INTERVAL_S)):
            return False
        self.load_dirty = False
        self._last_load = load
        self.last_report = now
        self.load_sink(
            LoadReport(
                self.rank, self.incarnation, engine.num_running, engine.num_waiting, engine.num_waiting_prefill_tokens,
                engine.num_remaining_decode_tokens, engine.slot_usage, engine.last_step_ms, self.num_finished,
                self.num_aborted, engine.kv_usage, engine.num_preemptions, engine.num_prefix_queries, engine.num_prefix_hits,
            )
        )
        return True

    def _send(self, sock: zmq.Socket, data: bytes) -> None:
        if self.sent is not None:
            self.sent.add(sock)
        try:
            sock.send(data, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass  # closed for the death announcement, or the peer is gone for good
