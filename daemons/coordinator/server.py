"""The coordinator: registers engine ranks and publishes the per-rank load table.

It owns the cluster's view of which ranks exist, which are alive and how
loaded each is. Engines register (HELLO -> WELCOME, refused on a protocol or
config mismatch or a rank already held), then stream LoadReports; the
coordinator publishes to every API server the entries of the ranks that
changed (at most every publish_interval_s), and every rank once a second
(and at once when an API server joins) so a subscriber that missed a message
or just joined catches up. Every LoadTable names at most MAX_RANKS_PER_TABLE
ranks, so publishing costs what changed, and no message grows with the
cluster past that bound. It never sees a request or a token.
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import zmq
from dpserve.daemons.config import CoordinatorConfig
from dpserve.engine.common.auth import HANDSHAKE_EVENTS, CurveKeys, describe_handshake_failure, start_authenticator
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
    PROTOCOL_VERSION,
    ApiServerList,
    ApiServerRegister,
    Codec,
    CoordinatorInput,
    CoordinatorToEngine,
    EngineReady,
    EngineRegister,
    LoadReport,
    LoadTable,
    NodeHello,
    PleaseRegister,
    PrefixRouted,
    RankDown,
    RankLoad,
    RegisterReply,
)
from dpserve.engine.common.sockets import make_socket
from zmq.utils.monitor import parse_monitor_message

PUBLISH_MIN_INTERVAL_S = 0.002
# Under load every busy rank's entry changes every step, and each API server
# pays ~3 us an entry it applies. Publishing changes at most every size x this
# (2 ms up to 100 ranks, 5 ms at 256, 20 ms at 1,024) bounds that to ~50,000
# entries/s per API server whatever the cluster size; API servers count their
# own sends in between (vLLM's coordinator publishes every 100 ms).
PUBLISH_INTERVAL_PER_RANK_S = 0.00002
PUBLISH_MAX_INTERVAL_S = 0.1
PUBLISH_KEEPALIVE_S = 1.0  # every rank, this often: the resync
MAX_RANKS_PER_TABLE = 256  # ~16 KiB of msgpack
EXPIRE_EVERY_S = 0.1  # the staleness scan visits every rank: not on every message
# One pass of the loop costs ~20 us before any message is read; at 1,024 ranks
# reporting every 100 ms (10,240 reports/s) a pass per report would be 20% of
# a core. Waking at most this often lets reports gather into one pass.
LOOP_MIN_INTERVAL_S = 0.002
HANDSHAKE_WARN_EVERY_S = 10.0  # a peer with another key retries ~10 times a second


def publish_interval(data_parallel_size: int) -> float:
    """The shortest gap between two publishes of changed ranks, for this cluster size."""
    return min(PUBLISH_MAX_INTERVAL_S, max(PUBLISH_MIN_INTERVAL_S, data_parallel_size * PUBLISH_INTERVAL_PER_RANK_S))


class RankTable:
    """Every rank's registration and last load. Pure state: no sockets, testable alone.

    Invariant: a rank is alive only between its EngineReady and the next
    RankDown (or a newer registration, or going stale).
    """

    def __init__(self, data_parallel_size: int, fingerprint: str, stale_after_s: float) -> None:
        self.size = data_parallel_size
        self.fingerprint = fingerprint
        self.stale_after_s = stale_after_s
        self.ranks: dict[int, RankLoad] = {}
        self.last_seen: dict[int, float] = {}
        self.seq = 0
        self.dirty = True
        self.changed: set[int] = set()  # ranks whose entry changed since the last delta
        self.node_addresses: dict[int, str] = {}  # node_rank -> address, from NodeHello (for /status)

    def register(self, msg: EngineRegister, now: float) -> str:
        """'' when accepted, else the reason for refusal."""
        if msg.protocol_version != PROTOCOL_VERSION:
            return f"protocol version {msg.protocol_version} != coordinator's {PROTOCOL_VERSION}"
        if msg.fingerprint != self.fingerprint:
            return f"config fingerprint {msg.fingerprint} != head's {self.fingerprint} (model, dtype, max-model-len or data-parallel-size differ)"
        if not 0 <= msg.rank < self.size:
            return f"rank {msg.rank} is outside data-parallel-size {self.size}"
        held = self.ranks.get(msg.rank)
        if (
            held is not None
            and held.is_alive
            and held.incarnation != msg.incarnation
            and now - self.last_seen.get(msg.rank, 0.0) < self.stale_after_s
        ):
            return f"rank {msg.rank} is already served by a live engine (incarnation {held.incarnation})"
        self.ranks[msg.rank] = RankLoad(
            msg.rank, msg.incarnation, is_alive=False, down_reason="registering",
            node_rank=msg.node_rank, host=msg.host, address=self.node_addresses.get(msg.node_rank, ""), since=time.time(),
        )
        self.last_seen[msg.rank] = now
        self._touch(msg.rank)
        return ""

    def _touch(self, rank: int) -> None:
        self.changed.add(rank)
        self.dirty = True

    def ready(self, msg: EngineReady, now: float) -> bool:
        entry = self.ranks.get(msg.rank)
        if entry is None or entry.incarnation != msg.incarnation:
            return False
        entry.is_alive = True
        entry.down_reason = ""
        entry.since = time.time()
        self.last_seen[msg.rank] = now
        self._touch(msg.rank)
        return True

    def load(self, msg: LoadReport, now: float) -> bool:
        """False when the report comes from an engine this table does not hold."""
        entry = self.ranks.get(msg.rank)
        if entry is None or entry.incarnation != msg.incarnation:
            return False
        if not entry.is_alive and entry.down_reason != "registering":
            return False  # declared lost: it must register again
        self.last_seen[msg.rank] = now
        if (
            entry.num_running == msg.num_running
            and entry.num_waiting == msg.num_waiting
            and entry.num_waiting_prefill_tokens == msg.num_waiting_prefill_tokens
            and entry.num_remaining_decode_tokens == msg.num_remaining_decode_tokens
            and entry.num_requests_finished == msg.num_requests_finished
            and entry.num_requests_aborted == msg.num_requests_aborted
            and entry.num_preemptions == msg.num_preemptions
            and entry.num_prefix_hits == msg.num_prefix_hits
            and entry.num_prefix_queries == msg.num_prefix_queries
            and entry.kv_usage == msg.kv_usage
            and entry.slot_usage == msg.slot_usage
        ):
            return True  # a heartbeat: nothing to publish
        entry.num_running = msg.num_running
        entry.num_waiting = msg.num_waiting
        entry.num_waiting_prefill_tokens = msg.num_waiting_prefill_tokens
        entry.num_remaining_decode_tokens = msg.num_remaining_decode_tokens
        entry.slot_usage = msg.slot_usage
        entry.num_requests_finished = msg.num_requests_finished
        entry.num_requests_aborted = msg.num_requests_aborted
        entry.kv_usage = msg.kv_usage
        entry.num_preemptions = msg.num_preemptions
        entry.num_prefix_queries = msg.num_prefix_queries
        entry.num_prefix_hits = msg.num_prefix_hits
        self._touch(msg.rank)
        return True

    def node_address(self, node_rank: int, address: str) -> None:
        """A node's supervisor said where it is: its ranks' entries name it."""
        if self.node_addresses.get(node_rank) == address:
            return
        self.node_addresses[node_rank] = address
        for rank, entry in self.ranks.items():
            if entry.node_rank == node_rank:
                entry.address = address
                self._touch(rank)

    def down(self, rank: int, reason: str) -> bool:
        entry = self.ranks.get(rank)
        if entry is None or not entry.is_alive:
            return False
        entry.is_alive = False
        entry.down_reason = reason
        entry.since = time.time()
        entry.num_running = entry.num_waiting = 0
        self._touch(rank)
        return True

    def expire(self, now: float) -> list[int]:
        """Ranks that stopped reporting: marked down, returned for the log."""
        gone = [
            r for r, e in self.ranks.items() if e.is_alive and now - self.last_seen.get(r, 0.0) > self.stale_after_s
        ]
        for rank in gone:
            self.down(rank, f"no load report for {self.stale_after_s:.0f} s")
        return gone

    def snapshot(self) -> LoadTable:
        """Every rank in one table (tests and tools; publishing uses tables())."""
        self.seq += 1
        self.dirty = False
        self.changed.clear()
        return LoadTable(self.seq, self.size, [self.ranks[r] for r in sorted(self.ranks)])

    def tables(self, full: bool) -> list[LoadTable]:
        """The next messages to publish: the ranks that changed since the last
        call (or every rank, when `full`), at most MAX_RANKS_PER_TABLE each,
        each with its own seq. Empty when nothing changed."""
        ranks = sorted(self.ranks) if full else sorted(self.changed)
        self.changed.clear()
        self.dirty = False
        out = []
        for i in range(0, len(ranks), MAX_RANKS_PER_TABLE):
            self.seq += 1
            out.append(LoadTable(self.seq, self.size, [self.ranks[r] for r in ranks[i : i + MAX_RANKS_PER_TABLE]]))
        if full and not out:
            self.seq += 1
            out.append(LoadTable(self.seq, self.size, []))  # a keepalive even before any rank registered
        return out


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig, log) -> None:
        self.cfg = cfg
        self.log = log
        self.ctx = zmq.Context()
        self.codec = Codec(CoordinatorInput | CoordinatorToEngine, "coordinator input")
        self.table_codec = Codec(LoadTable)
        self.keys = CurveKeys.from_file(cfg.key_file, log) if cfg.key_file else None
        self.auth = start_authenticator(self.ctx, self.keys, log)
        self.engines = make_socket(self.ctx, zmq.ROUTER, self.keys, bind=cfg.engines_address)
        self.poller = zmq.Poller()
        self.poller.register(self.engines, zmq.POLLIN)
        # Multi-node: peers that fail the CURVE handshake never reach the ZAP handler,
        # so only the socket's monitor can tell the operator about them.
        self.monitor = self.engines.get_monitor_socket(HANDSHAKE_EVENTS) if self.keys is not None else None
        if self.monitor is not None:
            self.poller.register(self.monitor, zmq.POLLIN)
        self.num_failed_handshakes = 0
        self.last_failed_handshake = ""
        self.last_handshake_warning = 0.0
        self.pub = make_socket(self.ctx, zmq.PUB, self.keys, bind=cfg.table_address, sndhwm=10_000)
        # API servers anywhere in the cluster: (node_rank, index) -> address
        self.api_servers: dict[tuple[int, int], str] = {}
        # registered engines: rank -> (zmq identity, node_rank)
        self.engine_peers: dict[int, tuple[bytes, int]] = {}
        self._asked_to_register: dict[bytes, float] = {}
        self.supervisor = SupervisorLink(self.ctx, cfg.supervisor_address, cfg.name)
        self.table = RankTable(cfg.data_parallel_size, cfg.fingerprint, cfg.stale_after_s)
        self.should_stop = False
        self.last_publish = 0.0
        self.last_full_publish = 0.0
        self.last_expire = 0.0
        self.last_wake = 0.0
        self.publish_interval_s = publish_interval(cfg.data_parallel_size)
        self.last_heartbeat = 0.0
        self.num_tables_published = 0

    def _on_signal(self, signum, _frame) -> None:
        self.should_stop = True

    def run(self) -> int:
        self.supervisor.ready("coordinator")
        self.log.info("coordinator ready", data_parallel_size=self.cfg.data_parallel_size)
        while not self.should_stop:
            # 1. Wait for messages, but never past the next publish or heartbeat.
            ready = dict(self.poller.poll(self._poll_timeout_ms()))
            gap = LOOP_MIN_INTERVAL_S - (time.monotonic() - self.last_wake)
            if ready and gap > 0:
                time.sleep(gap)
            self.last_wake = time.monotonic()
            if self.engines in ready:
                self._drain()
            now = time.monotonic()
            if self.monitor is not None:
                self._note_handshakes(self.monitor in ready, now)
            # 2. Retire ranks that went quiet.
            if now - self.last_expire >= EXPIRE_EVERY_S:
                self.last_expire = now
                for rank in self.table.expire(now):
                    self.log.warning("rank stopped reporting; taken out of routing", rank=rank)
            # 3. Publish what changed (rate-limited), and every rank once a second.
            if now - self.last_full_publish >= PUBLISH_KEEPALIVE_S:
                self._publish(full=True, now=now)
            elif self.table.dirty and now - self.last_publish >= self.publish_interval_s:
                self._publish(full=False, now=now)
            # 4. Heartbeat to the supervisor from this loop only.
            if now - self.last_heartbeat >= self.cfg.heartbeat_interval_s:
                self.supervisor.heartbeat()
                self.last_heartbeat = now
        return EXIT_OK

    def _publish(self, full: bool, now: float) -> None:
        for table in self.table.tables(full):
            self.pub.send(self.table_codec.encode(table))
            self.num_tables_published += 1
        self.last_publish = now
        if full:
            self.last_full_publish = now

    def _note_handshakes(self, has_events: bool, now: float) -> None:
        """Warn about peers that fail the CURVE handshake (a node with another key
        file): at once, then at most every HANDSHAKE_WARN_EVERY_S with a count."""
        while has_events:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            why = describe_handshake_failure(event["event"], event["value"])
            if why:
                self.num_failed_handshakes += 1
                self.last_failed_handshake = why
        if self.num_failed_handshakes and now - self.last_handshake_warning >= HANDSHAKE_WARN_EVERY_S:
            self.log.warning(
                "refused a connection: " + self.last_failed_handshake,
                address=self.cfg.engines_address,
                attempts=self.num_failed_handshakes,
                hint="every node needs the same --data-parallel-key-file",
            )
            self.num_failed_handshakes = 0
            self.last_handshake_warning = now

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        if self.table.dirty:
            return max(0, int((self.publish_interval_s - (now - self.last_publish)) * 1000))
        until_full = PUBLISH_KEEPALIVE_S - (now - self.last_full_publish)
        return max(0, int(min(until_full, self.cfg.heartbeat_interval_s) * 1000))

    def _drain(self) -> None:
        now = time.monotonic()
        decode, table = self.codec.decode_or_none, self.table
        recv, more = self.engines.recv, partial(self.engines.getsockopt, zmq.RCVMORE)
        while True:
            # Two recv() calls and getsockopt, not recv_multipart() (nor the `rcvmore`
            # attribute, a slow generic lookup): a third of the cost a message, which
            # matters at 10,000 reports a second. A ROUTER message is [identity, body];
            # a peer that sent more frames gets them dropped.
            try:
                identity = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not more():
                continue
            data = recv(zmq.NOBLOCK)
            if more():
                while more():
                    recv(zmq.NOBLOCK)
                continue
            if type(msg := decode(data, identity.decode(errors="replace"))) is LoadReport:
                if not table.load(msg, now):
                    self._ask_to_register(identity, now, f"rank {msg.rank} is not registered here")
                continue
            if type(msg) is PrefixRouted:
                self.pub.send(data)  # every API server learns what one routed; nothing kept here
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
            if self.api_servers.get(key) != msg.address:
                self.api_servers[key] = msg.address
                self.log.info("api server registered", node_rank=msg.node_rank, index=msg.index, address=msg.address)
                self._push_api_servers()
                self.last_full_publish = 0.0  # it needs every rank now, not in a second
        elif isinstance(msg, NodeHello):
            self.table.node_address(msg.node_rank, msg.address)
        elif isinstance(msg, RankDown):
            if self.table.down(msg.rank, msg.reason):
                self.log.warning("rank taken out of routing", rank=msg.rank, reason=msg.reason)

    def _addresses_for(self, node_rank: int) -> list[str]:
        """The API servers an engine on `node_rank` serves: all of them, or its own node's."""
        local_only = self.cfg.lb_mode in ("hybrid", "external")
        return [a for (node, _), a in sorted(self.api_servers.items()) if not local_only or node == node_rank]

    def _push_api_servers(self) -> None:
        for identity, node_rank in self.engine_peers.values():
            self._send(identity, ApiServerList(self._addresses_for(node_rank)))

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
