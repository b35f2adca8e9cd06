"""The per-node supervisor: starts, watches, probes, restarts and stops every child.

Main loop, one fixed sequence of short verbs: wait for an event -> handle it
(reap, readiness, probe verdicts, signals) -> reconcile (restarts, kill
deadlines) -> notify systemd. Signal handlers only put the signal on the
event queue. The supervisor owns the shared listening socket (bound once,
no SO_REUSEPORT) and hands it to every API server.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio
from dpserve.engine.common.auth import HANDSHAKE_EVENTS, CurveKeys, describe_handshake_failure, make_client
from dpserve.engine.common.procutil import (
    EXIT_CONFIG,
    EXIT_NOTHING_SERVES,
    EXIT_OK,
    EXIT_STARTUP,
    become_subreaper,
    describe_exit,
)
from dpserve.engine.config import (
    resolve_max_model_len,
)
from dpserve.engine.protocol import (
    ChildReady,
    Codec,
    CoordinatorInput,
    Heartbeat,
    RankDown,
    ToSupervisor,
)
from zmq.utils.monitor import parse_monitor_message

from .children import Child, ChildState, spawn
from .config import Addresses, ServeConfig
from .health import HealthServer
from .launcher import Launcher, reap_strays
from .notify import Notifier
from .plan import StartupError, bind_listen_socket, node_address_towards, plan_children
from .probes import Prober

_enc = msgspec.json.Encoder().encode


class Supervisor:
    def __init__(self, cfg: ServeConfig, log, ports_file: str | None = None) -> None:
        self.cfg = cfg
        self.log = log
        self.ports_file = ports_file
        self.children: dict[str, Child] = {}
        self.events: asyncio.Queue = asyncio.Queue()
        self.notifier = Notifier()
        self.phase = "starting"  # starting -> serving -> stopping
        self.exit_code = EXIT_OK
        self.heartbeat_interval_s = min(1.0, cfg.probe_interval_s / 2)
        self.listen_socks: list[socket.socket] = []
        self.keys = None
        self.run_dir = ""
        self._own_run_dir = False
        self.health = HealthServer(self)
        self.prober = Prober(self)
        self.zctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task] = []
        self._last_watchdog = 0.0
        self._rolling: asyncio.Task | None = None
        self.port = 0
        self.launcher: Launcher | None = None
        self._spawning = 0
        self._last_stray_sweep = 0.0

    # ================================================================ setup

    def _prepare(self) -> None:
        cfg = self.cfg
        self.max_model_len = resolve_max_model_len(cfg.model, cfg.max_model_len)
        self.keys = CurveKeys.from_file(cfg.key_file, self.log) if cfg.key_file else None
        if cfg.runs_api_servers:
            count = cfg.api_server_count if cfg.lb_mode == "external" else 1
            # external LB: one port per local rank (port + i); otherwise one shared port
            self.listen_socks = [bind_listen_socket(cfg.host, cfg.port + i if cfg.port else 0) for i in range(count)]
            self.port = self.listen_socks[0].getsockname()[1]
        if cfg.run_dir:
            os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
            self.run_dir = cfg.run_dir
        else:
            self.run_dir = tempfile.mkdtemp(prefix="dpserve-")
            self._own_run_dir = True
        self.node_address = cfg.node_address or node_address_towards(cfg.data_parallel_address)
        self.addr = Addresses.for_node(cfg, self.run_dir, self.node_address)
        self.ctl = self.zctx.socket(zmq.PULL)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.bind(self.addr.supervisor)
        self.coord_link = self.zctx.socket(zmq.DEALER)
        self.coord_link.setsockopt(zmq.LINGER, 0)
        self.coord_link.setsockopt(zmq.IDENTITY, f"supervisor-{cfg.data_parallel_start_rank}".encode())
        make_client(self.coord_link, self.keys)
        self.coord_link.connect(self.addr.coordinator_engines)
        self._coord_codec = Codec(CoordinatorInput)
        for child in plan_children(cfg, self.addr, self.listen_socks, self.max_model_len, self.heartbeat_interval_s):
            self._add(child)
        if self._children("api") and cfg.api_server_launch == "prefork":
            if become_subreaper():
                self.launcher = Launcher(os.getpid(), ["dpserve.daemons.api_server", "uvloop"], self.log, cfg.log_level)
            else:
                self.log.warning("cannot become a child subreaper; API servers start with exec")

    def _add(self, child: Child) -> None:
        self.children[child.name] = child

    def _children(self, kind: str) -> list[Child]:
        return [c for c in self.children.values() if c.kind == kind]

    # ================================================================ run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self.events.put_nowait, ("signal", sig))
        try:
            await self.health.start(self.cfg.supervisor_host, self.cfg.supervisor_port)
        except OSError as exc:
            self.log.error("cannot bind the supervisor port", port=self.cfg.supervisor_port, error=str(exc))
            return EXIT_CONFIG
        try:
            self._prepare()
        except (StartupError, ValueError) as exc:
            self.log.error("cannot start", error=str(exc))
            await self.health.stop()
            return exc.code if isinstance(exc, StartupError) else EXIT_CONFIG
        self._write_ports_file()
        self.log.info(
            "starting",
            model=self.cfg.model,
            port=self.port,
            supervisor_port=self.health.port,
            data_parallel_size=self.cfg.data_parallel_size,
            api_server_count=self.cfg.api_server_count,
            run_dir=self.run_dir,
        )
        self._tasks.append(asyncio.create_task(self._read_ctl(), name="ctl"))
        if self.keys is not None and not self.cfg.runs_coordinator:
            self._tasks.append(asyncio.create_task(self._watch_coordinator_link(), name="coordinator-link"))
        try:
            code = self.exit_code = await self._startup()
            if code == EXIT_OK:
                self._tasks.append(asyncio.create_task(self.prober.run(), name="prober"))
                code = await self._serve()
        finally:
            await self._shutdown()
        return code

    def _write_ports_file(self) -> None:
        if self.ports_file:
            tmp = self.ports_file + ".tmp"
            with open(tmp, "wb") as f:
                f.write(_enc({"port": self.port, "supervisor_port": self.health.port, "pid": os.getpid()}))
            os.replace(tmp, self.ports_file)

    # ================================================================ startup

    async def _startup(self) -> int:
        cfg = self.cfg
        now = time.monotonic()
        for child in self.children.values():
            timeout = {
                "engine": cfg.engine_startup_timeout_s,
                "api": cfg.api_server_startup_timeout_s,
            }.get(child.kind, cfg.coordinator_startup_timeout_s)
            child.deadline = now + timeout
        if self.launcher is not None:
            await self.launcher.start(sys.stderr.buffer)
        await asyncio.gather(*(self._start(c) for c in self.children.values()))
        budget_end = max(c.deadline for c in self.children.values())
        self.notifier.extend_timeout(budget_end - now + 5)
        last_extend = now
        while True:
            self._update_status()
            if all(c.state == ChildState.READY for c in self.children.values()) and self.prober.all_ranks_routable:
                break
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=0.2)
            except asyncio.TimeoutError:
                event = None
            now = time.monotonic()
            if event is not None:
                kind = event[0]
                if kind == "signal" and event[1] in (signal.SIGTERM, signal.SIGINT):
                    self.log.info("stop requested during startup")
                    return EXIT_OK
                if kind == "fatal":
                    return event[1]
                if kind == "exit":
                    _, child, pid, rc = event
                    if pid == child.pid:
                        child.state = ChildState.EXITED
                        child.last_exit = describe_exit(rc)
                        self.log.error("child died during startup", child=child.name, how=child.last_exit)
                        return rc if rc in (EXIT_CONFIG, EXIT_STARTUP) else EXIT_STARTUP
            late = [c for c in self.children.values() if c.state != ChildState.READY and now > c.deadline]
            if not late and now > budget_end and not self.prober.all_ranks_routable:
                self.log.error(
                    "startup timed out waiting for the cluster",
                    ranks_registered=self.prober.num_alive_ranks,
                    data_parallel_size=cfg.data_parallel_size,
                )
                return EXIT_STARTUP
            if late:
                names = ", ".join(c.name for c in late)
                self.log.error("startup timed out", children=names, timeouts_s={c.name: round(c.deadline - c.started_at, 1) for c in late})
                return EXIT_STARTUP
            if all(c.state == ChildState.READY for c in self.children.values()):
                await self.prober.check_routable()
            if now - last_extend > 5:
                self.notifier.extend_timeout(max(c.deadline for c in self.children.values()) - now + 5)
                last_extend = now
            self._watchdog(now)
        self.phase = "serving"
        status = self._status_line()
        self.notifier.ready(status)
        self.log.info("node ready", status=status, seconds=round(time.monotonic() - min(c.started_at for c in self.children.values()), 2))
        return EXIT_OK

    async def _start(self, child: Child) -> None:
        self._spawning += 1
        try:
            await spawn(child, sys.stderr.buffer, self.launcher)
        finally:
            self._spawning -= 1
        self.log.info("child started", child=child.name, pid=child.pid)
        asyncio.create_task(self._wait_exit(child, child.proc))

    async def _wait_exit(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        self.events.put_nowait(("exit", child, proc.pid, rc))

    async def _read_ctl(self) -> None:
        codec = Codec(ToSupervisor)
        while True:
            data = await self.ctl.recv()
            try:
                msg = codec.decode(data)
            except Exception:
                continue
            child = self.children.get(msg.name)
            if child is None or child.pid != msg.pid:
                continue  # a message from a previous incarnation
            if isinstance(msg, Heartbeat):
                child.last_heartbeat = time.monotonic()
                child.num_running = msg.num_running
                child.num_waiting = msg.num_waiting
                child.kv_usage = msg.kv_usage
            elif isinstance(msg, ChildReady) and child.state == ChildState.STARTING:
                child.state = ChildState.READY
                child.ready_at = time.monotonic()
                child.last_heartbeat = child.ready_at
                self.events.put_nowait(("ready", child))

    async def _watch_coordinator_link(self) -> None:
        """Workers: a coordinator that never completes a CURVE handshake means a wrong
        key file or address. Say so within seconds, not after the startup timeout;
        during startup a failed handshake (the head holds another key) halts the node."""
        address = self.addr.coordinator_engines
        question = f"no answer from the coordinator at {address}: wrong key file or address?"
        monitor = self.coord_link.get_monitor_socket(HANDSHAKE_EVENTS)
        started = time.monotonic()
        answered = False
        failures = 0
        last_said = 0.0
        try:
            while True:
                try:
                    frames = await asyncio.wait_for(monitor.recv_multipart(), timeout=10.0)
                except asyncio.TimeoutError:
                    now = time.monotonic()
                    if not answered and now - last_said >= 60.0:
                        last_said = now
                        self.log.warning(question, waited_s=round(now - started), detail="no handshake yet (is the head up?)")
                    continue
                event = parse_monitor_message(frames)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if not answered and failures:
                        self.log.info("the coordinator answers", address=address)
                    answered, failures = True, 0
                    continue
                failures += 1
                answered = False
                now = time.monotonic()
                if failures >= 3 and now - last_said >= 60.0:
                    last_said = now
                    detail = describe_handshake_failure(event["event"], event["value"])
                    self.log.error(question, detail=detail, attempts=failures, key_file=self.cfg.key_file)
                    if self.phase == "starting":
                        self.events.put_nowait(("fatal", EXIT_CONFIG))
        finally:
            monitor.close(0)

    # ================================================================ serve

    async def _serve(self) -> int:
        while self.phase == "serving":
            # 1. Wait for an event, but not past the next reconcile tick.
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=0.1)
            except asyncio.TimeoutError:
                event = None
            # 2. Handle it.
            if event is not None:
                self._handle(event)
            # 3. Reconcile: restarts due, kill deadlines, what the node can still do.
            await self._reconcile(time.monotonic())
            # 4. Tell systemd.
            self._update_status()
            self._watchdog(time.monotonic())
        return self.exit_code

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "signal":
            sig = event[1]
            if sig == signal.SIGHUP:
                self._begin_rolling_restart()
            else:
                self.log.info("stop requested", signal=signal.Signals(sig).name)
                self.phase = "stopping"
        elif kind == "exit":
            self._reap(*event[1:])
        elif kind == "ready":
            child = event[1]
            extra = {"restarts": child.restarts} if child.restarts else {}
            self.log.info("child ready", child=child.name, pid=child.pid, seconds=round(child.ready_at - child.started_at, 2), **extra)
        elif kind == "dead":
            _, child, pid, reason = event
            if pid == child.pid and child.state in (ChildState.READY, ChildState.STARTING):
                self.log.error("child declared dead", child=child.name, pid=pid, reason=reason)
                child.failure = f"declared dead: {reason}"
                self._take_out_of_routing(child, reason)
                self._terminate(child, kill_after=self.cfg.kill_grace_s, cont=True)

    def _reap(self, child: Child, pid: int, rc: int) -> None:
        if pid != child.pid:
            return
        how = describe_exit(rc, killed_by_us=child.kill_requested)
        child.last_exit = how
        was = child.state
        child.proc = None
        if self.phase != "serving":
            child.state = ChildState.EXITED
            return
        planned = was == ChildState.STOPPING and child.restart_requested
        level = self.log.info if planned else self.log.error
        level("child exited", child=child.name, pid=pid, how=how, **({"after": child.failure} if child.failure else {}))
        self._take_out_of_routing(child, f"process exited ({how})")
        if planned:
            child.state = ChildState.BACKOFF
            child.next_start_at = time.monotonic()
            return
        if rc in (EXIT_CONFIG, EXIT_STARTUP):
            child.state = ChildState.EXITED
            child.gave_up = True
            self.log.error("child cannot boot; not restarting it", child=child.name, how=how)
            return
        policy = self.cfg.restart_policy
        # A child we stopped for failing (probes, a late start) failed, however cleanly it exited.
        failed = rc != 0 or bool(child.failure)
        if policy == "never" or (policy == "on-failure" and not failed):
            child.state = ChildState.EXITED
            return
        now = time.monotonic()
        window = self.cfg.restart_window_s
        child.restart_times = [t for t in child.restart_times if now - t < window]
        if len(child.restart_times) >= self.cfg.max_restarts:
            child.state = ChildState.EXITED
            child.gave_up = True
            self.log.error("child keeps crashing; giving up on it", child=child.name, restarts_in_window=len(child.restart_times), window_s=window)
            return
        delay = min(self.cfg.restart_backoff_initial_s * (2 ** len(child.restart_times)), self.cfg.restart_backoff_max_s)
        child.restart_times.append(now)
        child.state = ChildState.BACKOFF
        child.next_start_at = now + delay
        self.log.info("restarting child", child=child.name, in_s=round(delay, 2))

    def _take_out_of_routing(self, child: Child, reason: str) -> None:
        if child.kind == "engine":
            try:
                self.coord_link.send(self._coord_codec.encode(RankDown(child.rank, reason)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _terminate(self, child: Child, kill_after: float, cont: bool = False) -> None:
        if child.proc is None or child.proc.returncode is not None:
            return
        child.state = ChildState.STOPPING
        child.deadline = time.monotonic() + kill_after
        try:
            os.kill(child.pid, signal.SIGTERM)
            if cont:
                os.kill(child.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        except ProcessLookupError:
            pass

    async def _reconcile(self, now: float) -> None:
        for child in self.children.values():
            if child.state == ChildState.STOPPING and now > child.deadline and not child.kill_requested:
                child.kill_requested = True
                self.log.warning("child did not stop in time; killing it", child=child.name, pid=child.pid)
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            elif child.state == ChildState.BACKOFF and now >= child.next_start_at:
                child.restarts += 1
                timeout = self.cfg.engine_startup_timeout_s if child.kind == "engine" else self.cfg.api_server_startup_timeout_s
                await self._start(child)
                child.deadline = time.monotonic() + timeout
            elif child.state == ChildState.STARTING and child.restarts and now > child.deadline:
                self.log.error("restarted child did not become ready in time", child=child.name)
                child.failure = "not ready in time"
                self._terminate(child, kill_after=self.cfg.kill_grace_s)
        if now - self._last_stray_sweep > 5.0 and not self._spawning:
            self._last_stray_sweep = now
            known = {c.pid for c in self.children.values() if c.proc is not None}
            if self.launcher is not None:
                known.add(self.launcher.pid)
            for pid, rc in reap_strays(known):
                self.log.warning("reaped a stray process", pid=pid, how=describe_exit(rc))
        code = self._cannot_serve()
        if code:
            self.exit_code = code
            self.phase = "stopping"

    def _cannot_serve(self) -> int:
        """Non-zero when no engine or no API server can ever serve again without systemd."""
        for kind in ("engine", "api", "coordinator"):
            group = self._children(kind)
            if group and all(c.gave_up for c in group):
                self.log.error("nothing left that can serve; exiting so systemd can restart the node", kind=kind)
                return EXIT_NOTHING_SERVES
        return 0

    # ================================================================ SIGHUP

    def _begin_rolling_restart(self) -> None:
        if self._rolling is not None and not self._rolling.done():
            self.log.info("rolling restart already in progress")
            return
        self.log.info("rolling restart of API servers", count=self.cfg.api_server_count)
        self._rolling = asyncio.create_task(self._rolling_restart())

    async def _rolling_restart(self) -> None:
        if self.launcher is not None:
            # A fresh launcher, so code upgraded on disk reaches the new API servers.
            await self.launcher.restart(sys.stderr.buffer)
        for child in self._children("api"):
            if self.phase != "serving":
                return
            if child.state != ChildState.READY:
                continue
            old_pid = child.pid
            child.restart_requested = True
            self._terminate(child, kill_after=self.cfg.shutdown_timeout_s + self.cfg.kill_grace_s)
            # The exit is reaped by the main loop, which schedules the restart;
            # wait until a new process of this child is ready before the next.
            deadline = time.monotonic() + self.cfg.shutdown_timeout_s + self.cfg.kill_grace_s + self.cfg.api_server_startup_timeout_s
            while time.monotonic() < deadline and self.phase == "serving":
                if child.pid != old_pid and child.state == ChildState.READY:
                    break
                await asyncio.sleep(0.05)
        self.log.info("rolling restart done")

    # ================================================================ shutdown

    async def _keep_watchdog_fed(self) -> None:
        """While shutting down: systemd re-arms its watchdog on every ping, so one
        sent as the stop began would kill a drain longer than WatchdogSec."""
        while True:
            self._watchdog(time.monotonic())
            await asyncio.sleep(0.5)

    async def _shutdown(self) -> None:
        self.phase = "stopping"
        self.notifier.stopping("stopping: draining API servers")
        # Refuse new connections at once: the kernel keeps a listening socket (and
        # queues connections nobody will serve) while any process holds it, and the
        # API servers close theirs as their drain starts. Nothing is spawned from here on.
        self._close_listen_socks()
        pinger = asyncio.create_task(self._keep_watchdog_fed())
        self._tasks.append(pinger)
        cfg = self.cfg
        apis = [c for c in self._children("api") if c.proc is not None and c.proc.returncode is None]
        for child in apis:
            self._terminate(child, kill_after=cfg.shutdown_timeout_s + cfg.kill_grace_s)
        await self._wait_all(apis, cfg.shutdown_timeout_s + cfg.kill_grace_s)
        if self.launcher is not None:
            await self.launcher.stop()
        self.notifier.status("stopping: engines")
        rest = [c for c in self.children.values() if c.proc is not None and c.proc.returncode is None]
        for child in rest:
            self._terminate(child, kill_after=cfg.kill_grace_s)
        await self._wait_all(rest, cfg.kill_grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.health.stop()
        self.zctx.destroy(linger=0)
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.log.info("stopped", exit_code=self.exit_code)

    def _close_listen_socks(self) -> None:
        for sock in self.listen_socks:
            sock.close()

    async def _wait_all(self, children: list[Child], timeout: float) -> None:
        """One deadline for the group; survivors get SIGKILL, then are reaped."""
        procs = [c.proc for c in children if c.proc is not None]
        if not procs:
            return
        _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout)
        if pending:
            for child in children:
                if child.proc is not None and child.proc.returncode is None:
                    self.log.warning("killing child that did not stop", child=child.name, pid=child.pid)
                    try:
                        os.kill(child.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            await asyncio.wait(pending, timeout=5)

    # ================================================================ views

    def _status_line(self) -> str:
        engines = self._children("engine")
        apis = self._children("api")
        ready_e = sum(c.state == ChildState.READY for c in engines)
        ready_a = sum(c.state == ChildState.READY for c in apis)
        text = f"{ready_e}/{len(engines)} ranks ready, {ready_a}/{len(apis)} API servers ready"
        if self.cfg.is_multi_node:
            text = f"{ready_e}/{len(engines)} local ranks ready"
            if apis:
                text += f", {ready_a}/{len(apis)} API servers ready, {self.prober.num_alive_ranks}/{self.cfg.data_parallel_size} ranks registered"
        if self.phase == "starting":
            loading = [str(c.rank) for c in engines if c.state == ChildState.STARTING]
            if loading:
                text += f", loading rank {','.join(loading)}"
        elif self.phase == "serving":
            text = (f"serving on port {self.port}: " if apis else "serving: ") + text
        return text

    def _update_status(self) -> None:
        self.notifier.status(self._status_line())

    def _watchdog(self, now: float) -> None:
        interval = self.notifier.watchdog_interval_s
        if interval and now - self._last_watchdog >= interval:
            self._last_watchdog = now
            self.notifier.watchdog()

    def unhealthy_children(self) -> list[dict]:
        bad = []
        for c in self.children.values():
            if self.phase == "starting" and c.state in (ChildState.NEW, ChildState.STARTING):
                continue
            # One failed probe is a blip; the child is unhealthy once it reaches the threshold.
            if c.state != ChildState.READY or c.consecutive_failures >= self.cfg.probe_failure_threshold:
                bad.append({"name": c.name, "state": c.state.value, "consecutive_failures": c.consecutive_failures, "last_exit": c.last_exit or None})
        return bad

    def node_ready(self) -> tuple[bool, str]:
        if self.phase != "serving":
            return False, self.phase
        if self.cfg.runs_api_servers and not any(c.state == ChildState.READY for c in self._children("api")):
            return False, "no API server is ready"
        if not any(c.state == ChildState.READY for c in self._children("engine")):
            return False, "no rank is ready"
        return True, ""

    def status_dict(self) -> dict:
        now = time.monotonic()
        ready, reason = self.node_ready()
        return {
            "phase": self.phase,
            "ready": ready,
            "reason": reason,
            "pid": os.getpid(),
            "port": self.port,
            "supervisor_port": self.health.port,
            "model": self.cfg.served_model_name,
            "data_parallel_size": self.cfg.data_parallel_size,
            "api_server_count": self.cfg.api_server_count,
            "children": [c.as_dict(now) for c in self.children.values()],
            "launcher": self.launcher.as_dict() if self.launcher is not None else None,
        }
