"""The supervisor's decisions, without a node: the pure restart policy, and the
loop's verbs fed events one at a time with a fake clock. Processes a verb
signals are real (`sleep`), started and stopped by each test."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess

import pytest
import structlog
from dpserve.daemons.config import ServeConfig
from dpserve.daemons.supervisor import events as ev
from dpserve.daemons.supervisor.children import Child, ChildState
from dpserve.daemons.supervisor.core import Supervisor
from dpserve.daemons.supervisor.policy import CANNOT_BOOT, CRASH_LOOP, Action, RestartPolicy, decide, node_exit_code
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.procutil import (
    EXIT_CONFIG,
    EXIT_NODE_UNHEALTHY,
    EXIT_NOTHING_SERVES,
    EXIT_OK,
    EXIT_STARTUP,
    describe_exit,
)
from dpserve.engine.common.protocol import CoordinatorInput, RankDown

POLICY = RestartPolicy("always", max_restarts=3, window_s=60, backoff_initial_s=0.5, backoff_max_s=4)


# ---------------------------------------------------------------- the pure policy


def test_backoff_doubles_up_to_its_cap_then_the_child_is_given_up():
    times: tuple[float, ...] = ()
    delays = []
    for now in (10.0, 11.0, 12.0):
        d = decide(POLICY, -signal.SIGKILL, planned=False, failed=False, restart_times=times, now=now)
        assert d.action == Action.RESTART
        delays.append(d.delay_s)
        times = d.restart_times
    assert delays == [0.5, 1.0, 2.0] and times == (10.0, 11.0, 12.0)
    d = decide(POLICY, 1, planned=False, failed=False, restart_times=times, now=13.0)
    assert d.action == Action.GIVE_UP and d.why == CRASH_LOOP
    capped = RestartPolicy("always", 10, 60, 0.5, 1.5)
    assert decide(capped, 1, planned=False, failed=False, restart_times=(1, 2, 3), now=4).delay_s == 1.5


def test_restarts_outside_the_window_are_forgotten():
    d = decide(POLICY, 1, planned=False, failed=False, restart_times=(0.0, 1.0, 2.0), now=100.0)
    assert d.action == Action.RESTART and d.delay_s == 0.5 and d.restart_times == (100.0,)


@pytest.mark.parametrize(
    "mode, rc, failed, action",
    [
        ("never", 1, False, Action.STAY_DOWN),
        ("on-failure", 0, False, Action.STAY_DOWN),
        ("on-failure", 1, False, Action.RESTART),
        # a hung child the supervisor stopped (SIGCONT + SIGTERM) often exits 0: still a failure
        ("on-failure", 0, True, Action.RESTART),
        ("always", 0, False, Action.RESTART),
    ],
)
def test_restart_policy_modes(mode, rc, failed, action):
    policy = RestartPolicy(mode, 3, 60, 0.5, 4)
    assert decide(policy, rc, planned=False, failed=failed, restart_times=(), now=1.0).action == action


@pytest.mark.parametrize("rc", [EXIT_CONFIG, EXIT_STARTUP])
def test_a_child_that_cannot_boot_is_given_up_at_once(rc):
    d = decide(POLICY, rc, planned=False, failed=False, restart_times=(), now=1.0)
    assert d.action == Action.GIVE_UP and d.why == CANNOT_BOOT


def test_planned_restart_is_immediate_and_does_not_count():
    d = decide(POLICY, 0, planned=True, failed=False, restart_times=(5.0,), now=6.0)
    assert d == type(d)(Action.RESTART, 0.0, (5.0,))


def _records(*specs):
    out = []
    for kind, gave_up in specs:
        c = Child(f"{kind}-{len(out)}", kind, 0, "x", b"{}")
        c.gave_up = gave_up
        out.append(c)
    return out


def test_node_exit_code_says_why_nothing_serves():
    assert node_exit_code(_records(("engine", CRASH_LOOP), ("engine", ""), ("api", CRASH_LOOP), ("api", ""))) == (0, "")
    assert node_exit_code(_records(("engine", CRASH_LOOP), ("engine", CANNOT_BOOT), ("api", ""))) == (EXIT_NODE_UNHEALTHY, "engine")
    assert node_exit_code(_records(("engine", ""), ("api", CANNOT_BOOT))) == (EXIT_NOTHING_SERVES, "api")


def test_exit_descriptions():
    # a SIGKILL is put on the OOM killer only when the kernel's record says so
    assert describe_exit(-9) == "signal SIGKILL (not sent by dpserve)"
    assert describe_exit(-9, oom_killed=True) == "signal SIGKILL (killed by the OOM killer)"
    # a child the supervisor itself killed is not blamed on the OOM killer
    assert describe_exit(-9, killed_by_us=True) == "signal SIGKILL (killed by the supervisor: it did not stop in time)"
    assert describe_exit(-15) == "signal SIGTERM"
    assert describe_exit(3) == "exit code 3 (startup failure)"
    assert describe_exit(42) == "exit code 42"


# ---------------------------------------------------------------- the loop's verbs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Outbox:
    """Stands in for the supervisor's socket to the coordinator: records what it would send."""

    def __init__(self) -> None:
        self.sent = []
        self._codec = Codec(CoordinatorInput)

    def send(self, data, flags=0) -> None:
        self.sent.append(self._codec.decode(data))


