"""The harness itself: nodes boot a real systemd, reach each other only over the bridge, and
the host is exactly as before once the testbed is closed."""

from __future__ import annotations

import sys

import pytest

from tests.system.conftest import project_paths
from tests.system.testbed import Testbed, diff_host_state, host_state, wait_for

pytestmark = pytest.mark.system


def test_nodes_boot_systemd_on_a_private_bridge_and_the_host_is_left_untouched(system_support):
    before = host_state()
    with Testbed(binds=[(p, p) for p in project_paths()]) as tb:
        a = tb.add_node("tb-a")
        b = tb.add_node("tb-b")
        for node in (a, b):
            assert node.run("cat", "/proc/1/comm").stdout.strip() == "systemd"
            assert node.run("hostname").stdout.strip() == node.name
            assert node.run("systemctl", "is-system-running", check=False).stdout.strip() in ("running", "degraded")
            # nspawn keeps the kernel's settings read-only: a node cannot change the host's sysctls
            assert node.sh("echo 10 > /proc/sys/vm/swappiness", check=False).returncode != 0
        # b serves HTTP on its bridge address; a and the switch reach it, by address only
        b.run("systemd-run", "--unit=tb-http", sys.executable, "-m", "http.server", "--bind", b.address, "8080")
        url = f"http://{b.address}:8080/"
        for origin, run in (("node a", a.run), ("the switch", tb.in_switch)):
            def answers(run=run) -> bool:
                proc = run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", url, check=False)
                return proc.stdout == "200"

            wait_for(answers, 60, f"{url} to answer {origin}")
        # each node has its own process tree
        assert "http.server" not in a.run("ps", "-eo", "args").stdout
        during = host_state()
        assert all((d / "tb-a").is_dir() for d in tb.cgroup_dirs())  # the testbed's only trace
    assert diff_host_state(before, host_state()) == []
    assert tb.leftovers() == []
    # while it ran, the host's state was already the same: everything lived in the namespaces
    assert diff_host_state(before, during) == []
