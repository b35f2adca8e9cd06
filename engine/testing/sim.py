"""A simulated engine: many DP ranks in one process, the real wire protocol, no model.

A TEST AND BENCHMARK TOOL, never a serving option: it loads no model and
produces meaningless token ids at configured prefill/decode speeds, so that
control-plane tests and the cluster-size benchmark can run hundreds of ranks
on two cores (`dpserve sim-engine`, benchmarks/cluster_bench.py). It must
never import torch or transformers.

What is real: every socket and message an engine rank uses, through the real
rank's own RankIO (engine/rank/io.py): EngineRegister -> RegisterReply,
ApiServerList, PleaseRegister, EngineReady, LoadReports on change and as
heartbeats, EngineHello on every API-server (re)connection, AddRequest /
AbortRequests / PauseRequests / ResumeRequests / Ping in, EngineOutputs / Pong / EngineDead out.
What is simulated: the model. Each rank keeps a FIFO waiting queue and up to
`max_num_seqs` running sequences; a step every `decode_step_ms` prefills up
to prefill_tokens_per_s x step of waiting prompts (a prompt's first token
comes with the step that finishes it) and gives every running sequence one
token; a sequence ends at max_tokens ("length") or on one of its
stop_token_ids ("stop"). Ranks in one process share one poll loop and one
step clock (all busy ranks step together), and send their periodic reports
together, so that a process of 32 idle ranks x 32 API servers wakes ~10 times
a second; a rank's sockets are its own, as in a real rank process. Each
rank's model is a SimCore, a RankEngine like the real engines. A process is one
node (--node-rank) or many (--ranks-per-node), each with its relay (node_relay.py)
and, with --rank-links node, one connection to each API server (node_hop.py's
frames): its ranks send [their identity, body] on the node's DEALER, and what comes
back is handed to the rank its first frame names, so an API server sees exactly what
a real node's hop shows it. The node-local leg of a real hop (a socket a rank and a
C proxy) is not simulated: the benchmark is to measure dpserve, not the simulator.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import uuid

import msgspec
import zmq
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.logs import setup_logging
from dpserve.engine.common.procutil import die_with_parent, raise_fd_limit
from dpserve.engine.common.protocol import AbortRequests, AddRequest, CoordinatorInput, LoadReport, ResumeRequests
from dpserve.engine.common.sockets import make_socket
from dpserve.engine.rank.io import COORDINATOR, LOAD_REPORT_MIN_INTERVAL_S, REFUSED, REGISTER_RETRY_S, WELCOMED, RankIO
from dpserve.engine.rank.node_hop import hop_identity
from dpserve.engine.rank.node_relay import NodeAggregator
from dpserve.engine.testing.sim_cache import caching_core
from dpserve.engine.testing.sim_core import SimCore
from dpserve.engine.testing.sim_poll import FdPoller

GREET_CHECK_S = 1.0  # how often reconnections are looked for (a re-greeting's delay at most)


class SimConfig(msgspec.Struct, kw_only=True):
    ranks: list[int]
    coordinator_address: str
    fingerprint: str
    node_rank: int = 0
    ranks_per_node: int = 0  # 0: the process is one node, named node_rank; else node = first rank of each group
    node_heartbeat_s: float = 0.0  # a node's heartbeat to the coordinator (0: every report interval)
    key_file: str = ""
    report_interval_s: float = 1.0  # a load report at least this often (the heartbeat)
    prefill_tokens_per_s: float = 50_000.0
    decode_step_ms: float = 10.0
    max_num_seqs: int = 64
    vary_load: bool = False  # benchmarks: every periodic report carries a change (a busy cluster)
    monitors: bool = True  # connection monitors greet a restarted API server at once (off: it asks, GreetAgain)
    kv_cache_blocks: int = 0  # > 0: a prefix cache of that many blocks, publishing KV events (sim_cache.caching_core)
    node_hop: bool = False  # --rank-links node: ranks reach API servers through their node's hop (one connection a node)
    token_ids: list[int] = msgspec.field(default_factory=lambda: list(range(68, 94)))  # what answers are made of


class SimNode:
    """One simulated node's relay: its ranks' reports in one NodeLoad, from its own socket."""

    def __init__(self, eng: SimEngine, node_rank: int) -> None:
        cfg = eng.cfg
        self.eng = eng
        self.agg = NodeAggregator(
            node_rank, cfg.report_interval_s, silence_s=2.5 * cfg.report_interval_s, beat_s=cfg.node_heartbeat_s
        )
        self.codec = Codec(CoordinatorInput)
        self.sock = make_socket(
            eng.ctx, zmq.DEALER, eng.keys, identity=f"node-{node_rank}-{uuid.uuid4().hex[:8]}".encode(),
            reconnect_ms=(100, 2000),
        )
        self.sock.connect(cfg.coordinator_address)
        self.node_rank = node_rank
        self.boot = uuid.uuid4().hex[:8]
        self.hops: dict[str, SimHop] = {}  # API server address -> the node's connection to it

    def link(self, rank: SimRank, address: str, identity: bytes) -> HopLink:
        """RankIO's `link`: the rank's way through this node's connection to `address`, made on first use."""
        hop = self.hops.get(address)
        if hop is None:
            back = make_socket(
                self.eng.ctx, zmq.DEALER, self.eng.keys, identity=hop_identity(self.node_rank, self.boot, len(self.hops)),
                sndhwm=0, rcvhwm=0, reconnect_ms=(50, 1000),
            )
            back.connect(address)
            hop = self.hops[address] = SimHop(back)
            self.eng.watch(back, hop)
        link = HopLink(hop, rank, identity)
        hop.links[identity] = link
        return link

    def note(self, report: LoadReport) -> None:
        self.agg.note(report, self.eng.now)
        if self.agg.changed:
            self.eng.pending.add(self)

    def flush(self, now: float) -> None:
        msg = self.agg.flush(now)
        if msg is not None:
            try:
                self.sock.send(self.codec.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no head yet: the next interval's message carries the same


class SimHop:
    """A simulated node's one connection to an API server: what arrives as [rank identity,
    body] goes to the rank holding that identity; anything else is dropped, as a real
    hop's ROUTER drops a message for a rank that is not behind it."""

    def __init__(self, back: zmq.Socket) -> None:
        self.back = back
        self.links: dict[bytes, HopLink] = {}  # rank identity -> its link

    def drain(self, sock: zmq.Socket, now: float) -> None:
        links = self.links
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            link = links.get(frames[0].bytes) if len(frames) == 2 else None
            if link is not None and (got := link.rank.io.take(link, frames[1].buffer)) is not None:
                link.rank.on_message(*got, now)


class HopLink:
    """A rank's end of its node's SimHop, as RankIO uses a socket: a send goes out as
    [identity, body] on the node's connection; a new identity (RankIO.reconnect) is
    filed under it; connecting and closing belong to the node."""

    closed = False

    def __init__(self, hop: SimHop, rank: SimRank, identity: bytes) -> None:
        self.hop, self.rank, self.identity = hop, rank, identity

    def send(self, data, flags: int = 0, copy: bool = True) -> None:
        self.hop.back.send_multipart([self.identity, data], flags, copy=copy)

    def setsockopt(self, option: int, value: bytes) -> None:
        if option == zmq.IDENTITY:
            self.hop.links.pop(self.identity, None)
            self.identity = value
            self.hop.links[value] = self

    def connect(self, address: str) -> None:
        pass

    def disconnect(self, address: str) -> None:
        pass

    def close(self, linger: int | None = None) -> None:
        pass


class SimRank:
    """One simulated rank: a SimCore and its RankIO, driven by SimEngine's loop."""

    def __init__(self, eng: SimEngine, rank: int) -> None:
        self.eng = eng
        self.rank = rank
        self.core = (caching_core(SimCore) if eng.cfg.kv_cache_blocks else SimCore)(eng.cfg)
        cfg = eng.cfg
        node_rank = rank - rank % cfg.ranks_per_node if cfg.ranks_per_node else cfg.node_rank
        self.node = eng.nodes.get(node_rank) or eng.nodes.setdefault(node_rank, SimNode(eng, node_rank))
        self.io = RankIO(
            eng.ctx, eng.keys, rank=rank, incarnation=uuid.uuid4().hex[:12], fingerprint=cfg.fingerprint,
            node_rank=node_rank, coordinator_address=cfg.coordinator_address, log=eng.log.bind(rank=rank),
            watch=lambda sock: eng.watch(sock, self), watch_monitors=False,
            # behind a hop a rank's connection is local and never sees the API server's return: it is asked to greet
            monitors=cfg.monitors and not cfg.node_hop,
            link=(lambda address, identity: self.node.link(self, address, identity)) if cfg.node_hop else None,
        )
        self.io.sent = eng.sent
        self.io.load_sink = self.node.note

    def drain(self, sock: zmq.Socket, now: float) -> None:
        for index, msg in self.io.read(sock):
            self.on_message(index, msg, now)

    def on_message(self, index: int, msg: object, now: float) -> None:
        if index != COORDINATOR:
            self.io.deliver(index, msg, self.core)
            if isinstance(msg, (AddRequest, AbortRequests, ResumeRequests)):
                if self.core.has_unfinished():
                    self.eng.busy.add(self)
                self.mark_dirty()
            return
        answer = self.io.on_coordinator(msg)
        if answer == REFUSED:
            self.eng.refused = True
        elif answer == WELCOMED:
            self.report_load(now, force=True)

    def step(self) -> None:
        outputs = self.core.step()
        if outputs:  # with the step's KV events (a caching core's), to the API servers that asked
            self.io.send_outputs(outputs, self.core)
        else:
            self.io.kv.after_step(self.io, self.core)
        self.mark_dirty()

    def mark_dirty(self) -> None:
        self.eng.dirty.add(self)

    def report_load(self, now: float, force: bool = False) -> None:
        """Report if forced, or if the load changed and the last report is 2 ms old;
        a change held back stays in the engine's dirty set."""
        self.io.report_load(self.core, now, force=force)
        if self.io.load_dirty:
            self.eng.dirty.add(self)


class SimEngine:
    """The process: one poll loop over every simulated rank's sockets."""

    def __init__(self, cfg: SimConfig, log) -> None:
        self.cfg = cfg
        self.log = log
        self.ctx = zmq.Context()
        # a rank holds 2 sockets per API server (channel and its monitor) plus one
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        self.keys = CurveKeys.from_file(cfg.key_file, log) if cfg.key_file else None
        self.poller = FdPoller()  # epoll: a wake-up costs what is readable, not every socket (issue 30)
        self.sent: set[zmq.Socket] = set()  # sockets sent on since the last poll (RankIO.sent): looked at again
        self.owners: dict[zmq.Socket, SimRank | SimHop] = {}
        self.busy: set[SimRank] = set()  # ranks with requests: they step on the next tick
        self.dirty: set[SimRank] = set()  # ranks whose load changed since their last report
        self.nodes: dict[int, SimNode] = {}
        self.pending: set[SimNode] = set()  # nodes holding changes their relay has not sent
        self.now = time.monotonic()
        self.should_stop = False
        self.refused = False
        self.ranks = [SimRank(self, r) for r in cfg.ranks]

    def watch(self, sock: zmq.Socket, owner: SimRank | SimHop) -> None:
        self.owners[sock] = owner
        self.poller.register(sock)

    def run(self) -> int:
        ranks = self.ranks
        step_s = self.cfg.decode_step_ms / 1000
        now = time.monotonic()
        for r in ranks:
            r.io.register()
        next_tick = next_report = next_greet = now
        while not self.should_stop and not self.refused:
            # 1. Wait for input, never past the next tick, report round or flush of a change.
            wake = min(next_report, next_greet)
            if self.busy:
                wake = min(wake, next_tick)
            if self.dirty:
                wake = min(wake, now + LOAD_REPORT_MIN_INTERVAL_S)
            if self.pending:
                wake = min(wake, min(n.agg.next_due() for n in self.pending))
            timeout_ms = max(0, int((wake - time.monotonic()) * 1000 + 0.999))
            self.poller.recheck(s.hop.back if type(s) is HopLink else s for s in self.sent)
            self.sent.clear()
            for sock in self.poller.poll(timeout_ms):
                self._drain(sock)
                if time.monotonic() >= next_report:
                    # Ranks connecting to 32 API servers each (~10 ms a rank) must not hold
                    # back the node's heartbeat: the rest stay readable for the next poll.
                    break
            now = self.now = time.monotonic()
            # 2. Tick: every busy rank steps (an idle process starts its clock at once).
            if self.busy and now >= next_tick:
                for r in list(self.busy):
                    r.step()
                    if not r.core.has_unfinished():
                        self.busy.discard(r)
                next_tick = max(next_tick + step_s, now)
            elif not self.busy:
                next_tick = now
            # 3. Load reports: changes (rate-limited per rank), and every rank each interval.
            if now >= next_report:
                next_report = now + self.cfg.report_interval_s
                self.dirty.clear()
                for r in ranks:
                    if not r.io.registered and now - r.io.last_register >= REGISTER_RETRY_S:
                        r.io.register()
                    r.core.load_round += 1
                    r.report_load(now, force=True)
                for node in self.nodes.values():  # every node's heartbeat, changes with it
                    node.flush(now)
                self.pending.clear()
            elif self.dirty:
                dirty, self.dirty = self.dirty, set()
                for r in dirty:
                    r.report_load(now)
            if self.pending:  # changes, each node's at most every flush interval
                for node in [n for n in self.pending if n.agg.next_due() <= now]:
                    node.flush(now)
                    self.pending.discard(node)
            # 4. Greet API servers we reconnected to.
            if now >= next_greet:
                next_greet = now + GREET_CHECK_S
                for r in ranks:
                    r.io.greet_reconnections()
        return 2 if self.refused else 0

    def _drain(self, sock: zmq.Socket) -> None:
        self.owners[sock].drain(sock, time.monotonic())

    def close(self, reason: str) -> None:
        for r in self.ranks:
            if r.io.registered:
                r.io.announce_death(reason, clean=True)
        self.ctx.destroy(linger=0)


def parse_ranks(text: str) -> list[int]:
    """'0-63' or '0,2,5-7' -> ranks."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dpserve sim-engine",
        description="Simulated engine ranks for control-plane tests and benchmarks: the real protocol, NO MODEL "
        "(answers are meaningless token ids). Never a way to serve.",
    )
    ap.add_argument("--coordinator", required=True, help="the coordinator's engine address (ipc:// or tcp://)")
    ap.add_argument(
        "--fingerprint", required=True,
        help="the deployment's config fingerprint (dpserve.engine.common.protocol.config_fingerprint); a wrong one is "
        "refused, and this process logs the refusal, which names the head's",
    )
    ap.add_argument("--ranks", required=True, help="ranks this process simulates, e.g. 0-63 or 0,2,5-7")
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--ranks-per-node", type=int, default=0, help="simulate nodes of this many ranks (0: one node, --node-rank)")
    ap.add_argument("--node-heartbeat-s", type=float, default=0.0, help="a node's heartbeat when no load changed (0: each interval)")
    ap.add_argument("--key-file", default="")
    ap.add_argument("--report-interval-s", type=float, default=1.0)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=50_000.0)
    ap.add_argument("--decode-step-ms", type=float, default=10.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--vary-load", action="store_true", help="every periodic report carries a change (benchmarks)")
    ap.add_argument("--kv-cache-blocks", type=int, default=0, help="a prefix cache of this many 16-token blocks per rank, publishing KV events")
    ap.add_argument("--rank-links", choices=["direct", "node"], default="direct",
                    help="node: each node's ranks reach an API server through one connection, its hop (node_hop.py)")
    ap.add_argument("--no-monitors", action="store_true",
                    help="no connection monitors (thousands of connections): a restarted API server asks to be greeted")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies (test harnesses)")
    args = ap.parse_args(argv)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    raise_fd_limit()  # ~3 descriptors per rank and API server
    cfg = SimConfig(
        ranks=parse_ranks(args.ranks),
        coordinator_address=args.coordinator,
        fingerprint=args.fingerprint,
        node_rank=args.node_rank, ranks_per_node=args.ranks_per_node,
        node_heartbeat_s=args.node_heartbeat_s, key_file=args.key_file,
        report_interval_s=args.report_interval_s, prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_ms=args.decode_step_ms,
        max_num_seqs=args.max_num_seqs,
        vary_load=args.vary_load, kv_cache_blocks=args.kv_cache_blocks, monitors=not args.no_monitors,
        node_hop=args.rank_links == "node",
    )
    log = setup_logging("sim-engine")
    eng = SimEngine(cfg, log)

    def stop(signum, _frame) -> None:
        eng.should_stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("simulating ranks (no model: a test and benchmark tool)", ranks=args.ranks, fingerprint=cfg.fingerprint,
             coordinator=cfg.coordinator_address)
    code = 1
    try:
        code = eng.run()
    finally:
        eng.close("simulated engine shut down")
    return code


if __name__ == "__main__":
    sys.exit(main())
