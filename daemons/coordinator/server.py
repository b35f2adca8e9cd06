"""The coordinator's process: its sockets, its loop, and its link to the supervisor.

It owns the cluster's view of which ranks exist, which are alive and how
loaded each is. Engines register (HELLO -> WELCOME, refused on a protocol or
config mismatch or a rank already held), then stream LoadReports; the
coordinator publishes to every API server the entries of the ranks that
changed (at most every publish_interval_s: a LoadTable for a membership
change, a compact LoadDelta for a load change), and every rank every
resync_interval (and at once when an API server joins) so a subscriber that
missed a message or just joined catches up; an empty table at least every
second tells the nodes the head is there. Every message names at most
MAX_RANKS_PER_TABLE (LoadDelta: MAX_RANKS_PER_DELTA) ranks, so publishing
costs what changed, and no message grows with the cluster past that bound.
A node's ranks report in one NodeLoad from its relay (issue 30) or, each, in
their own LoadReports. It never sees a request or a token.

The rank state and its rules live in registry.py (RankTable), which API
servers an engine serves in routing.py, the CURVE handshake warnings in
handshakes.py; this module only moves messages between them and the sockets.
"""

from __future__ import annotations

import math
import os
import signal
import time
from functools import partial

import msgspec
import zmq
from dpserve.daemons.config import CoordinatorConfig
from dpserve.daemons.coordinator.handshakes import HandshakeWatch
from dpserve.daemons.coordinator.registry import (
    EXPIRE_EVERY_S,
    PUBLISH_KEEPALIVE_S,
    RankTable,
    publish_interval,
    resync_interval,
    wake_interval,
)
from dpserve.daemons.coordinator.routing import routes_to
from dpserve.daemons.coordinator.tenants import TenantAccounts
from dpserve.engine.common.auth import CurveKeys, start_authenticator
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.logs import setup_logging
from dpserve.engine.common.procutil import (
    EXIT_CONFIG,
    EXIT_OK,
    SupervisorLink,
    child_config_from_env,
    die_with_parent,
    set_process_name,
)
from dpserve.engine.common.protocol import (
    GREET_API_RESTARTED,
    ApiServerList,
    ApiServerRegister,
    CoordinatorInput,
    CoordinatorToEngine,
    EngineReady,
    EngineRegister,
    GreetAgain,
    LoadDelta,
    LoadReport,
    LoadTable,
    NodeHello,
    NodeLoad,
    PleaseRegister,
    PrefixRouted,
    RankDown,
    RegisterReply,
    TenantTotals,
    TenantUsage,
)
from dpserve.engine.common.sockets import make_socket, peer_name

GREET_LOG_EVERY_S = 10.0
# New API servers reach the ranks in one ApiServerList each this often at most: at start 32 API
# servers register within a second or two, and a list to every rank per registration was
# 32 x 1,024 messages (a fifth of the coordinator's start, issue 30).
API_LIST_EVERY_S = 0.05
QUIET_REASONS = ("engine shut down", "drained")  # stops that were asked for: news, not trouble
RETIRED_PREFIX = "retired"  # a supervisor's RankDown whose reason says so retires the rank (dpserve retire)
# Node messages wait and are applied together (a few numpy steps a batch, ~100 us
# whatever its size), at most this long and never past a publish or an expiry scan:
# at 4,096 ranks (82 ms between publishes) a batch is ~100 messages, not ~10.
NODE_APPLY_MAX_S = 0.02
ACCEPT_BACKLOG = 4096  # pending connections on the engines socket (Linux caps it at somaxconn)