class Notify:
    """A real NOTIFY_SOCKET: the datagrams systemd would receive."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)

    def lines(self) -> list[str]:
        out = []
        while True:
            try:
                out += self.sock.recv(65536).decode().splitlines()
            except BlockingIOError:
                return out


@pytest.fixture
def sup(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    (tmp_path / "config.json").write_text("{}")
    cfg = ServeConfig(model=str(tmp_path), served_model_name="m", restart_backoff_initial_s=0.5, restart_backoff_max_s=4, max_restarts=3, probe_failure_threshold=3)
    notify = Notify(str(tmp_path / "notify.sock"))  # bound first: sdnotify connects at once
    s = Supervisor(cfg, structlog.get_logger())
    s.notify = notify
    s.clock = Clock()
    s.phase = "serving"
    s.coord_link = Outbox()
    s.spawned = []
    s.spawn = lambda child: (s.spawned.append(child.name), setattr(child, "spawning", True))
    yield s
    s.zctx.destroy(linger=0)


def add(sup: Supervisor, name: str = "engine-dp0", kind: str = "engine", pid: int = 100, state=ChildState.READY) -> Child:
    c = Child(name, kind, 0, "x", b"{}")
    c.pid, c.state = pid, state
    sup.children[name] = c
    return c


class Sleeper:
    """A real process for verbs that signal one; always reaped by the test."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(["sleep", "30"])
        self.pid = self.popen.pid
        self.returncode = None

    def wait(self, timeout: float = 10) -> int:
        self.returncode = self.popen.wait(timeout)
        return self.returncode

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)


def test_crash_leaves_routing_backs_off_restarts_on_time_and_ignores_stale_exits(sup):
    c = add(sup)
    sup.apply(ev.Exited("engine-dp0", 99, 1))  # an older process of this child
    assert c.state == ChildState.READY and not sup.coord_link.sent
    sup.apply(ev.Exited("engine-dp0", 100, -signal.SIGKILL))
    assert c.state == ChildState.BACKOFF and "SIGKILL (not sent by dpserve)" in c.last_exit
    assert [type(m) for m in sup.coord_link.sent] == [RankDown] and "SIGKILL" in sup.coord_link.sent[0].reason
    sup.clock.now += 0.4
    sup.tick(sup.clock.now)
    assert sup.spawned == []
    sup.clock.now += 0.1
    sup.tick(sup.clock.now)
    sup.tick(sup.clock.now)  # a spawn in flight is not started twice
    assert sup.spawned == ["engine-dp0"] and c.restarts == 1


def test_a_kind_that_keeps_crashing_stops_the_node_with_exit_4(sup):
    c = add(sup, "api-0", "api")
    for i in range(4):
        c.pid, c.state = 100 + i, ChildState.READY
        sup.apply(ev.Exited("api-0", c.pid, 1))
        sup.clock.now += 1
    assert c.state == ChildState.EXITED and c.gave_up == CRASH_LOOP
    sup.tick(sup.clock.now)
    assert sup.phase == "stopping" and sup.exit_code == EXIT_NODE_UNHEALTHY


def test_exits_during_shutdown_are_final(sup):
    sup.phase = "shutting down"
    c = add(sup)
    sup.apply(ev.Exited("engine-dp0", 100, 0))
    assert c.state == ChildState.EXITED and not sup.coord_link.sent


def test_failed_probes_declare_a_child_dead_and_its_clean_exit_still_restarts_it(sup):
    sup.policy = RestartPolicy("on-failure", 3, 60, 0.5, 4)
    proc = Sleeper()
    try:
        c = add(sup, pid=proc.pid)
        c.proc = proc
        fail = ev.ProbeResult("engine-dp0", proc.pid, False, False, "last heartbeat 9.0 s ago", 0.1, 0.0)
        sup.apply(ev.ProbeResult("engine-dp0", proc.pid, True, True, "ok", 0.1, 0.0))
        sup.apply(fail)
        sup.apply(fail)
        assert c.state == ChildState.READY and c.consecutive_failures == 2
        sup.apply(ev.ProbeResult("engine-dp0", proc.pid - 1, False, False, "stale", 0.1, 0.0))
        assert c.consecutive_failures == 2
        sup.apply(fail)
        assert c.state == ChildState.STOPPING and c.failure.startswith("declared dead: 3 failed probes")
        assert proc.wait() == -signal.SIGTERM  # the real process got SIGTERM
        assert isinstance(sup.coord_link.sent[0], RankDown)
        sup.apply(ev.Exited("engine-dp0", proc.pid, 0))
        assert c.state == ChildState.BACKOFF and c.probe_failures_total == 3
    finally:
        proc.stop()


