"""Process lifecycle of a node: sd_notify, signals, draining, orphans, port ownership, startup timeouts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.server import DpServer, http_get, pid_alive, stream_request, wait_until

pytestmark = pytest.mark.slow


class NotifySocket:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def lines(self, prefix: str = "") -> list[str]:
        return [m for _, m in self.messages if m.startswith(prefix)]

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


def test_notify_ready_watchdog_and_drain_on_sigterm(demo_model_dir, tmp_path):
    """READY=1 only once every child serves; WATCHDOG=1 periodically; SIGHUP is a
    reload systemd can follow; SIGTERM mid-stream lets the stream finish, sends
    STOPPING=1, exits 0 and leaves no process."""
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    env = {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "1000000"}
    srv = DpServer(demo_model_dir, "--data-parallel-size", "1", "--api-server-count", "2", env=env)
    try:
        srv.start(wait_ready=False)
        wait_until(lambda: notify.lines("READY=1"), 180, 0.1, "READY=1")
        ready_at = next(t for t, m in notify.messages if m == "READY=1")
        status = srv.status()
        assert all(c["state"] == "ready" for c in status["children"]), status
        assert http_get(srv.health_url + "/readyz")[0] == 200
        statuses = notify.lines("STATUS=")
        assert any("0/1 ranks ready" in s for s in statuses), statuses
        assert any("serving on port" in s for s in statuses), statuses
        assert notify.lines("EXTEND_TIMEOUT_USEC=")
        assert all(t <= ready_at for t, m in notify.messages if m.startswith("EXTEND_TIMEOUT_USEC="))
        wait_until(lambda: len(notify.lines("WATCHDOG=1")) >= 3, 5, 0.1, "three watchdog pings")

        # SIGHUP (systemctl reload): RELOADING=1 with MONOTONIC_USEC as it begins,
        # READY=1 again only once every API server has been replaced.
        apis = {c["name"]: c["pid"] for c in srv.status()["children"] if c["kind"] == "api"}
        srv.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: notify.lines("READY=1")[1:], 120, 0.1, "READY=1 after the reload")
        after_reload = [m for _, m in notify.messages if m.startswith(("RELOADING=", "MONOTONIC_USEC=", "READY="))]
        assert after_reload[:4] == ["READY=1", "RELOADING=1", after_reload[2], "READY=1"], after_reload
        assert after_reload[2].startswith("MONOTONIC_USEC=") and int(after_reload[2].split("=")[1]) > 0
        now = {c["name"]: c for c in srv.status()["children"] if c["kind"] == "api"}
        assert all(now[n]["pid"] != pid and now[n]["state"] == "ready" for n, pid in apis.items()), (apis, now)
        srv.refresh_child_pids()

        result: dict = {}
        t = threading.Thread(target=stream_request, args=(srv.port, 220, result))
        t.start()
        wait_until(lambda: "started" in result, 30, 0.01, "stream start")
        srv.proc.send_signal(signal.SIGTERM)
        # while it drains, the node says it is not ready (and why)
        seen = []
        while t.is_alive() and srv.proc.poll() is None:
            try:
                code, body = http_get(srv.health_url + "/readyz", 1)
                seen.append((code, json.loads(body).get("phase")))
            except OSError:
                break
            time.sleep(0.01)
        t.join(60)
        assert (503, "stopping") in seen, seen
        assert result.get("done"), result
        assert result["finishes"] == ["length"], result
        assert "error" not in result and "exception" not in result, result
        assert srv.proc.wait(60) == 0
        assert notify.lines("STOPPING=1")
        wait_until(lambda: not any(pid_alive(p) for p in srv.child_pids), 5, what="children to exit")
    finally:
        srv.stop()
        notify.close()


def test_sigkill_of_the_supervisor_leaves_no_child(demo_model_dir):
    with DpServer(demo_model_dir, "--data-parallel-size", "1", "--api-server-count", "1") as srv:
        pids = set(srv.child_pids)
        assert len(pids) == 4  # coordinator, engine, api server, prefork launcher
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in pids), 5, 0.05, "children to die with the supervisor")


def test_second_instance_on_the_same_port_fails_clearly(demo_model_dir, tmp_path):
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dpserve.daemons.cli.main", "serve", demo_model_dir, "--port", str(port), "--data-parallel-supervisor-port", "0"],
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == 2
        err = proc.stderr.decode()
        assert f"cannot bind 127.0.0.1:{port}" in err and "another server" in err, err
    finally:
        holder.close()


def test_api_server_startup_timeout_scales_with_count(demo_model_dir):
    """base + per-server x N: with an 8 s readiness delay, 1 API server (6 s budget)
    fails to start, naming the late children; 3 API servers (16 s budget) start."""
    delay = {"DPSERVE_FAULT_API_STARTUP_DELAY_S": "8"}
    timeouts = ("--api-server-startup-timeout-base-s", "1", "--api-server-startup-timeout-per-server-s", "5")
    slow = DpServer(demo_model_dir, "--api-server-count", "1", *timeouts, env=delay)
    try:
        slow.start(wait_ready=False)
        assert slow.proc.wait(60) == 3
        log = slow.log()
        assert "startup timed out" in log and "api-0" in log, log
        assert "'api-0': 6.0" in log, log
    finally:
        slow.stop()
    ok = DpServer(demo_model_dir, "--api-server-count", "3", *timeouts, env=delay)
    try:
        ok.start(wait_ready=True)
        assert http_get(ok.health_url + "/readyz")[0] == 200
    finally:
        assert ok.stop() == 0


def test_health_endpoints_through_startup_and_shutdown(demo_model_dir):
    srv = DpServer(demo_model_dir, "--data-parallel-size", "1", "--api-server-count", "1")
    try:
        srv.start(wait_ready=False)
        # the health port answers from the first second, before the model is loaded
        code, body = http_get(srv.health_url + "/readyz")
        assert code == 503 and json.loads(body)["phase"] == "starting"
        assert http_get(srv.health_url + "/health")[0] == 200
        status = srv.status()
        assert status["phase"] == "starting"
        assert {c["name"] for c in status["children"]} == {"coordinator", "engine-dp0", "api-0"}
        srv.wait_ready()
        assert http_get(srv.health_url + "/health")[0] == 200
        metrics = http_get(srv.health_url + "/metrics")[1].decode()
        assert 'dpserve_child_restarts_total{child="engine-dp0",kind="engine"} 0' in metrics
        assert "dpserve_node_ready 1" in metrics
        # the status command renders the same table for a person
        out = subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "status", srv.health_url], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "engine-dp0" in out.stdout and "ready" in out.stdout, out
        assert "KV USED" in out.stdout and "0.0%" in out.stdout, out.stdout
    finally:
        assert srv.stop() == 0
