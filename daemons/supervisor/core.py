"""The supervisor's loop: the single writer of the node's state.

run(): set up -> start every child -> loop -> shut down. The loop is one
fixed sequence of verbs (see the package docstring): wait for events ->
apply each -> tick (deadlines, restarts due, rolling restart, startup
verdict) -> notify systemd. Every verb is short, synchronous and never
awaits a process: spawns run as tasks and report back with an event.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import time

import zmq
import zmq.asyncio
from dpserve.daemons.config import ServeConfig
from dpserve.daemons.supervisor import draining, rolling, startup
from dpserve.daemons.supervisor import events as ev
from dpserve.daemons.supervisor.boot import prepare, write_ports_file
from dpserve.daemons.supervisor.children import Child, ChildState, launch, started
from dpserve.daemons.supervisor.cluster import ClusterState
from dpserve.daemons.supervisor.health import HealthServer
from dpserve.daemons.supervisor.launcher import Launcher, reap_strays
from dpserve.daemons.supervisor.notify import Notifier
from dpserve.daemons.supervisor.plan import RayPlan, StartupError, check_ray_cluster
from dpserve.daemons.supervisor.policy import Action, RestartPolicy, decide, node_exit_code
from dpserve.daemons.supervisor.probes import Prober
from dpserve.daemons.supervisor.producers import read_control, read_table, watch_coordinator_link, watch_exit
from dpserve.daemons.supervisor.rolling import RollingRestart
from dpserve.daemons.supervisor.shutdown import shutdown, stop_relays
from dpserve.daemons.supervisor.views import NodeView
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.procutil import EXIT_CONFIG, EXIT_ERROR, EXIT_OK, EXIT_STARTUP, OomRecord, describe_exit
from dpserve.engine.common.protocol import CoordinatorInput, NodeHello, RankDown

TICK_S = 0.1  # the loop runs its timers at least this often
STRAY_SWEEP_S = 5.0
NODE_HELLO_S = 5.0  # how often a node tells the coordinator its address (a restarted head hears it again)


class Supervisor:
    def __init__(self, cfg: ServeConfig, log, ports_file: str | None = None) -> None:
        self.cfg = cfg
        self.log = log
        self.ports_file = ports_file
        self.clock = time.monotonic  # the loop's only clock (tests give it a fake one)
        self.children: dict[str, Child] = {}  # the child table, keyed by name; written by the loop only
        self.events: asyncio.Queue[ev.Event] = asyncio.Queue()
        self.notifier = Notifier()
        self.phase = "starting"  # starting -> serving -> stopping
        self.exit_code = EXIT_OK
        self.policy = RestartPolicy.from_config(cfg)
        self.oom = OomRecord()  # the kernel's OOM-kill count, so a SIGKILL is named by its sender
        self.heartbeat_interval_s = min(1.0, cfg.probe_interval_s / 2)
        self.listen_socks: list[socket.socket] = []
        self.keys = None
        self.run_dir = ""
        self.own_run_dir = False
        self.ray_plan: RayPlan | None = None  # --data-parallel-backend ray: what the cluster check learnt
        self.port = 0
        self.launcher: Launcher | None = None
        self.zctx = zmq.asyncio.Context()
        self.coord_link = None
        self.node_address = ""  # this node's address towards the head (boot.prepare)
        self.coord_codec = Codec(CoordinatorInput)
        self.all_ranks_routable = False
        self.num_alive_ranks = 0  # as the API servers see the cluster (coordinator's table)
        self.cluster = ClusterState(cfg.data_parallel_size, cfg.probe_interval_s * cfg.probe_failure_threshold, time.time(), cfg.size_max)
        self.table_sub = None
        self.load_relay = None  # the node's relays (relays.py), started by boot.prepare
        self.table_relay = None
        self.view = NodeView(self)
        self.health = HealthServer(self.view, draining.DrainEndpoints(self.post, cfg.key_file))
        self.prober = Prober(self.view, self.post)
        self.tasks: list[asyncio.Task] = []
        self.spawn_tasks: set[asyncio.Task] = set()
        self.rolling: RollingRestart | None = None
        self._last_watchdog = 0.0
        self._last_stray_sweep = 0.0
        self._last_hello = -NODE_HELLO_S
        self.last_extend = 0.0  # when systemd last heard EXTEND_TIMEOUT_USEC (startup.py)

    def post(self, event: ev.Event) -> None:
        """The one way in for producers: signal handlers, tasks, the prober."""
        self.events.put_nowait(event)

    # ================================================================ run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self.post, ev.SignalReceived(sig))
        try:
            await self.health.start(self.cfg.supervisor_host, self.cfg.supervisor_port)
        except OSError as exc:
            self.log.error("cannot bind the supervisor port", port=self.cfg.supervisor_port, error=str(exc))
            return EXIT_CONFIG
        try:
            if self.cfg.uses_ray:
                self.notifier.status("checking the Ray cluster")
                # in a thread: bounded, but seconds long, and /health keeps answering meanwhile
                self.ray_plan = await asyncio.to_thread(check_ray_cluster, self.cfg)
            prepare(self)
        except (StartupError, ValueError) as exc:
            self.log.error("cannot start", error=str(exc))
            stop_relays(self)
            await self.health.stop()
            if self.own_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            return exc.code if isinstance(exc, StartupError) else EXIT_CONFIG
        write_ports_file(self.ports_file, self.port, self.health.port)
        self.log.info(
            "starting",
            model=self.cfg.model,
            port=self.port,
            supervisor_port=self.health.port,
            data_parallel_size=self.cfg.data_parallel_size,
            api_server_count=self.cfg.api_server_count,
            run_dir=self.run_dir,
        )
        self._task(read_control(self.ctl, self.post), "ctl")
        self._task(read_table(self.table_sub, self.post, lambda: [r.load for r in self.cluster.ranks]), "table")
        if self.keys is not None and not self.cfg.runs_coordinator:
            watch = watch_coordinator_link(self.coord_link, self.addr.coordinator_engines, self.cfg.key_file, self.log, self.is_starting, self.post)
            self._task(watch, "coordinator-link")
        self._task(self.prober.run(), "prober")
        try:
            await startup.begin(self)
            await self._loop()
        finally:
            await shutdown(self)
        return self.exit_code

    def is_starting(self) -> bool:
        return self.phase == "starting"

    def _task(self, coro, name: str) -> None:
        self.tasks.append(asyncio.create_task(coro, name=name))

    # ================================================================ the loop

    async def _loop(self) -> None:
        while self.phase != "stopping":
            # 1. Wait for an event, but not past the next tick.
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=TICK_S)
            except asyncio.TimeoutError:
                event = None
            # 2. Apply it and whatever else is already queued.
            while event is not None and self.phase != "stopping":
                self.apply(event)
                event = None if self.events.empty() else self.events.get_nowait()
            # 3. Timers: kill deadlines, restarts due, startup verdict, rolling restart.
            if self.phase != "stopping":
                self.tick(self.clock())
            # 4. Tell systemd.
            self.notifier.status(self.view.status_line())
            self.feed_watchdog(self.clock())

    def apply(self, event: ev.Event) -> None:
        """Dispatch one event to its verb; events about an older process are dropped."""
        if isinstance(event, ev.SignalReceived):
            self.on_signal(event.signum)
        elif isinstance(event, ev.Fatal):
            self.log.error("stopping the node", reason=event.reason)
            self.stop(event.code)
        elif isinstance(event, ev.ClusterSeen):
            self.all_ranks_routable, self.num_alive_ranks = event.all_ranks_routable, event.num_alive_ranks
        elif isinstance(event, ev.TableSeen):
            self.cluster.apply(event.entries, event.at, event.wall)
        elif isinstance(event, ev.LauncherRestarted):
            if self.rolling is not None:
                self.rolling.waiting_for_launcher = False
        elif isinstance(event, ev.Spawned | ev.SpawnFailed):
            self.on_spawned(event)
        elif isinstance(event, ev.DrainRequested):
            draining.apply(self, event)
        else:
            child = self.children.get(event.name)
            if child is None:
                return
            if child.pid != event.pid:
                if child.spawning and isinstance(event, ev.Ready | ev.Heartbeat) and len(child.early) < 16:
                    # A forked child can say "ready" on the control socket before its
                    # spawn task's Spawned is applied: keep it until the pid is known.
                    child.early.append(event)
                return  # otherwise a previous incarnation's news
            if isinstance(event, ev.Exited):
                self.on_exit(child, event.returncode)
            elif isinstance(event, ev.Ready):
                self.on_ready(child, event.detail)
            elif isinstance(event, ev.Heartbeat):
                child.last_heartbeat = event.at
                child.num_running, child.num_waiting, child.kv_usage = event.num_running, event.num_waiting, event.kv_usage
            elif isinstance(event, ev.ProbeResult):
                self.on_probe(child, event)

    def tick(self, now: float) -> None:
        if now - self._last_hello >= NODE_HELLO_S:
            self._last_hello = now
            self.say_where()
        if self.cluster.check_head(now, time.time()) and self.phase == "serving":
            self.log.error("lost the head: no load table from the coordinator", seconds=self.cluster.head_silence_s, address=self.addr.coordinator_table)
        for child in self.children.values():
            if child.state == ChildState.STOPPING and now > child.deadline and not child.kill_requested:
                child.kill_requested = True
                self.log.warning("child did not stop in time; killing it", child=child.name, pid=child.pid)
                _kill(child.pid, signal.SIGKILL)
            elif child.state == ChildState.BACKOFF and now >= child.next_start_at and not child.spawning:
                child.restarts += 1
                self.spawn(child)
            elif child.state == ChildState.STARTING and child.restarts and now > child.deadline:
                self.log.error("restarted child did not become ready in time", child=child.name)
                child.failure = "not ready in time"
                self.terminate(child, kill_after=self.cfg.kill_grace_s)
        if self.phase == "starting":
            startup.check(self, now)
            return
        if self.rolling is not None and self.rolling.advance(self, now):
            self.rolling = None
            self.log.info("rolling restart done")
            self.notifier.ready(self.view.status_line())
        if now - self._last_stray_sweep > STRAY_SWEEP_S and not self.spawn_tasks:
            self._last_stray_sweep = now
            self.sweep_strays()
        code, kind = node_exit_code(self.children.values())
        if code:
            self.log.error("nothing left that can serve; exiting so systemd can restart the node", kind=kind, exit_code=code)
            self.stop(code)

    # ================================================================ verbs

    def on_signal(self, signum: int) -> None:
        if signum != signal.SIGHUP:
            self.log.info("stop requested" if self.phase == "serving" else "stop requested during startup", signal=signal.Signals(signum).name)
            self.stop(EXIT_OK)
        elif self.phase != "serving":
            self.log.info("reload ignored until the node serves")
        elif self.rolling is not None:
            self.log.info("rolling restart already in progress")
        else:
            self.rolling = rolling.begin(self)

    def stop(self, code: int) -> None:
        self.exit_code = code
        self.phase = "stopping"
        if self.launcher is not None:
            self.launcher.stopping = True  # what it says from now on is part of a stop

    def spawn(self, child: Child) -> None:
        """Start the child's process in a task; Spawned or SpawnFailed reports back."""
        child.spawning = True
        requested = self.clock()

        async def run() -> None:
            try:
                proc = await launch(child, sys.stderr.buffer, self.launcher)
            except Exception as exc:  # exec failed: no interpreter, fds, memory
                self.post(ev.SpawnFailed(child.name, f"{type(exc).__name__}: {exc}"))
            else:
                self.post(ev.Spawned(child.name, proc, requested))

        task = asyncio.create_task(run(), name=f"spawn-{child.name}")
        self.spawn_tasks.add(task)
        task.add_done_callback(self.spawn_tasks.discard)

    def on_spawned(self, event: ev.Spawned | ev.SpawnFailed) -> None:
        child = self.children[event.name]
        child.spawning = False
        if isinstance(event, ev.SpawnFailed):
            child.early = []
            self.log.error("cannot start child", child=child.name, error=event.error)
            child.failure = "could not start"
            self.on_exit(child, EXIT_ERROR, how=f"could not start: {event.error}")
            return
        now = self.clock()
        started(child, event.proc, event.requested_at, now)
        if child.restarts:
            child.deadline = now + startup.timeout(self.cfg, child)
        asyncio.create_task(watch_exit(child.name, event.proc, self.post))
        self.log.info("child started", child=child.name, pid=child.pid)
        early, child.early = child.early, []
        for news in early:
            self.apply(news)  # this process's own; anything else is dropped there

    def on_ready(self, child: Child, detail: str = "") -> None:
        if child.state != ChildState.STARTING:
            return
        child.state = ChildState.READY
        child.detail = detail
        child.ready_at = child.last_heartbeat = self.clock()
        extra = {"restarts": child.restarts} if child.restarts else {}
        if detail and self.cfg.uses_ray and child.kind != "api":
            extra["detail"] = detail
        self.log.info("child ready", child=child.name, pid=child.pid, seconds=round(child.ready_at - child.started_at, 2), **extra)

    def on_exit(self, child: Child, rc: int, how: str = "") -> None:
        """Reap: decode how it ended, take it out of routing, apply the restart decision."""
        if not how:
            oom = rc == -signal.SIGKILL and not child.kill_requested and self.oom.killed_since_last()
            how = describe_exit(rc, killed_by_us=child.kill_requested, oom_killed=oom)
        child.last_exit = how
        was = child.state
        child.proc = None
        if self.phase == "starting":
            child.state = ChildState.EXITED
            self.log.error("child died during startup", child=child.name, how=how)
            self.stop(rc if rc in (EXIT_CONFIG, EXIT_STARTUP) else EXIT_STARTUP)
            return
        if self.phase != "serving":
            child.state = ChildState.EXITED
            return
        if child.drained:
            draining.settle(self, child)
            return
        planned = was == ChildState.STOPPING and child.restart_requested
        level = self.log.info if planned else self.log.error
        level("child exited", child=child.name, pid=child.pid, how=how, **({"after": child.failure} if child.failure else {}))
        self.take_out_of_routing(child, f"process exited ({how})")
        now = self.clock()
        # A child we stopped for failing (probes, a late start) failed, however cleanly it exited.
        decision = decide(self.policy, rc, planned=planned, failed=bool(child.failure), restart_times=child.restart_times, now=now)
        child.restart_times = list(decision.restart_times)
        if decision.action == Action.RESTART:
            child.state = ChildState.BACKOFF
            child.next_start_at = now + decision.delay_s
            if not planned:
                self.log.info("restarting child", child=child.name, in_s=round(decision.delay_s, 2))
            return
        child.state = ChildState.EXITED
        child.gave_up = decision.why
        if decision.action == Action.GIVE_UP:
            if rc in (EXIT_CONFIG, EXIT_STARTUP):
                self.log.error("child cannot boot; not restarting it", child=child.name, how=how)
            else:
                self.log.error("child keeps crashing; giving up on it", child=child.name, restarts_in_window=len(child.restart_times), window_s=self.policy.window_s)

    def on_probe(self, child: Child, result: ev.ProbeResult) -> None:
        if child.state != ChildState.READY:
            return  # the child changed while it was probed; this verdict is stale
        child.last_probe = {"at": result.at, "ok": result.ok, "ready": result.ready, "detail": result.detail, "latency_ms": result.latency_ms, "unroutable_ranks": list(result.unroutable_ranks)}
        if result.ok:
            child.consecutive_failures = 0
            return
        child.consecutive_failures += 1
        child.probe_failures_total += 1
        self.log.warning("probe failed", child=child.name, detail=result.detail, consecutive=child.consecutive_failures)
        if child.consecutive_failures >= self.cfg.probe_failure_threshold:
            self.declare_dead(child, f"{child.consecutive_failures} failed probes: {result.detail}")

    def declare_dead(self, child: Child, reason: str) -> None:
        """A hung child: out of routing at once, then stopped (SIGCONT too: a stopped process cannot act on SIGTERM)."""
        self.log.error("child declared dead", child=child.name, pid=child.pid, reason=reason)
        child.failure = f"declared dead: {reason}"
        self.take_out_of_routing(child, reason)
        self.terminate(child, kill_after=self.cfg.kill_grace_s, cont=True)

    def say_where(self) -> None:
        """NodeHello: every node's /status names the address of this node's ranks
        (a one-node serve's too, so that `dpserve status` shows an address, not a hostname)."""
        if self.coord_link is None or not self.node_address:
            return  # not set up yet (or a test's supervisor without sockets)
        try:
            self.coord_link.send(self.coord_codec.encode(NodeHello(self.cfg.data_parallel_start_rank, self.node_address)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def take_out_of_routing(self, child: Child, reason: str) -> None:
        if child.kind == "engine":
            try:
                self.coord_link.send(self.coord_codec.encode(RankDown(child.rank, reason)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def terminate(self, child: Child, kill_after: float, cont: bool = False) -> None:
        if child.proc is None or child.proc.returncode is not None:
            return
        child.state = ChildState.STOPPING
        child.deadline = self.clock() + kill_after
        _kill(child.pid, signal.SIGTERM)
        if cont:
            _kill(child.pid, signal.SIGCONT)

    def signal_child(self, child: Child, sig: int) -> None:
        _kill(child.pid, sig)

    def sweep_strays(self) -> None:
        known = {c.pid for c in self.children.values() if c.proc is not None}
        if self.launcher is not None:
            known.add(self.launcher.pid)
        for pid, rc in reap_strays(known):
            self.log.warning("reaped a stray process", pid=pid, how=describe_exit(rc))

    def feed_watchdog(self, now: float) -> None:
        interval = self.notifier.watchdog_interval_s
        if interval and now - self._last_watchdog >= interval:
            self._last_watchdog = now
            self.notifier.watchdog()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
