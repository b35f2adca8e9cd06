"""Fixtures of the system tests: one testbed and one head node per session, dpserve installed in it.

The node sees this checkout, its virtual environment and the session's demo
model read-only, at their host paths (the model at NODE_MODEL_DIR), and
installs the units with the checkout's own `dpserve install-units`. Every
process started here is stopped here, also after a failure: the testbed's
close() powers the node off and kills what is left in its cgroups.

Test-only settings, in one drop-in (TEST_DROPIN) and the env file (head_env:
one rank, one API server, fast probes, a deliberate warning at each API-server start):
- WatchdogSec=10 and RestartSec=1 instead of 30 s and 5 s, so the watchdog and
  restart tests take seconds, not a minute;
- TimeoutStartSec=6 instead of 120 s: shorter than a start takes here, so every
  start proves that the daemon's EXTEND_TIMEOUT_USEC really extends it;
- when the checkout or the interpreter lives under /root, /home or /run/user
  (CI clones anywhere), the units' ProtectHome=yes would hide them: the drop-in
  switches to ProtectHome=tmpfs and binds exactly those paths back, read-only.
  A real installation keeps dpserve out of home directories (the env example says so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import skip_unless_required
from tests.system.testbed import Node, Testbed, diff_host_state, host_state, unsupported_reason, wait_for

REPO = Path(__file__).resolve().parents[2]
NODE_MODEL_DIR = "/opt/dpserve-test/model"
INSTANCE = "demo"
HEAD_UNIT = f"dpserve-head@{INSTANCE}.service"
TEST_DROPIN = "/etc/systemd/system/dpserve-head@.service.d/50-system-test.conf"
TEST_WATCHDOG_S = 10
TEST_START_TIMEOUT_S = 6
HOME_ROOTS = ("/root", "/home", "/run/user")
TMP_ROOTS = ("/tmp", "/var/tmp")  # hidden by the units' PrivateTmp=yes
API_PORT = 8000
HEALTH_PORT = 9256


def pytest_terminal_summary(terminalreporter) -> None:
    """Print what the tests measured (record_property("measured: ...", value))."""
    lines = [
        f"{name[len('measured: '):]}: {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", "") == "call"
        for name, value in getattr(report, "user_properties", ())
        if name.startswith("measured: ")
    ]
    if lines:
        terminalreporter.write_sep("-", "system tests: measured")
        for line in lines:
            terminalreporter.write_line(line)


def dpserve_bin() -> str:
    """The dpserve script of the environment running the tests (also what the node runs)."""
    own = Path(sys.prefix) / "bin" / "dpserve"
    if own.is_file():
        return str(own)
    found = shutil.which("dpserve")
    if not found:
        pytest.fail("no dpserve script in this environment: install the checkout (pip install -e .)")
    return found


def _under_home(path: str) -> bool:
    return any(path == h or path.startswith(h + "/") for h in HOME_ROOTS)


def _under_tmp(path: str) -> bool:
    return any(path.startswith(t + "/") for t in TMP_ROOTS)


def project_paths() -> list[str]:
    """Host paths a node needs, outermost only: the checkout, the venv, the real interpreter."""
    paths = {str(REPO), os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    paths = {p for p in paths if p not in ("/", "/usr", "/usr/local")}
    return sorted(p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths))


def _check_readable_by_others(paths: list[str]) -> None:
    """The service runs as the dpserve user: the checkout and interpreter must be world-readable."""
    for path in paths:
        for probe in (path, os.path.join(path, "bin")):
            if os.path.isdir(probe) and (os.stat(probe).st_mode & 0o005) != 0o005:
                pytest.fail(f"{probe} is not readable by other users (mode {os.stat(probe).st_mode & 0o777:o}); "
                            "the dpserve service user cannot run this checkout. Clone with umask 022.")


@pytest.fixture(scope="session")
def system_support() -> None:
    reason = unsupported_reason()
    if reason:
        skip_unless_required(reason)


@pytest.fixture(scope="session")
def root_support() -> None:
    """For the checks that need root and systemd-analyze but no node."""
    if os.geteuid() != 0:
        skip_unless_required("unit checks run systemd-analyze in a private mount namespace: they need root")
    if shutil.which("systemd-analyze") is None or shutil.which("unshare") is None:
        skip_unless_required("unit checks need systemd-analyze and unshare (apt-get install systemd util-linux)")


@pytest.fixture(scope="session")
def testbed(system_support):
    before = host_state()
    tb = Testbed(binds=[(p, p) for p in project_paths()])
    try:
        tb.start()
        yield tb
    finally:
        tb.close()
    problems = diff_host_state(before, host_state()) + [f"left behind: {x}" for x in tb.leftovers()]
    assert not problems, "the session's testbed changed the host:\n" + "\n".join(problems)


def _readable_model(model_dir: str) -> str:
    for dirpath, _dirs, files in os.walk(model_dir):
        os.chmod(dirpath, os.stat(dirpath).st_mode | 0o555)
        for name in files:
            path = os.path.join(dirpath, name)
            os.chmod(path, os.stat(path).st_mode | 0o444)
    return model_dir


def head_env() -> str:
    """The node's /etc/dpserve/demo.env: one rank, one API server, fast probes."""
    return "\n".join([
        "# written by tests/system/conftest.py",
        f"DPSERVE_MODEL={NODE_MODEL_DIR}",
        "DPSERVE_SERVED_MODEL_NAME=demo",
        "DPSERVE_HOST=0.0.0.0",
        f"DPSERVE_PORT={API_PORT}",
        f"DPSERVE_DATA_PARALLEL_SUPERVISOR_PORT={HEALTH_PORT}",
        "DPSERVE_DATA_PARALLEL_SIZE=1",
        "DPSERVE_API_SERVER_COUNT=1",
        "DPSERVE_MAX_MODEL_LEN=2048",  # room for the drain test's long stream
        "DPSERVE_DP_SUPERVISOR_PROBE_INTERVAL_S=0.5",
        "DPSERVE_DP_SUPERVISOR_PROBE_TIMEOUT_S=2",
        # longer than the test watchdog period, shorter than TimeoutStopSec
        "DPSERVE_SHUTDOWN_TIMEOUT=12",
        # A deliberate warning at every API-server start, for the journal test.
        "DPSERVE_FAULT_API_STARTUP_DELAY_S=0.1",
        # The node's only rank would take every core (plan.rank_threads) of a host the test suite shares.
        "OMP_NUM_THREADS=1",
        "",
    ])


