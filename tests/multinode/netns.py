"""Network-namespace nodes on one machine: a switch namespace with a bridge, one
namespace per node with its own 10.77.0.x address, processes started inside.

Nothing here touches the host's own network: every link and address lives in
the namespaces this harness creates, and `close()` removes them by killing the
sleeper processes that hold them. Traffic to 10.77.0.x must come from inside a
namespace (from the host, that range is answered by the machine's sandbox).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENT = os.path.join(REPO, "tests", "multinode", "netclient.py")
SUBNET = "10.77.0"


def available() -> str:
    """'' when this machine can run the harness, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.decode().strip()}"
    return ""


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["unshare", "--net", "sleep", "infinity"], start_new_session=True)


def _in(pid: int, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(pid), "-n", "--", *cmd], capture_output=True, text=True, check=check, timeout=60)


class Node:
    def __init__(self, net: Network, name: str, address: str) -> None:
        self.net = net
        self.name = name
        self.address = address
        self.sleeper = _sleeper()
        self.procs: list[subprocess.Popen] = []
        time.sleep(0.05)
        sw = net.switch.pid
        _in(sw, "ip", "link", "add", f"v-{name}", "type", "veth", "peer", "name", "eth0", "netns", str(self.sleeper.pid))
        _in(sw, "ip", "link", "set", f"v-{name}", "master", "br0", "up")
        _in(self.sleeper.pid, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        _in(self.sleeper.pid, "ip", "link", "set", "eth0", "up")
        _in(self.sleeper.pid, "ip", "link", "set", "lo", "up")

    def spawn(self, cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
        """Start a process inside this node's network namespace (its own process group)."""
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            ["nsenter", "-t", str(self.sleeper.pid), "-n", "--", *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DPSERVE_DIE_WITH_PARENT": "1", **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def client(self, *args: str, timeout: float = 120) -> dict:
        """Run tests/multinode/netclient.py inside this node; returns its JSON answer."""
        out = subprocess.run(
            ["nsenter", "-t", str(self.sleeper.pid), "-n", "--", sys.executable, CLIENT, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "NETCLIENT_DEADLINE": str(max(1.0, timeout - 10))},
        )
        if out.returncode != 0:
            raise RuntimeError(f"netclient {args} failed ({out.returncode}): {out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def link(self, up: bool) -> None:
        """Cut or restore this node's cable to the switch."""
        _in(self.net.switch.pid, "ip", "link", "set", f"v-{self.name}", "up" if up else "down")

    def stop_all(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self.stop_all()
        self.sleeper.kill()
        self.sleeper.wait(5)


class Network:
    """A bridge in a switch namespace; nodes get 10.77.0.11, .12, ..."""

    def __init__(self) -> None:
        self.switch = _sleeper()
        time.sleep(0.05)
        _in(self.switch.pid, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.switch.pid, "ip", "link", "set", "br0", "up")
        _in(self.switch.pid, "ip", "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        _in(self.switch.pid, "ip", "link", "set", "lo", "up")
        self.nodes: list[Node] = []

    def add_node(self, name: str) -> Node:
        node = Node(self, name, f"{SUBNET}.{11 + len(self.nodes)}")
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.switch.kill()
        self.switch.wait(5)
