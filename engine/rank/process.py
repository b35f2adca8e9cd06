"""The engine process of one DP rank: sockets around an EngineCore.

The busy loop alone owns the EngineCore; socket work is confined to the
`_EngineIO` helper, which only moves bytes between ZeroMQ and Python objects.
Lifecycle: load model -> register with the coordinator (HELLO / WELCOME) ->
connect to every API server it was told about -> READY -> serve.
A fatal error is announced (EngineDead to every API server) before exit.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import zmq
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.config import EngineProcessConfig
from dpserve.engine.common.procutil import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_STARTUP,
    SupervisorLink,
    child_config_from_env,
    die_with_parent,
    set_process_name,
)
from dpserve.engine.common.protocol import (
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
from zmq.utils.monitor import recv_monitor_message

LOAD_REPORT_MIN_INTERVAL_S = 0.002  # at most one report per 2 ms while load changes
REGISTER_RETRY_S = 2.0
# How long a dying engine waits for its EngineDead to reach each API server.
# Long enough for any live peer (vLLM lingers seconds); short enough that an
# engine whose API servers are already gone (node shutdown) still exits well
# within the supervisor's kill grace (5 s by default).
DEATH_LINGER_S = 1.0


class _EngineIO:
    """ZeroMQ sockets of one engine: one DEALER per API server, one to the coordinator.

    Invariant: `owner[request_id]` is the index of the API-server socket that
    sent the request, for every request the core still holds.
    """

    def __init__(self, ctx: zmq.Context, cfg: EngineProcessConfig, incarnation: str, keys: CurveKeys | None) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.rank = cfg.engine.rank
        self.incarnation = incarnation
        self.keys = keys
        self.in_codec = Codec(EngineInput, "requests")
        self.out_codec = Codec(EngineToApi)
        self.coord_codec = Codec(CoordinatorInput | CoordinatorToEngine, "coordinator")
        self.coordinator = make_socket(
            ctx, zmq.DEALER, keys, connect=cfg.coordinator_address,
            identity=f"engine-{self.rank}-{incarnation}".encode(), reconnect_ms=(100, 2000),
        )
        self.api: list[zmq.Socket] = []
        self.api_addresses: list[str] = []
        self.monitors: dict[zmq.Socket, int] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.coordinator, zmq.POLLIN)
        self.owner: dict[str, int] = {}

    def registration(self) -> EngineRegister:
        return EngineRegister(
            self.rank, self.incarnation, self.cfg.fingerprint, os.getpid(), socket.gethostname(), self.cfg.node_rank
        )

    def register(self, log, should_stop) -> list[str]:
        """HELLO until the coordinator answers; returns the API-server addresses."""
        hello = self.coord_codec.encode(self.registration())
        started = time.monotonic()
        while not should_stop():
            self.coordinator.send(hello)
            if self.coordinator.poll(REGISTER_RETRY_S * 1000):
                reply = self.coord_codec.decode_or_none(self.coordinator.recv())
                if not isinstance(reply, RegisterReply):
                    continue
                if not reply.accepted:
                    log.error("coordinator refused registration", reason=reply.reason)
                    raise SystemExit(EXIT_CONFIG)
                return reply.api_server_addresses
            waited = time.monotonic() - started
            if int(waited) % 10 < REGISTER_RETRY_S:
                log.info("waiting for the coordinator", address=self.cfg.coordinator_address, waited_s=round(waited, 1))
        return []

    def connect_api_servers(self, addresses: list[str]) -> None:
        """One DEALER per API server, added as API servers appear (never removed:
        a lost one is simply reconnected by ZeroMQ when it returns). Each
        (re)connection is greeted with EngineHello, so an API server that
        restarted learns this rank again without a new handshake."""
        for address in addresses:
            if address in self.api_addresses:
                continue
            sock = make_socket(
                self.ctx, zmq.DEALER, self.keys, identity=str(self.rank).encode(), sndhwm=0, rcvhwm=0, reconnect_ms=(50, 1000)
            )
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(address)
            self.monitors[monitor] = len(self.api)
            self.api.append(sock)
            self.api_addresses.append(address)
            self.poller.register(sock, zmq.POLLIN)
            self.poller.register(monitor, zmq.POLLIN)

    def _greet(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            self.send_to(self.monitors[monitor], EngineHello(self.rank, self.incarnation))

    def coordinator_messages(self) -> list[object]:
        got = []
        while True:
            try:
                data = self.coordinator.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            if (msg := self.coord_codec.decode_or_none(data)) is not None:
                got.append(msg)

    def receive(self, timeout_ms: int) -> list[tuple[int, object]]:
        """Every message waiting on the API-server sockets, tagged with the socket index."""
        got = []
        events = dict(self.poller.poll(timeout_ms))
        if not events:
            return got
        if self.coordinator in events:
            got.extend((-1, msg) for msg in self.coordinator_messages())
        for monitor in self.monitors:
            if monitor in events:
                self._greet(monitor)
        for index, sock in enumerate(self.api):
            if sock not in events:
                continue
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if (msg := self.in_codec.decode_or_none(frame.buffer)) is not None:
                    got.append((index, msg))
        return got

    def send_outputs(self, outputs: list[RequestOutput], num_running: int, num_waiting: int) -> None:
        by_owner: dict[int, list[RequestOutput]] = {}
        owner = self.owner
        for out in outputs:
            index = owner.get(out.request_id)
            if index is None:
                continue  # aborted while in flight: the API server forgot it too
            by_owner.setdefault(index, []).append(out)
            if out.finish_reason is not None:
                del owner[out.request_id]
        for index, outs in by_owner.items():
            msg = EngineOutputs(self.rank, outs, num_running, num_waiting)
            self.api[index].send(self.out_codec.encode(msg), copy=False)

    def send_to(self, index: int, msg: object) -> None:
        self.api[index].send(self.out_codec.encode(msg))

    def broadcast(self, msg: object) -> None:
        data = self.out_codec.encode(msg)
        for sock in self.api:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def report(self, msg: object) -> None:
        try:
            self.coordinator.send(self.coord_codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass


class EngineProcess:
    def __init__(self, cfg: EngineProcessConfig, log, *, supervisor=None, keys: CurveKeys | None = None) -> None:
        """`supervisor` and `keys` default to the node's: a SupervisorLink to the
        supervisor's control socket and the key file's CURVE keys. A rank run as
        a Ray actor (ray_rank.py) passes its own link and the secret it was sent."""
        self.cfg = cfg
        self.log = log
        self.rank = cfg.engine.rank
        self.incarnation = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context()
        self.supervisor = supervisor or SupervisorLink(self.ctx, cfg.supervisor_address, cfg.name)
        if keys is None and cfg.key_file:
            keys = CurveKeys.from_file(cfg.key_file, log)
        self.io = _EngineIO(self.ctx, cfg, self.incarnation, keys)
        self.core = None
        self.should_stop = False
        self._last_load: tuple = ()
        self._load_dirty = False
        self._last_report = 0.0
        self._last_heartbeat = 0.0
        self.num_finished = 0
        self.num_aborted = 0

    def _on_signal(self, signum, _frame) -> None:
        self.should_stop = True  # the loop notices; nothing else happens here

    def _make_core(self):
        """The rank's engine: the native EngineCore, or vLLM's engine behind the same interface."""
        if self.cfg.engine.engine == "vllm":
            from dpserve.engine.backends.vllm.core import VllmConfigError, VllmCore

            try:
                return VllmCore(self.cfg.engine, self.log)
            except VllmConfigError as exc:
                self.log.error("the vLLM engine cannot start with this configuration", error=str(exc))
                raise SystemExit(EXIT_CONFIG) from exc
        from dpserve.engine.core import EngineCore  # torch is imported here, not at module load

        return EngineCore(self.cfg.engine)

    def boot(self) -> None:
        t0 = time.monotonic()
        self.supervisor.heartbeat()
        try:
            self.core = self._make_core()
        except SystemExit:
            raise
        except Exception as exc:
            self.log.exception("model failed to load", model=self.cfg.engine.model, engine=self.cfg.engine.engine)
            raise SystemExit(EXIT_STARTUP) from exc
        self.log.info("model loaded", model=self.cfg.engine.model, seconds=round(time.monotonic() - t0, 2), **self.core.describe())
        self.supervisor.heartbeat()
        addresses = self.io.register(self.log, lambda: self.should_stop)
        if self.should_stop:
            return
        self.log.info("registered with the coordinator", address=self.cfg.coordinator_address, node_rank=self.cfg.node_rank)
        self.io.connect_api_servers(addresses)
        self.io.report(EngineReady(self.rank, self.incarnation))
        self._report_load(force=True)
        self.supervisor.ready(f"rank {self.rank}")
        self.log.info("engine ready", api_servers=len(addresses), incarnation=self.incarnation)

    def _progress(self) -> None:
        """Called from inside a step (after every layer): a long step still reports
        load and heartbeats on time, so busy is never mistaken for hung. Only
        this loop calls it: a stopped or deadlocked engine still goes silent."""
        now = time.monotonic()
        if now - self._last_heartbeat >= self.cfg.heartbeat_interval_s or now - self._last_report >= self.cfg.heartbeat_interval_s:
            self._report_load()

    def run(self) -> int:
        core, io = self.core, self.io
        heartbeat_s = self.cfg.heartbeat_interval_s
        core.on_progress = self._progress
        while not self.should_stop:
            # 1. Take input: block only while there is nothing to compute.
            if core.has_unfinished():
                timeout_ms = 0
            elif self._load_dirty:
                timeout_ms = int(LOAD_REPORT_MIN_INTERVAL_S * 1000) + 1  # flush the last change soon
            else:
                timeout_ms = int(heartbeat_s * 1000)
            for index, msg in io.receive(timeout_ms):
                self._handle(index, msg)
            # 2. Step: schedule -> run -> postprocess, all inside the core.
            if core.has_unfinished():
                outputs = core.step()
                # 3. Send every API server its share of this step in one message.
                if outputs:
                    for out in outputs:
                        if out.finish_reason is not None:
                            self.num_finished += 1
                    io.send_outputs(outputs, core.num_running, core.num_waiting)
            # 4. Report load when it changed, and heartbeat from this loop only.
            self._report_load()
        return EXIT_OK

    def _handle(self, index: int, msg: object) -> None:
        if index < 0:
            self._from_coordinator(msg)
        elif isinstance(msg, AddRequest):
            self.io.owner[msg.request_id] = index
            rejected = self.core.add_request(msg)
            if rejected is not None:
                self.num_finished += 1
                self.io.send_outputs([rejected], self.core.num_running, self.core.num_waiting)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
            for rid in msg.request_ids:
                if self.io.owner.pop(rid, None) is not None:
                    self.num_aborted += 1
        elif isinstance(msg, Ping):
            self.io.send_to(index, Pong(self.rank, msg.nonce))

    def _from_coordinator(self, msg: object) -> None:
        """Membership changes: new API servers, or a coordinator that lost us."""
        io = self.io
        if isinstance(msg, ApiServerList):
            io.connect_api_servers(msg.api_server_addresses)
        elif isinstance(msg, PleaseRegister):
            self.log.warning("coordinator asks us to register again", reason=msg.reason)
            io.report(io.registration())
        elif isinstance(msg, RegisterReply):
            if not msg.accepted:
                self.log.error("coordinator refused registration", reason=msg.reason)
                return
            io.connect_api_servers(msg.api_server_addresses)
            io.report(EngineReady(self.rank, self.incarnation))
            self._report_load(force=True)
            self.log.info("registered again with the coordinator")

    def _report_load(self, force: bool = False) -> None:
        core = self.core
        now = time.monotonic()
        load = (core.num_running, core.num_waiting, core.num_waiting_prefill_tokens, self.num_finished, self.num_aborted,
                round(core.kv_usage, 3))
        changed = load != self._last_load
        due = now - self._last_report >= self.cfg.heartbeat_interval_s
        self._load_dirty = changed
        if force or due or (changed and now - self._last_report >= LOAD_REPORT_MIN_INTERVAL_S):
            self._load_dirty = False
            self._last_load = load
            self._last_report = now
            self.io.report(
                LoadReport(
                    self.rank,
                    self.incarnation,
                    core.num_running,
                    core.num_waiting,
                    core.num_waiting_prefill_tokens,
                    core.num_remaining_decode_tokens,
                    core.slot_usage,
                    core.last_step_ms,
                    self.num_finished,
                    self.num_aborted,
                    core.kv_usage,
                    core.num_preemptions,
                    core.num_prefix_queries,
                    core.num_prefix_hits,
                )
            )
        if force or now - self._last_heartbeat >= self.cfg.heartbeat_interval_s:
            self._last_heartbeat = now
            self.supervisor.heartbeat(core.num_running, core.num_waiting, core.kv_usage)

    def announce_death(self, reason: str) -> None:
        """Tell every API server, and make sure the news leaves before the process does.

        The sockets keep LINGER 0 while serving (a gone API server must never
        stall a step); only this last message gets a linger, so close() waits
        for it to be handed over, up to DEATH_LINGER_S in all. Without it
        the context's destruction would drop it, and the API servers would
        learn of the death only from the supervisor, with another reason.
        """
        self.io.broadcast(EngineDead(self.rank, self.incarnation, reason))
        for sock in self.io.api:
            sock.close(linger=int(DEATH_LINGER_S * 1000))

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # already-closed sockets keep their own linger


def serve(proc: EngineProcess, log) -> int:
    """Boot, serve until asked to stop, announce the end: the rank's whole life.
    Returns the exit code. Shared by the process entry point and the Ray actor."""
    code = EXIT_ERROR
    try:
        proc.boot()
        if proc.should_stop:
            code = EXIT_OK
        else:
            code = proc.run()
            proc.announce_death("engine shut down")
            log.info("engine stopped")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else EXIT_ERROR
    except Exception as exc:
        log.exception("engine failed")
        proc.announce_death(f"engine rank {proc.rank} failed: {type(exc).__name__}: {exc}")
        code = EXIT_ERROR
    finally:
        proc.close()
    return code


def main() -> None:
    cfg = child_config_from_env(EngineProcessConfig)
    die_with_parent(cfg.parent_pid)
    set_process_name(f"dpserve-dp{cfg.engine.rank}")
    from dpserve.engine.common.logs import setup_logging

    log = setup_logging(cfg.name, cfg.log_level).bind(rank=cfg.engine.rank)
    proc = EngineProcess(cfg, log)
    signal.signal(signal.SIGTERM, proc._on_signal)
    signal.signal(signal.SIGINT, proc._on_signal)
    os._exit(serve(proc, log))


if __name__ == "__main__":
    main()
