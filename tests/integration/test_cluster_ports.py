"""Issue 18, ports: operator mistakes with multi-node ports are exit 2 (a
configuration error systemd does not restart in a loop) with a message naming
the flag, never a child's traceback and exit 3; two nodes on one host run once
their API servers' engine channels get their own base. Real heads and workers
on loopback, each stopped by the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server import free_port_run, http_get, wait_until

pytestmark = pytest.mark.slow


class Node:
    """One `dpserve head|worker` process on loopback, in its own process group."""

    def __init__(self, tmp: Path, name: str, role: str, model: str, key: str, rpc: int, *extra: str,
                 python: str | None = None, env: dict | None = None) -> None:
        self.log_path = tmp / f"{name}.log"
        self.ports_file = tmp / f"{name}.ports"
        cmd = [
            python or sys.executable, "-m", "dpserve.daemons.cli.main", role, model, "--served-model-name", "demo",
            "--data-parallel-size", "2", "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
            "--data-parallel-key-file", key, "--port", "0", "--data-parallel-supervisor-port", "0",
            "--api-server-count", "1", "--ports-file", str(self.ports_file), "--kill-grace-s", "1",
            "--dp-supervisor-probe-interval-s", "0.5", "--dp-supervisor-probe-timeout-s", "0.5",
            *extra,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "DPSERVE_DIE_WITH_PARENT": "1", **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s:\n{self.log()[-3000:]}")

    def health(self) -> str:
        wait_until(lambda: self.ports_file.exists() or self.proc.poll() is not None, 60, what="ports file")
        assert self.proc.poll() is None, self.log()[-3000:]
        return f"http://127.0.0.1:{json.loads(self.ports_file.read_text())['supervisor_port']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def key_file(tmp_path) -> str:
    path = tmp_path / "dp.key"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


def test_a_second_head_on_a_used_rpc_port_exits_2_naming_the_flag(demo_model_dir, key_file, tmp_path, nodes):
    rpc = free_port_run(3)
    first = Node(tmp_path, "head1", "head", demo_model_dir, key_file, rpc)
    nodes.append(first)
    wait_until(lambda: "coordinator ready" in first.log() or first.proc.poll() is not None, 60, 0.1, "the first head's coordinator")
    assert first.proc.poll() is None, first.log()[-3000:]
    t0 = time.monotonic()
    second = Node(tmp_path, "head2", "head", demo_model_dir, key_file, rpc)
    nodes.append(second)
    rc = second.wait_exit()
    text = second.log()
    assert rc == 2, text[-3000:]
    assert f"cannot listen on 127.0.0.1:{rpc}" in text and "choose another --data-parallel-rpc-port" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "child started" not in text  # checked before any child starts
    assert first.proc.poll() is None  # the first head is untouched
    print(f"\nsecond head: exit 2 after {time.monotonic() - t0:.1f} s")


def test_two_nodes_on_one_host_need_their_own_api_rpc_port_base(demo_model_dir, key_file, tmp_path, nodes):
    rpc = free_port_run(16)
    head = Node(tmp_path, "head", "head", demo_model_dir, key_file, rpc, "--data-parallel-hybrid-lb")
    nodes.append(head)
    head_health = head.health()
    wait_until(lambda: "child ready" in head.log() and "api-0" in head.log(), 120, 0.1, "the head's API server")
    # the worker's API server would take rpc-port+2 on the same address: exit 2, naming the flag
    clash = Node(tmp_path, "clash", "worker", demo_model_dir, key_file, rpc, "--data-parallel-hybrid-lb", "--data-parallel-start-rank", "1")
    nodes.append(clash)
    rc = clash.wait_exit()
    text = clash.log()
    assert rc == 2, text[-3000:]
    assert f"cannot listen on 127.0.0.1:{rpc + 2}" in text and "--data-parallel-api-rpc-port-base (default: rpc-port+2)" in text, text[-3000:]
    assert "Traceback" not in text
    # with its own base both nodes serve, and the head's /status shows the worker's rank
    worker = Node(tmp_path, "worker", "worker", demo_model_dir, key_file, rpc, "--data-parallel-hybrid-lb", "--data-parallel-start-rank", "1",
                  "--data-parallel-api-rpc-port-base", str(rpc + 10))
    nodes.append(worker)
    worker_health = worker.health()
    for node, url in ((head, head_health), (worker, worker_health)):
        def ready(node=node, url=url):
            assert node.proc.poll() is None, node.log()[-3000:]
            try:
                return http_get(url + "/readyz", 2)[0] == 200
            except OSError:
                return False

        wait_until(ready, 240, 0.2, "readiness")
    status = json.loads(http_get(head_health + "/status")[1])
    ranks = status["cluster"]["ranks"]
    assert [(r["rank"], r["node"], r["state"], r["routed_by"]) for r in ranks] == [(0, 0, "ready", "node 0"), (1, 1, "ready", "node 1")]