def dropin_text(paths: list[str]) -> str:
    lines = [
        "# Test-only (tests/system/conftest.py): shorter watchdog, start floor and restart delay.",
        "[Service]",
        f"WatchdogSec={TEST_WATCHDOG_S}",
        f"TimeoutStartSec={TEST_START_TIMEOUT_S}",
        "RestartSec=1",
    ]
    in_home = [p for p in paths if _under_home(p)]
    in_tmp = [p for p in paths if _under_tmp(p)]
    if in_home:
        lines += [
            "# The checkout or interpreter lives in a home directory: show exactly those paths.",
            "ProtectHome=tmpfs",
        ]
    if in_tmp:
        lines.append("# The checkout lives under /tmp (a CI clone): bind it into the private /tmp.")
    if in_home or in_tmp:
        lines.append("BindReadOnlyPaths=" + " ".join(in_home + in_tmp))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def head_node(testbed: Testbed, demo_model_dir: str) -> Node:
    """The node with dpserve's units installed (via install-units) and the test env file; not started."""
    paths = project_paths()
    _check_readable_by_others(paths)
    node = testbed.add_node("head", binds=[(_readable_model(demo_model_dir), NODE_MODEL_DIR)])
    node.run(dpserve_bin(), "install-units", timeout=120)
    node.write_file(f"/etc/dpserve/{INSTANCE}.env", head_env(), mode=0o640)
    node.write_file(TEST_DROPIN, dropin_text(paths))
    node.systemctl("daemon-reload")
    return node


# -------------------------------------------------------------------- helpers for the tests


def main_pid(node: Node) -> int:
    return int(node.show(HEAD_UNIT, "MainPID")["MainPID"] or 0)


def is_ready(node: Node) -> bool:
    return node.http(f"http://127.0.0.1:{HEALTH_PORT}/readyz", timeout=5)[0] == 200


def ensure_serving(node: Node) -> int:
    """Start the head unit unless it is active; returns its main PID."""
    state = node.show(HEAD_UNIT, "ActiveState")["ActiveState"]
    if state != "active":
        node.systemctl("reset-failed", HEAD_UNIT, check=False)
        node.systemctl("start", HEAD_UNIT, timeout=300)
    return main_pid(node)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    """The testbed's deadline poll, with the tests' default interval."""
    return wait_for(predicate, timeout, what, interval)


def journal_cursor(node: Node) -> str:
    entries = node.journal("-n", "1")
    return entries[-1]["__CURSOR"] if entries else ""


def unit_journal(node: Node, cursor: str = "", *args: str) -> list[dict]:
    extra = [f"--after-cursor={cursor}"] if cursor else []
    return node.journal("-u", HEAD_UNIT, *extra, *args)


def dpserve_processes(node: Node) -> list[str]:
    """Every process in the node that runs dpserve code (any user)."""
    out = node.run("ps", "-eo", "pid=,user=,args=", check=False).stdout
    return [line.strip() for line in out.splitlines() if "dpserve" in line]


def node_popen(node: Node, script: str) -> subprocess.Popen:
    return node.popen("/bin/sh", "-c", script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