class Coordinator:
    """One process, one thread: the loop below is the only reader and writer of its state."""

    def __init__(self, cfg: CoordinatorConfig, log) -> None:
        self.cfg = cfg
        self.log = log
        self.ctx = zmq.Context()
        self.codec = Codec(CoordinatorInput | CoordinatorToEngine, "coordinator input")
        self.table_codec = Codec(LoadTable | LoadDelta)
        self.keys = CurveKeys.from_file(cfg.key_file, log) if cfg.key_file else None
        self.auth = start_authenticator(self.ctx, self.keys, log)
        self.engines = make_socket(self.ctx, zmq.ROUTER, self.keys, server=True)
        # Every rank and node relay connects at once at start: with ZeroMQ's default
        # backlog (100) a burst of ipc connects overflowed and some never came through
        # (4,096 ranks: ~200 ranks of nodes never heard, issue 30).
        self.engines.setsockopt(zmq.BACKLOG, ACCEPT_BACKLOG)
        self.engines.bind(cfg.engines_address)
        self.poller = zmq.Poller()
        self.poller.register(self.engines, zmq.POLLIN)
        # Multi-node: peers that fail the CURVE handshake are seen by the socket's monitor only.
        self.handshakes = HandshakeWatch(self.engines, cfg.engines_address, log) if self.keys is not None else None
        if self.handshakes is not None:
            self.poller.register(self.handshakes.monitor, zmq.POLLIN)
        self.pub = make_socket(self.ctx, zmq.PUB, self.keys, bind=cfg.table_address, sndhwm=10_000)
        # API servers anywhere in the cluster: (node_rank, index) -> address
        self.api_servers: dict[tuple[int, int], str] = {}
        self.api_incarnations: dict[tuple[int, int], str] = {}
        # registered engines: rank -> (zmq identity, node_rank)
        self.engine_peers: dict[int, tuple[bytes, int]] = {}
        self._asked_to_register: dict[bytes, float] = {}
        self._greet_logged: dict[int, float] = {}  # rank -> when a GreetAgain for it was last logged
        self.supervisor = SupervisorLink(self.ctx, cfg.supervisor_address, cfg.name)
        self.table = RankTable(cfg.data_parallel_size, cfg.fingerprint, cfg.stale_after_s)
        self.should_stop = False
        self.last_publish = 0.0
        self.last_full_publish = 0.0
        self.last_expire = 0.0
        self.last_wake = 0.0
        self.publish_interval_s = publish_interval(cfg.data_parallel_size)
        self.resync_interval_s = resync_interval(cfg.data_parallel_size)
        self.last_heartbeat = 0.0
        self.api_list_due: float | None = None  # when the ranks get the new list of API servers (coalesced)
        self.last_api_list = -math.inf
        self.nodes: list[NodeLoad] = []  # node messages not applied yet (_apply_nodes)
        self.nodes_at = 0.0  # when the first of them was drained
        self.node_apply_s = min(NODE_APPLY_MAX_S, self.publish_interval_s / 2)
        # One pass of the loop costs ~20 us before any message is read: waking at most
        # this often lets messages gather into one pass (registry.wake_interval).
        self.loop_min_interval_s = wake_interval(cfg.data_parallel_size)
        self.last_apply = 0.0
        self.num_tables_published = 0
        self.tenants = TenantAccounts()  # tenant accounting (tenants.py): counted, forwarded, totals each second
        self.tenants_codec = Codec(TenantTotals)

    def _on_signal(self, signum, _frame) -> None:
        self.should_stop = True

    def run(self) -> int:
        self.supervisor.ready("coordinator")
        self.log.info("coordinator ready", data_parallel_size=self.cfg.data_parallel_size, fingerprint=self.cfg.fingerprint)
        while not self.should_stop:
            # 1. Wait for messages, but never past the next publish or heartbeat.
            ready = dict(self.poller.poll(self._poll_timeout_ms()))
            gap = self.loop_min_interval_s - (time.monotonic() - self.last_wake)
            if ready and gap > 0:
                time.sleep(gap)
            self.last_wake = time.monotonic()
            if self.engines in ready:
                self._drain()
            now = time.monotonic()
            if self.handshakes is not None:
                self.handshakes.note(self.handshakes.monitor in ready, now)
            # 2. Apply the node messages that waited; retire ranks that went quiet.
            if self.nodes and (now - self.last_apply >= self.node_apply_s or now - self.last_expire >= EXPIRE_EVERY_S):
                self._apply_nodes(now)
            if now - self.last_expire >= EXPIRE_EVERY_S:
                self.last_expire = now
                for rank in self.table.expire(now):
                    self.log.warning("rank stopped reporting; taken out of routing", rank=rank)
            # 3. Publish what changed (rate-limited), every rank each resync, and
            #    something at least once a second.
            if now - self.last_full_publish >= self.resync_interval_s:
                self._publish(full=True, now=now)
            elif (self.table.dirty and now - self.last_publish >= self.publish_interval_s) or (
                now - self.last_publish >= PUBLISH_KEEPALIVE_S
            ):
                self._publish(full=False, now=now)
            if self.tenants.due(now):
                self.pub.send(self.tenants_codec.encode(self.tenants.publish(now)))
            # 4. Heartbeat to the supervisor from this loop only.
            if self.api_list_due is not None and now >= self.api_list_due:
                self._push_api_servers(now)
            if now - self.last_heartbeat >= self.cfg.heartbeat_interval_s:
                self.supervisor.heartbeat()
                self.last_heartbeat = now
        return EXIT_OK

    def _publish(self, full: bool, now: float) -> None:
        for table in self.table.tables(full, keepalive=True):
            if type(table) is LoadTable:  # an API server alone shares no routed prefixes (Router.on_send)
                table.num_api_servers = len(self.api_servers)
            self.pub.send(self.table_codec.encode(table))
            self.num_tables_published += 1
        self.last_publish = now
        if full:
            self.last_full_publish = now

    def _apply_nodes(self, now: float) -> None:
        # Heard as of the batch's first drain: a rank seems at most node_apply_s older, never younger.
        for rank, incarnation in self.table.node_loads(self.nodes, self.nodes_at):  # not held here: to the rank's own socket
            self._ask_to_register(f"engine-{rank}-{incarnation}".encode(), now, f"rank {rank} is not registered here")
        self.nodes = []
        self.last_apply = now

    def _poll_timeout_ms(self) -> int:
        """Until the next thing due, rounded up: rounded down, the last millisecond
        before a publish was a busy loop of zero-timeout polls."""
        now = time.monotonic()
        until_full = min(self.resync_interval_s - (now - self.last_full_publish), PUBLISH_KEEPALIVE_S - (now - self.last_publish))
        until_expire = EXPIRE_EVERY_S - (now - self.last_expire)  # a silent cluster's last rank must expire on time too
        due = min(until_full, until_expire, self.cfg.heartbeat_interval_s)
        if self.table.dirty:
            due = min(due, self.publish_interval_s - (now - self.last_publish))
        if self.nodes:
            due = min(due, self.node_apply_s - (now - self.last_apply))
        if self.api_list_due is not None:
            due = min(due, self.api_list_due - now)
        return max(0, math.ceil(due * 1000))

    def _drain(self) -> None:
        now = time.monotonic()
        decode, table = self.codec.decode, self.table
        recv, more = self.engines.recv, partial(self.engines.getsockopt, zmq.RCVMORE)
        nodes = self.nodes
        if not nodes:
            self.nodes_at = now
        while True:
            # Two recv() calls and one getsockopt, not recv_multipart() (nor the `rcvmore`
            # attribute, a slow generic lookup): a third of the cost a message, which
            # matters at 10,000 reports a second. A ROUTER message is [identity, body];
            # a peer that sent more frames gets them dropped.
            try:
                identity = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            data = recv(zmq.NOBLOCK)  # (a ROUTER's identity frame always has a frame after it)
            if more():
                while more():
                    recv(zmq.NOBLOCK)
                continue
            try:
                msg = decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):  # counted and logged (rate-limited), with its peer
                msg = self.codec.decode_or_none(data, peer_name(identity))
            if type(msg) is NodeLoad:
                nodes.append(msg)  # applied together, as arrays (_apply_nodes)
                continue
            if type(msg) is LoadReport:
                if not table.load(msg, now):
                    self._ask_to_register(identity, now, f"rank {msg.rank} is not registered here")
                continue
            if type(msg) is TenantUsage:
                self.tenants.take(msg, now)
                self.pub.send(data)  # every API server charges its buckets with it
                continue
            if type(msg) is PrefixRouted:
                if len(self.api_servers) > 1:
                    self.pub.send(data)  # every other API server learns what one routed; nothing kept here
                continue
            if msg is None:
                continue
            self._handle_control(identity, msg, now)

    def _handle_control(self, identity: bytes, msg: object, now: float) -> None:
        """Everything but load reports: registration, readiness, API servers, rank loss."""
        if isinstance(msg, EngineRegister):
            reason = self.table.register(msg, now)
            if reason:
                self.log.error("engine registration refused", rank=msg.rank, host=msg.host, pid=msg.pid, reason=reason)
                reply = RegisterReply(False, reason, [])
            else:
                self.log.info("engine registered", rank=msg.rank, host=msg.host, pid=msg.pid, node_rank=msg.node_rank)
                self.engine_peers[msg.rank] = (identity, msg.node_rank)
                reply = RegisterReply(True, "", self._addresses_for(msg.node_rank))
            self._send(identity, reply)
        elif isinstance(msg, EngineReady):
            if self.table.ready(msg, now):
                self.log.info("rank in routing", rank=msg.rank)
            else:
                self._ask_to_register(identity, now, f"rank {msg.rank} is not registered here")
        elif isinstance(msg, ApiServerRegister):
            key = (msg.node_rank, msg.index)
            known = self.api_incarnations.get(key)
            self.api_incarnations[key] = msg.incarnation
            if self.api_servers.get(key) != msg.address:
                self.api_servers[key] = msg.address
                self.log.info("api server registered", node_rank=msg.node_rank, index=msg.index, address=msg.address)
                if self.api_list_due is None:  # the first at once, then at most every API_LIST_EVERY_S
                    self.api_list_due = max(now, self.last_api_list + API_LIST_EVERY_S)
                self.last_full_publish = 0.0  # it needs every rank now, not in a second
            elif known not in (None, msg.incarnation):
                self._greet_restarted(msg)
        elif isinstance(msg, NodeHello):
            self.table.node_address(msg.node_rank, msg.address)
        elif isinstance(msg, RankDown):
            self._rank_down(identity, msg)
        elif isinstance(msg, GreetAgain):
            self._greet_again(msg, now)

    def _rank_down(self, identity: bytes, msg: RankDown) -> None:
        """A rank's death, announced by the engine itself (its last words) or by its
        node's supervisor (a process exit it saw, or a retirement). An engine speaks
        only for its own incarnation: an old incarnation's late word never takes down
        its successor."""
        if msg.reason.startswith(RETIRED_PREFIX) and not identity.startswith(b"engine-"):
            if self.table.retire(msg.rank, msg.reason):  # its node's supervisor: the rank leaves the cluster
                self.engine_peers.pop(msg.rank, None)
                self.log.info("rank retired: out of the cluster", rank=msg.rank, reason=msg.reason)
            return
        incarnation = None
        if identity.startswith(b"engine-"):
            rank, _, incarnation = identity[7:].decode(errors="replace").partition("-")
            if rank != str(msg.rank):
                return
        if self.table.down(msg.rank, msg.reason, incarnation):
            level = self.log.info if msg.reason.startswith(QUIET_REASONS) else self.log.warning
            level("rank taken out of routing", rank=msg.rank, reason=msg.reason)

    def _greet_again(self, msg: GreetAgain, now: float) -> None:
        """An API server cannot route to a registered rank: pass its plea on (the rank
        reconnects and says hello). Logged at most every GREET_LOG_EVERY_S per rank."""
        peer = self.engine_peers.get(msg.rank)
        if peer is None:
            return  # not registered here: its registration will bring it to every API server
        self._send(peer[0], msg)
        if now - self._greet_logged.get(msg.rank, -GREET_LOG_EVERY_S) >= GREET_LOG_EVERY_S:
            self._greet_logged[msg.rank] = now
            self.log.warning("an api server cannot route to a rank; asked it to reconnect", rank=msg.rank, api_server=msg.address, reason=msg.reason)

    def _greet_restarted(self, msg: ApiServerRegister) -> None:
        """An API server came back at its address: every rank that serves it is asked to say
        hello at once (GREET_API_RESTARTED), instead of after the API server's plea (a second
        or more): a rank behind its node's hop has no connection of its own that could show it."""
        self.log.info("api server restarted; its ranks greet it", node_rank=msg.node_rank, index=msg.index, address=msg.address)
        self.last_full_publish = 0.0
        mode = self.cfg.lb_mode
        for rank, (identity, node_rank) in self.engine_peers.items():
            if routes_to(mode, msg.node_rank, node_rank):
                self._send(identity, GreetAgain(rank, msg.address, GREET_API_RESTARTED))

    def _addresses_for(self, node_rank: int) -> list[str]:
        """The API servers an engine on `node_rank` serves: all of them, or its own node's."""
        mode = self.cfg.lb_mode
        return [a for (node, _), a in sorted(self.api_servers.items()) if routes_to(mode, node, node_rank)]

    def _push_api_servers(self, now: float) -> None:
        """Every registered rank the API servers it serves (one list encoded a node)."""
        self.api_list_due, self.last_api_list = None, now
        lists: dict[int, bytes] = {}
        for identity, node_rank in self.engine_peers.values():
            data = lists.get(node_rank)
            if data is None:
                data = lists[node_rank] = self.codec.encode(ApiServerList(self._addresses_for(node_rank)))
            try:
                self.engines.send_multipart([identity, data], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the peer is gone; it will register again when it returns

    def _ask_to_register(self, identity: bytes, now: float, reason: str) -> None:
        if now - self._asked_to_register.get(identity, 0.0) >= 1.0:
            self._asked_to_register[identity] = now
            self._send(identity, PleaseRegister(reason))

    def _send(self, identity: bytes, msg: object) -> None:
        try:
            self.engines.send_multipart([identity, self.codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone; it will register again when it returns

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)


def main() -> None:
    cfg = child_config_from_env(CoordinatorConfig)
    die_with_parent(cfg.parent_pid)
    set_process_name("dpserve-coord")
    log = setup_logging(cfg.name, cfg.log_level)
    try:
        coord = Coordinator(cfg, log)
    except zmq.ZMQError as exc:
        # Another head holds the port: a configuration error (exit 2), which
        # systemd must not restart in a loop; the supervisor checks first and
        # names the flag, this covers a port taken in between.
        log.error("cannot bind the coordinator's ports", engines=cfg.engines_address, table=cfg.table_address, error=str(exc), hint="another head on this --data-parallel-rpc-port?")
        os._exit(EXIT_CONFIG)
    signal.signal(signal.SIGTERM, coord._on_signal)
    signal.signal(signal.SIGINT, coord._on_signal)
    try:
        code = coord.run()
    finally:
        coord.close()
    log.info("coordinator stopped")
    os._exit(code)


if __name__ == "__main__":
    main()