def test_a_child_that_does_not_stop_in_time_is_killed(sup):
    proc = Sleeper()
    try:
        c = add(sup, pid=proc.pid, state=ChildState.STOPPING)
        c.proc, c.deadline = proc, sup.clock.now + 1
        sup.tick(sup.clock.now)
        assert proc.popen.poll() is None
        sup.clock.now += 1.5
        sup.tick(sup.clock.now)
        assert proc.wait() == -signal.SIGKILL and c.kill_requested
        sup.apply(ev.Exited("engine-dp0", proc.pid, -signal.SIGKILL))
        assert "killed by the supervisor" in c.last_exit
    finally:
        proc.stop()


def test_startup_ends_with_ready_once_every_child_serves_and_the_cluster_routes(sup):
    sup.phase = "starting"
    e, a = add(sup, state=ChildState.STARTING), add(sup, "api-0", "api", pid=200, state=ChildState.STARTING)
    for c in (e, a):
        c.deadline = sup.clock.now + 30
    sup.apply(ev.Ready("engine-dp0", 100))
    sup.apply(ev.Ready("api-0", 201))  # not this process
    sup.tick(sup.clock.now)
    assert (e.state, a.state, sup.phase) == (ChildState.READY, ChildState.STARTING, "starting")
    sup.apply(ev.Ready("api-0", 200))
    sup.tick(sup.clock.now)
    assert sup.phase == "starting"  # every child ready, but the cluster does not route yet
    sup.apply(ev.ClusterSeen(True, 1))
    sup.tick(sup.clock.now)
    assert sup.phase == "serving" and "READY=1" in sup.notify.lines()


@pytest.mark.parametrize("rc, code", [(EXIT_CONFIG, EXIT_CONFIG), (1, EXIT_STARTUP)])
def test_a_child_that_dies_during_startup_stops_the_node(sup, rc, code):
    sup.phase = "starting"
    add(sup, state=ChildState.STARTING).deadline = sup.clock.now + 30
    sup.apply(ev.Exited("engine-dp0", 100, rc))
    assert sup.phase == "stopping" and sup.exit_code == code


def test_a_late_child_stops_the_startup_with_exit_3(sup):
    sup.phase = "starting"
    c = add(sup, state=ChildState.STARTING)
    c.deadline = sup.clock.now + 30
    sup.clock.now += 31
    sup.tick(sup.clock.now)
    assert sup.phase == "stopping" and sup.exit_code == EXIT_STARTUP


def test_sigterm_stops_with_exit_0_and_sighup_waits_until_serving(sup):
    sup.phase = "starting"
    sup.apply(ev.SignalReceived(signal.SIGHUP))
    assert sup.rolling is None and sup.phase == "starting"
    sup.apply(ev.SignalReceived(signal.SIGTERM))
    assert sup.phase == "stopping" and sup.exit_code == EXIT_OK


def test_ready_before_the_spawn_task_reports_is_kept_for_that_process(sup):
    """A forked API server can say "ready" before its spawn task's Spawned is
    applied (seen in CI: the node then timed out its startup)."""

    async def scenario():
        new, other = [await asyncio.create_subprocess_exec("sleep", "30") for _ in range(2)]
        try:
            sup.phase = "starting"
            c = add(sup, "api-0", "api", pid=0, state=ChildState.BACKOFF)
            c.spawning = True
            sup.apply(ev.Ready("api-0", new.pid))  # before Spawned
            sup.apply(ev.Ready("api-0", other.pid))  # some other process's: never applied
            assert c.state == ChildState.BACKOFF
            sup.apply(ev.Spawned("api-0", new, sup.clock.now))
            assert c.pid == new.pid and c.state == ChildState.READY and c.early == []
        finally:
            for p in (new, other):
                p.kill()
                await p.wait()

    asyncio.run(scenario())


