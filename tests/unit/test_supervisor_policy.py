"""The supervisor's decisions on a child's exit, fed directly (no processes): restart
policy, capped exponential backoff, the restart limit, and when the node gives up."""

from __future__ import annotations

import signal

import pytest
import structlog
from dpserve.daemons.children import Child, ChildState
from dpserve.daemons.config import ServeConfig
from dpserve.daemons.supervisor import Supervisor
from dpserve.engine.common.procutil import EXIT_NOTHING_SERVES, EXIT_STARTUP, describe_exit
from dpserve.engine.protocol import Codec, CoordinatorInput, RankDown


class Outbox:
    """Stands in for the supervisor's socket to the coordinator: records what it would send."""

    def __init__(self) -> None:
        self.sent = []
        self._codec = Codec(CoordinatorInput)

    def send(self, data, flags=0) -> None:
        self.sent.append(self._codec.decode(data))


def supervisor(tmp_path, **kw) -> Supervisor:
    (tmp_path / "config.json").write_text("{}")
    cfg = ServeConfig(model=str(tmp_path), served_model_name="m", restart_backoff_initial_s=0.5, restart_backoff_max_s=4, max_restarts=3, **kw)
    sup = Supervisor(cfg, structlog.get_logger())
    sup.phase = "serving"
    sup.coord_link = Outbox()
    sup._coord_codec = Codec(CoordinatorInput)
    return sup


def child(sup: Supervisor, name: str = "engine-dp0", kind: str = "engine", pid: int = 100) -> Child:
    c = Child(name, kind, 0, "x", b"{}")
    c.pid, c.state = pid, ChildState.READY
    sup.children[name] = c
    return c


def test_crash_takes_rank_out_of_routing_and_restarts_with_growing_capped_backoff(tmp_path):
    sup = supervisor(tmp_path)
    c = child(sup)
    delays = []
    for i in range(3):
        c.pid = 100 + i
        c.state = ChildState.READY
        sup._reap(c, c.pid, -signal.SIGKILL)
        assert c.state == ChildState.BACKOFF
        delays.append(round(c.next_start_at - c.restart_times[-1], 3))
    assert delays == [0.5, 1.0, 2.0]
    assert [type(m) for m in sup.coord_link.sent] == [RankDown] * 3
    assert "SIGKILL" in sup.coord_link.sent[0].reason
    # the fourth crash inside the window: give up on this child
    c.pid, c.state = 200, ChildState.READY
    sup._reap(c, 200, 1)
    assert c.state == ChildState.EXITED and c.gave_up
    assert sup._cannot_serve() == EXIT_NOTHING_SERVES


def test_stale_exit_of_a_previous_process_is_ignored(tmp_path):
    sup = supervisor(tmp_path)
    c = child(sup, pid=300)
    sup._reap(c, 299, 1)
    assert c.state == ChildState.READY


@pytest.mark.parametrize("policy, rc, restarted", [("never", 1, False), ("on-failure", 0, False), ("on-failure", 1, True), ("always", 0, True)])
def test_restart_policy(tmp_path, policy, rc, restarted):
    sup = supervisor(tmp_path, restart_policy=policy)
    c = child(sup, name="api-0", kind="api")
    sup._reap(c, c.pid, rc)
    assert (c.state == ChildState.BACKOFF) is restarted


def test_on_failure_restarts_a_child_stopped_for_failing_probes(tmp_path, monkeypatch):
    """A hung child is SIGCONTed and SIGTERMed, so it often exits 0: still a failure (issue 12 #6)."""
    sent = []
    monkeypatch.setattr("dpserve.daemons.supervisor.os.kill", lambda pid, sig: sent.append((pid, sig)))
    sup = supervisor(tmp_path, restart_policy="on-failure")
    c = child(sup)
    c.proc = type("Proc", (), {"returncode": None})()
    sup._handle(("dead", c, c.pid, "3 failed probes: last heartbeat 1.6 s ago"))
    assert c.state == ChildState.STOPPING and c.failure
    assert sent == [(100, signal.SIGTERM), (100, signal.SIGCONT)]
    sup._reap(c, c.pid, 0)
    assert c.state == ChildState.BACKOFF
    # the new process starts with a clean record: its own clean exit is not a failure
    c.failure, c.state, c.pid = "", ChildState.READY, 101
    sup._reap(c, 101, 0)
    assert c.state == ChildState.EXITED


def test_a_child_that_cannot_boot_is_not_restarted(tmp_path):
    sup = supervisor(tmp_path)
    c = child(sup)
    sup._reap(c, c.pid, EXIT_STARTUP)
    assert c.state == ChildState.EXITED and c.gave_up


def test_planned_restart_is_immediate_and_not_a_crash(tmp_path):
    sup = supervisor(tmp_path)
    c = child(sup, name="api-1", kind="api")
    c.state = ChildState.STOPPING
    c.restart_requested = True
    sup._reap(c, c.pid, 0)
    assert c.state == ChildState.BACKOFF and c.restart_times == []


def test_exits_during_shutdown_are_final(tmp_path):
    sup = supervisor(tmp_path)
    sup.phase = "stopping"
    c = child(sup)
    sup._reap(c, c.pid, 0)
    assert c.state == ChildState.EXITED and not sup.coord_link.sent


def test_exit_descriptions():
    assert describe_exit(-9) == "signal SIGKILL (out of memory?)"
    # a child the supervisor itself killed is not blamed on the OOM killer
    assert describe_exit(-9, killed_by_us=True) == "signal SIGKILL (killed by the supervisor: it did not stop in time)"
    assert describe_exit(-15) == "signal SIGTERM"
    assert describe_exit(3) == "exit code 3 (startup failure)"
    assert describe_exit(42) == "exit code 42"
