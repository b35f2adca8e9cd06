"""A simulated engine: many DP ranks in one process, the real wire protocol, no model.

A TEST AND BENCHMARK TOOL, never a serving option: it loads no model and
produces meaningless token ids at configured prefill/decode speeds, so that
control-plane tests and the cluster-size benchmark can run hundreds of ranks
on two cores (`dpserve sim-engine`, benchmarks/cluster_bench.py). It must
never import torch or transformers.

What is real: every socket and message an engine rank uses (EngineRegister
-> RegisterReply, ApiServerList, PleaseRegister, EngineReady, LoadReports on
change and as heartbeats, EngineHello on every API-server (re)connection,
AddRequest / AbortRequests / Ping in, EngineOutputs / Pong / EngineDead out).
What is simulated: the model. Each rank keeps a FIFO waiting queue and up to
`max_num_seqs` running sequences; a step every `decode_step_ms` prefills up
to prefill_tokens_per_s x step of waiting prompts (a prompt's first token
comes with the step that finishes it) and gives every running sequence one
token; a sequence ends at max_tokens ("length") or on one of its
stop_token_ids ("stop"). Ranks in one process share one poll loop and one
step clock (all busy ranks step together), and send their periodic reports
together, so that a process of 32 idle ranks x 32 API servers wakes ~10 times
a second; a rank's sockets are its own, as in a real rank process.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
import uuid
from collections import deque

import msgspec
import zmq
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.procutil import die_with_parent, raise_fd_limit
from dpserve.engine.common.protocol import (
    FINISH_LENGTH,
    FINISH_STOP,
    AbortRequests,
    AddRequest,
    ApiServerList,
    Codec,
    CoordinatorInput,
    CoordinatorToEngine,
    EngineDead,
    EngineHello,
    EngineInput,
    EngineOutputs,
    EngineReady,
    EngineRegister,
    EngineToApi,
    LoadReport,
    Ping,
    PleaseRegister,
    Pong,
    RegisterReply,
    RequestOutput,
)
from dpserve.engine.common.sockets import make_socket

LOAD_REPORT_MIN_INTERVAL_S = 0.002  # as the real engine
REGISTER_RETRY_S = 2.0
GREET_CHECK_S = 1.0  # how often reconnections are looked for (a re-greeting's delay at most)


class SimConfig(msgspec.Struct, kw_only=True):
    ranks: list[int]
    coordinator_address: str
    fingerprint: str
    node_rank: int = 0
    key_file: str = ""
    report_interval_s: float = 1.0  # a load report at least this often (the heartbeat)
    prefill_tokens_per_s: float = 50_000.0
    decode_step_ms: float = 10.0
    max_num_seqs: int = 64
    vary_load: bool = False  # benchmarks: every periodic report carries a change (a busy cluster)
    token_ids: list[int] = msgspec.field(default_factory=lambda: list(range(68, 94)))  # what answers are made of


class _Seq:
    __slots__ = ("request_id", "owner", "prefill_left", "max_tokens", "num_generated", "stop_ids", "first")

    def __init__(self, req: AddRequest, owner: int) -> None:
        self.request_id = req.request_id
        self.owner = owner
        self.prefill_left = len(req.prompt_token_ids)
        self.max_tokens = req.params.max_tokens
        self.num_generated = 0
        self.stop_ids = set(req.params.stop_token_ids)
        self.first = req.prompt_token_ids[0] if req.prompt_token_ids else 0


class SimRank:
    """One simulated rank: its sockets, its queues, its load. Driven by SimEngine's loop.

    Invariant: every request in `waiting` or `running` came from API server
    `owner` and gets exactly one finishing output unless aborted.
    """

    def __init__(self, eng: SimEngine, rank: int) -> None:
        self.eng = eng
        self.cfg = eng.cfg
        self.rank = rank
        self.incarnation = uuid.uuid4().hex[:12]
        ctx = eng.ctx
        self.coordinator = make_socket(
            ctx, zmq.DEALER, eng.keys, connect=self.cfg.coordinator_address,
            identity=f"engine-{rank}-{self.incarnation}".encode(), reconnect_ms=(100, 2000),
        )
        eng.watch(self.coordinator, self, -1)
        self.api: list[zmq.Socket] = []
        self.api_addresses: list[str] = []
        self.monitors: list[zmq.Socket] = []
        self.registered = False
        self.last_register = 0.0
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.by_id: dict[str, _Seq] = {}
        self.num_finished = 0
        self.num_aborted = 0
        self.last_report = 0.0
        self.last_load: tuple = ()
        self.load_dirty = False
        self.num_reports = 0

    # ---------------------------------------------------------------- membership

    def register(self, now: float) -> None:
        self.last_register = now
        msg = EngineRegister(self.rank, self.incarnation, self.cfg.fingerprint, os.getpid(), socket.gethostname(), self.cfg.node_rank)
        self.to_coordinator(msg)

    def connect_api_servers(self, addresses: list[str]) -> None:
        for address in addresses:
            if address in self.api_addresses:
                continue
            sock = make_socket(
                self.eng.ctx, zmq.DEALER, self.eng.keys, identity=str(self.rank).encode(), sndhwm=0, rcvhwm=0, reconnect_ms=(50, 1000)
            )
            self.monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
            sock.connect(address)
            self.eng.watch(sock, self, len(self.api))
            self.api.append(sock)
            self.api_addresses.append(address)
            # queued until the connection is up: no wait for the monitor's next check
            self.send_api(len(self.api) - 1, EngineHello(self.rank, self.incarnation))

    def greet_reconnections(self) -> None:
        """EngineHello on every completed (re)connection, as the real engine does."""
        for index, monitor in enumerate(self.monitors):
            while True:
                try:
                    monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.send_api(index, EngineHello(self.rank, self.incarnation))

    def on_coordinator(self, msg: object, now: float) -> None:
        if isinstance(msg, RegisterReply):
            if not msg.accepted:
                self.eng.log(f"rank {self.rank}: coordinator refused registration: {msg.reason}")
                self.eng.refused = True
                return
            self.connect_api_servers(msg.api_server_addresses)
            self.registered = True
            self.to_coordinator(EngineReady(self.rank, self.incarnation))
            self.report_load(now, force=True)
        elif isinstance(msg, ApiServerList):
            self.connect_api_servers(msg.api_server_addresses)
        elif isinstance(msg, PleaseRegister):
            self.register(now)

    # ---------------------------------------------------------------- requests

    def on_api(self, index: int, msg: object, now: float) -> None:
        if isinstance(msg, AddRequest):
            seq = _Seq(msg, index)
            self.by_id[seq.request_id] = seq
            self.waiting.append(seq)
            self.eng.busy.add(self)
            self.mark_dirty()
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                seq = self.by_id.pop(rid, None)
                if seq is None:
                    continue
                self.num_aborted += 1
                if seq in self.running:
                    self.running.remove(seq)
                else:
                    self.waiting.remove(seq)
            self.mark_dirty()
        elif isinstance(msg, Ping):
            self.send_api(index, Pong(self.rank, msg.nonce))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self, now: float) -> None:
        """One simulated scheduler step: prefill within the budget, one token per running sequence."""
        cfg = self.cfg
        step_s = cfg.decode_step_ms / 1000
        outs: dict[int, list[RequestOutput]] = {}
        tokens = cfg.token_ids
        # 1. Decode: every sequence that already had its first token gets one more.
        still = []
        for seq in self.running:
            self._emit(seq, tokens[(seq.first + seq.num_generated) % len(tokens)], outs, still)
        self.running = still
        # 2. Prefill: FIFO within the token budget; a finished prefill yields the first token.
        budget = cfg.prefill_tokens_per_s * step_s
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            used = min(budget, seq.prefill_left)
            seq.prefill_left -= used
            budget -= used
            if seq.prefill_left > 0:
                break
            self.waiting.popleft()
            self._emit(seq, tokens[seq.first % len(tokens)], outs, self.running)
        # 3. One message per API server with this step's outputs.
        for index, batch in outs.items():
            self.send_api(index, EngineOutputs(self.rank, batch, len(self.running), len(self.waiting)))
        self.mark_dirty()

    def _emit(self, seq: _Seq, token: int, outs: dict[int, list[RequestOutput]], keep: list[_Seq]) -> None:
        seq.num_generated += 1
        if token in seq.stop_ids:
            out = RequestOutput(seq.request_id, [token], FINISH_STOP, stop_token_id=token)
        elif seq.num_generated >= seq.max_tokens:
            out = RequestOutput(seq.request_id, [token], FINISH_LENGTH)
        else:
            keep.append(seq)
            outs.setdefault(seq.owner, []).append(RequestOutput(seq.request_id, [token]))
            return
        del self.by_id[seq.request_id]
        self.num_finished += 1
        outs.setdefault(seq.owner, []).append(out)

    # ---------------------------------------------------------------- load and sockets

    def mark_dirty(self) -> None:
        self.load_dirty = True
        self.eng.dirty.add(self)

    def report_load(self, now: float, force: bool = False) -> None:
        """Report if forced, or if the load changed and the last report is 2 ms old;
        a change held back stays in the engine's dirty set."""
        if not self.registered:
            return
        waiting_tokens = int(sum(s.prefill_left for s in self.waiting))
        load = (len(self.running), len(self.waiting), waiting_tokens, self.num_finished, self.num_aborted)
        changed = load != self.last_load
        self.load_dirty = changed
        if not (force or (changed and now - self.last_report >= LOAD_REPORT_MIN_INTERVAL_S)):
            if changed:
                self.eng.dirty.add(self)
            return
        self.load_dirty = False
        self.last_load = load
        self.last_report = now
        remaining = sum(s.max_tokens - s.num_generated for s in self.running)
        usage = len(self.running) / self.cfg.max_num_seqs
        self.num_reports += 1
        if self.cfg.vary_load:
            usage = (self.num_reports % 100) / 100
        self.to_coordinator(
            LoadReport(self.rank, self.incarnation, load[0], load[1], waiting_tokens, remaining, usage,
                       self.cfg.decode_step_ms if self.running else 0.0, self.num_finished, self.num_aborted, usage)
        )

    def to_coordinator(self, msg: object) -> None:
        try:
            self.coordinator.send(self.eng.coord_codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def send_api(self, index: int, msg: object) -> None:
        try:
            self.api[index].send(self.eng.out_codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def announce_death(self, reason: str) -> None:
        data = self.eng.out_codec.encode(EngineDead(self.rank, self.incarnation, reason))
        for sock in self.api:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass


class SimEngine:
    """The process: one poll loop over every simulated rank's sockets."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        # a rank holds 2 sockets per API server (channel and its monitor) plus one
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        self.keys = CurveKeys.from_file(cfg.key_file, None) if cfg.key_file else None
        self.in_codec = Codec(EngineInput, "requests")
        self.out_codec = Codec(EngineToApi)
        self.coord_codec = Codec(CoordinatorInput | CoordinatorToEngine, "coordinator")
        self.poller = zmq.Poller()
        self.owners: dict[zmq.Socket, tuple[SimRank, int]] = {}
        self.busy: set[SimRank] = set()  # ranks with requests: they step on the next tick
        self.dirty: set[SimRank] = set()  # ranks whose load changed since their last report
        self.should_stop = False
        self.refused = False
        self.ranks = [SimRank(self, r) for r in cfg.ranks]

    def log(self, text: str) -> None:
        print(f"sim-engine[{os.getpid()}]: {text}", file=sys.stderr, flush=True)

    def watch(self, sock: zmq.Socket, rank: SimRank, index: int) -> None:
        self.owners[sock] = (rank, index)
        self.poller.register(sock, zmq.POLLIN)

    def run(self) -> int:
        ranks = self.ranks
        step_s = self.cfg.decode_step_ms / 1000
        now = time.monotonic()
        for r in ranks:
            r.register(now)
        next_tick = next_report = next_greet = now
        while not self.should_stop and not self.refused:
            # 1. Wait for input, never past the next tick, report round or flush of a change.
            wake = min(next_report, next_greet)
            if self.busy:
                wake = min(wake, next_tick)
            if self.dirty:
                wake = min(wake, now + LOAD_REPORT_MIN_INTERVAL_S)
            timeout_ms = max(0, int((wake - time.monotonic()) * 1000 + 0.999))
            for sock, _ in self.poller.poll(timeout_ms):
                self._drain(sock)
            now = time.monotonic()
            # 2. Tick: every busy rank steps (an idle process starts its clock at once).
            if self.busy and now >= next_tick:
                for r in list(self.busy):
                    r.step(now)
                    if not r.has_work:
                        self.busy.discard(r)
                next_tick = max(next_tick + step_s, now)
            elif not self.busy:
                next_tick = now
            # 3. Load reports: changes (rate-limited per rank), and every rank each interval.
            if now >= next_report:
                next_report = now + self.cfg.report_interval_s
                self.dirty.clear()
                for r in ranks:
                    if not r.registered and now - r.last_register >= REGISTER_RETRY_S:
                        r.register(now)
                    r.report_load(now, force=True)
            elif self.dirty:
                dirty, self.dirty = self.dirty, set()
                for r in dirty:
                    r.report_load(now)
            # 4. Greet API servers we reconnected to.
            if now >= next_greet:
                next_greet = now + GREET_CHECK_S
                for r in ranks:
                    r.greet_reconnections()
        return 2 if self.refused else 0

    def _drain(self, sock: zmq.Socket) -> None:
        rank, index = self.owners[sock]
        now = time.monotonic()
        codec = self.coord_codec if index < 0 else self.in_codec
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if (msg := codec.decode_or_none(data)) is None:
                continue
            if index < 0:
                rank.on_coordinator(msg, now)
            else:
                rank.on_api(index, msg, now)

    def close(self, reason: str) -> None:
        for r in self.ranks:
            if r.registered:
                r.announce_death(reason)
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
    ap.add_argument("--fingerprint", required=True, help="the deployment's config fingerprint (the head logs it)")
    ap.add_argument("--ranks", required=True, help="ranks this process simulates, e.g. 0-63 or 0,2,5-7")
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--key-file", default="")
    ap.add_argument("--report-interval-s", type=float, default=1.0)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=50_000.0)
    ap.add_argument("--decode-step-ms", type=float, default=10.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--vary-load", action="store_true", help="every periodic report carries a change (benchmarks)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies (test harnesses)")
    args = ap.parse_args(argv)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    raise_fd_limit()  # ~3 descriptors per rank and API server
    cfg = SimConfig(
        ranks=parse_ranks(args.ranks),
        coordinator_address=args.coordinator,
        fingerprint=args.fingerprint,
        node_rank=args.node_rank,
        key_file=args.key_file,
        report_interval_s=args.report_interval_s,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_ms=args.decode_step_ms,
        max_num_seqs=args.max_num_seqs,
        vary_load=args.vary_load,
    )
    eng = SimEngine(cfg)

    def stop(signum, _frame) -> None:
        eng.should_stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    eng.log(f"simulating ranks {args.ranks} (no model: a test and benchmark tool)")
    code = 1
    try:
        code = eng.run()
    finally:
        eng.close("simulated engine shut down")
    return code


if __name__ == "__main__":
    sys.exit(main())
