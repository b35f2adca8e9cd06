"""The engine process of one DP rank: sockets around a RankEngine.

The busy loop alone owns the engine; socket work is confined to RankIO
(engine/rank/io.py, shared with the simulated engine), which only moves
bytes between ZeroMQ and Python objects.
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
from dpserve.engine.common.procutil import EXIT_CONFIG, EXIT_ERROR, EXIT_OK, EXIT_STARTUP, SupervisorLink, start_child
from dpserve.engine.common.protocol import AddRequest
from dpserve.engine.interface import RankEngine
from dpserve.engine.rank.io import COORDINATOR, LOAD_REPORT_MIN_INTERVAL_S, WELCOMED, RankIO
from dpserve.engine.rank.node_relay import RelayLink

# How long a dying engine waits for its EngineDead to reach each API server.
# Long enough for any live peer (vLLM lingers seconds); short enough that an
# engine whose API servers are already gone (node shutdown) still exits well
# within the supervisor's kill grace (5 s by default).
DEATH_LINGER_S = 1.0
# The supervisor drains a rank (`dpserve drain`) with this signal instead of SIGTERM:
# the engine stops at once the same way, but its last words say it was drained, so
# its API servers move its requests and every view shows "drained", not a failure.
DRAIN_SIGNAL = signal.SIGUSR1
DRAINED_REASON = "drained (dpserve drain)"
# Under the priority policy, how often a step in progress looks for a more urgent request
# (after a layer, at most this often): a peek costs 3-26 us (1-32 API servers), a layer of a 135M model 2-3 ms.
PEEK_EVERY_S = 0.004
YIELD_STEPS = os.environ.get("DPSERVE_YIELD_STEPS", "1") != "0"  # 0: steps never give way (benchmarks' A/B)


class EngineProcess:
    """One rank: a RankEngine, its RankIO and the busy loop that alone drives both."""

    def __init__(self, cfg: EngineProcessConfig, log, *, supervisor=None, keys: CurveKeys | None = None) -> None:
        """`supervisor` and `keys` default to the node's: a SupervisorLink to the
        supervisor's control socket and the key file's CURVE keys. A rank run as
        a Ray actor (backends/ray/rank.py) passes its own link and the secret it was sent."""
        self.cfg = cfg
        self.log = log
        self.rank = cfg.engine.rank
        self.incarnation = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context()
        self.supervisor = supervisor or SupervisorLink(self.ctx, cfg.supervisor_address, cfg.name)
        if keys is None and cfg.key_file:
            keys = CurveKeys.from_file(cfg.key_file, log)
        self.poller = zmq.Poller()
        self.io = RankIO(
            self.ctx, keys, rank=self.rank, incarnation=self.incarnation, fingerprint=cfg.fingerprint,
            node_rank=cfg.node_rank, coordinator_address=cfg.coordinator_address, log=log,
            watch=lambda sock: self.poller.register(sock, zmq.POLLIN),
        )
        if cfg.node_relay_address:  # one message per node (issue 30): the supervisor's relay sends them on
            relay = RelayLink(self.ctx, cfg.node_relay_address)
            self.io.load_sink = relay.send
            if cfg.node_hop:  # --rank-links node: the API servers through the node's hops (node_hop.py)
                self.io.hop = relay.hop
        # Signals wake the busy loop's poll at once (pyzmq resumes an interrupted poll,
        # so a SIGTERM or a drain would otherwise wait out an idle poll's heartbeat_s).
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self.poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self.core: RankEngine | None = None
        self.should_stop = False
        self.stop_reason = "engine shut down"  # what EngineDead says when the loop ends as asked
        self._last_heartbeat = 0.0
        self._last_peek = 0.0
        self._said_yield = False
        self._early: list[tuple[int, object]] = []  # API servers' messages read inside a step, delivered after it

    def _on_signal(self, signum, _frame) -> None:
        self.should_stop = True  # the loop notices; nothing else happens here
        if signum == DRAIN_SIGNAL:
            self.stop_reason = DRAINED_REASON

    def _make_core(self) -> RankEngine:
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
        if not self.io.register_and_wait(lambda: self.should_stop):
            raise SystemExit(EXIT_CONFIG)  # refused: RankIO logged the coordinator's reason
        if self.should_stop:
            return
        self.log.info("registered with the coordinator", address=self.cfg.coordinator_address, node_rank=self.cfg.node_rank)
        self._report_load(force=True)
        self.supervisor.ready(f"rank {self.rank}")
        self.log.info("engine ready", api_servers=len(self.io.api), incarnation=self.incarnation)

    def _progress(self) -> None:
        """Called from inside a step (after every layer): a long step still reports
        load and heartbeats on time, so busy is never mistaken for hung. Only
        this loop calls it: a stopped or deadlocked engine still goes silent."""
        now = time.monotonic()
        heartbeat_s = self.cfg.heartbeat_interval_s
        if now - self._last_heartbeat >= heartbeat_s or now - self.io.last_report >= heartbeat_s:
            self._report_load()

    def run(self) -> int:
        core, io = self.core, self.io
        heartbeat_s = self.cfg.heartbeat_interval_s
        core.on_progress = self._progress
        if self.cfg.engine.scheduling_policy == "priority" and YIELD_STEPS:
            core.yield_check = self._more_urgent_arrived
        while not self.should_stop:
            if self._early:  # read during the last step, in the order they came
                early, self._early = self._early, []
                for index, msg in early:
                    io.deliver(index, msg, core)
            # 1. Take input: block only while there is nothing to compute.
            if core.has_unfinished():
                timeout_ms = 0
            elif io.load_dirty:
                timeout_ms = int(LOAD_REPORT_MIN_INTERVAL_S * 1000) + 1  # flush the last change soon
            else:
                timeout_ms = int(heartbeat_s * 1000)
            for sock, _ in self.poller.poll(timeout_ms):
                if sock == self._wake_r.fileno():
                    self._wake_r.recv(64)  # a signal: its handler already set what the loop reads
                    continue
                for index, msg in io.read(sock):
                    if index == COORDINATOR:
                        self._from_coordinator(msg)
                    else:
                        io.deliver(index, msg, core)
            # 2. Step: schedule -> run -> postprocess, all inside the core.
            if core.has_unfinished():
                outputs = core.step()
                # 3. Send every API server its share of this step, with the step's KV events
                # when it asked for them (issue 29), in one message.
                if outputs:
                    io.send_outputs(outputs, core)
                else:
                    io.kv.after_step(io, core)
            # 4. Report load when it changed, and heartbeat from this loop only.
            self._report_load()
        return EXIT_OK

    def _more_urgent_arrived(self, bar: int) -> bool:
        """Called from inside a step: read what the API servers sent meanwhile (kept for after
        the step) and say whether a new request is more urgent than `bar` (the step's least urgent
        work), which then gives way to it (engine/step_yield.py): it waits for a layer, not for a
        whole step, and the urgent step after leaves the less urgent work out."""
        now = time.monotonic()
        if now - self._last_peek < PEEK_EVERY_S:
            return False
        self._last_peek = now
        urgent = False
        for sock, _ in self.poller.poll(0):
            if not self.io.is_api_socket(sock):
                continue  # the coordinator, a monitor, a signal: the loop's, after the step
            for index, msg in self.io.read(sock):
                self._early.append((index, msg))
                urgent = urgent or (isinstance(msg, AddRequest) and msg.params.priority < bar
                                    and msg.params.guided_grammar is None)  # (a grammar compiles first)
        if urgent and not self._said_yield:
            self._said_yield = True
            self.log.info("a step gave way to a more urgent request (said once; DPSERVE_YIELD_STEPS=0 turns it off)")
        return urgent

    def _from_coordinator(self, msg: object) -> None:
        if self.io.on_coordinator(msg) == WELCOMED:
            self._report_load(force=True)
            self.log.info("registered again with the coordinator")

    def _report_load(self, force: bool = False) -> None:
        core = self.core
        now = time.monotonic()
        self.io.report_load(core, now, force=force, every_s=self.cfg.heartbeat_interval_s)
        if force or now - self._last_heartbeat >= self.cfg.heartbeat_interval_s:
            self._last_heartbeat = now
            self.supervisor.heartbeat(core.num_running, core.num_waiting, core.kv_usage)

    def announce_death(self, reason: str, clean: bool = False) -> None:
        """Tell every API server, and make sure the news leaves before the process does.

        The sockets keep LINGER 0 while serving (a gone API server must never
        stall a step); only this last message gets a linger, so close() waits
        for it to be handed over, up to DEATH_LINGER_S in all. Without it
        the context's destruction would drop it, and the API servers would
        learn of the death only from the supervisor, with another reason.
        """
        self.io.announce_death(reason, linger_s=DEATH_LINGER_S, clean=clean)

    def wake_on_signals(self) -> None:
        """From the main thread: a signal's byte lands on the loop's wake-up socket."""
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # already-closed sockets keep their own linger
        self._wake_r.close()
        self._wake_w.close()


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
            proc.announce_death(proc.stop_reason, clean=True)
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
    cfg = start_child(EngineProcessConfig, lambda cfg: f"dpserve-dp{cfg.engine.rank}")
    from dpserve.engine.common.logs import setup_logging

    log = setup_logging(cfg.name, cfg.log_level).bind(rank=cfg.engine.rank)
    proc = EngineProcess(cfg, log)
    signal.signal(signal.SIGTERM, proc._on_signal)
    signal.signal(signal.SIGINT, proc._on_signal)
    signal.signal(DRAIN_SIGNAL, proc._on_signal)
    proc.wake_on_signals()
    os._exit(serve(proc, log))


if __name__ == "__main__":
    main()