def test_sighup_replaces_api_servers_one_at_a_time_and_tells_systemd(sup):
    async def scenario():
        procs = [await asyncio.create_subprocess_exec("sleep", "30") for _ in range(4)]
        try:
            apis = [add(sup, f"api-{i}", "api", pid=procs[i].pid) for i in range(2)]
            for c, p in zip(apis, procs):
                c.proc = p
            sup.apply(ev.SignalReceived(signal.SIGHUP))
            lines = sup.notify.lines()
            assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=")
            sup.tick(sup.clock.now)
            assert [c.state for c in apis] == [ChildState.STOPPING, ChildState.READY]
            for i, c in enumerate(apis):
                assert await procs[i].wait() == -signal.SIGTERM
                sup.apply(ev.Exited(c.name, procs[i].pid, -signal.SIGTERM))
                assert c.state == ChildState.BACKOFF and c.next_start_at == sup.clock.now  # planned: at once
                sup.tick(sup.clock.now)
                assert sup.spawned[-1] == c.name
                new = procs[2 + i]
                sup.apply(ev.Spawned(c.name, new, sup.clock.now))
                assert c.state == ChildState.STARTING and c.pid == new.pid
                sup.tick(sup.clock.now)
                assert apis[-1].state == (ChildState.READY if i == 0 else ChildState.STARTING)  # the next waits for this one
                sup.apply(ev.Ready(c.name, new.pid))
                sup.tick(sup.clock.now)
            assert sup.rolling is None and "READY=1" in sup.notify.lines()
            assert [c.restarts for c in apis] == [1, 1] and all(c.restart_times == [] for c in apis)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()

    asyncio.run(scenario())


def test_metrics_keep_the_names_labels_and_values_dashboards_use(sup):
    """The collector replaced hand-written text; a scrape must read the same series."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    e = add(sup, "engine-dp0", "engine", pid=100)
    e.restarts, e.probe_failures_total, e.num_running, e.num_waiting, e.kv_usage = 2, 5, 3, 1, 0.123456
    e.started_at = sup.clock.now  # uptime reads the real clock: only its presence is checked
    a = add(sup, "api-0", "api", pid=200, state=ChildState.STARTING)
    a.rank, a.consecutive_failures = 0, 3  # at the threshold: not up
    text = generate_latest(sup.health.registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    child = lambda name, kind: (("child", name), ("kind", kind))  # noqa: E731
    expected = {
        ("dpserve_child_up", child("engine-dp0", "engine")): 1,
        ("dpserve_child_up", child("api-0", "api")): 0,
        ("dpserve_child_restarts_total", child("engine-dp0", "engine")): 2,
        ("dpserve_child_restarts_total", child("api-0", "api")): 0,
        ("dpserve_child_probe_failures_total", child("engine-dp0", "engine")): 5,
        ("dpserve_child_probe_failures_total", child("api-0", "api")): 0,
        ("dpserve_rank_running", (("rank", "0"),)): 3,
        ("dpserve_rank_waiting", (("rank", "0"),)): 1,
        ("vllm:kv_cache_usage_perc", (("rank", "0"),)): 0.1235,
        ("dpserve_node_ready", ()): 0,  # no API server is ready
    }
    uptime = {k for k in samples if k[0] == "dpserve_child_uptime_seconds"}
    assert uptime == {("dpserve_child_uptime_seconds", child("engine-dp0", "engine")), ("dpserve_child_uptime_seconds", child("api-0", "api"))}
    # the cluster's series (every rank, from the load table) are checked in test_status_table.py
    cluster = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    node = {k: v for k, v in samples.items() if not k[0].startswith("dpserve_cluster_") and k[0] not in cluster}
    assert {k: v for k, v in node.items() if k[0] != "dpserve_child_uptime_seconds"} == expected
    for line in ("# TYPE dpserve_child_restarts_total counter", "# TYPE dpserve_child_probe_failures_total counter", "# TYPE vllm:kv_cache_usage_perc gauge"):
        assert line in text


def test_engine_probes_allow_a_heartbeat_the_probe_timeout_late(sup):
    """--dp-supervisor-probe-timeout-s applies to engines: a heartbeat (every 1 s here) may be
    up to the timeout late before the probe fails, whatever the probe interval (5 s here);
    the verdict goes to the loop as an event."""
    import time

    sup.view.probe_timeout_s = 20.0
    assert (sup.view.heartbeat_interval_s, sup.view.probe_interval_s) == (1.0, 5.0)
    fresh, stale = add(sup, "engine-dp0", pid=100), add(sup, "engine-dp1", pid=101)
    fresh.last_heartbeat = time.monotonic() - 10.0  # past the interval, within interval + timeout
    stale.last_heartbeat = time.monotonic() - 30.0
    posted = []
    sup.prober.post = posted.append
    asyncio.run(sup.prober._probe(fresh))
    asyncio.run(sup.prober._probe(stale))
    assert [(r.name, r.pid, r.ok) for r in posted] == [("engine-dp0", 100, True), ("engine-dp1", 101, False)]
    assert posted[1].detail.startswith("last heartbeat 30.")
