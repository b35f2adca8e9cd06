"""Issue 18: the head's /status, /readyz, /metrics and `dpserve status` show
every rank of a 2-node deployment; a stopped worker shows up as lost on all
four within the probe interval x threshold, and as ready again once it is
back; a worker cut off from the head says so on its own /readyz. Real nodes
in network namespaces (tests/multinode/netns.py), every process stopped by
the fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.multinode.test_multinode import FAST_PROBES, HEALTH_PORT, key_file, network, start  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

LOST_BUDGET_S = float(FAST_PROBES[1]) * int(FAST_PROBES[5])  # interval x threshold: the coordinator's staleness
SLACK_S = 2.0  # the poll itself (a process per look) and two shared, busy cores

MODES = {
    "internal": ([], True),
    "hybrid": (["--data-parallel-hybrid-lb"], False),
    "global": (["--api-servers-on-every-node"], False),
    "external": (["--data-parallel-multi-port-external-lb"], False),
}


def health(node) -> str:
    return f"http://{node.address}:{HEALTH_PORT}"


def look(node) -> dict:
    """Everything an operator reads on the node, at (nearly) one instant."""
    status = json.loads(node.client("get", health(node) + "/status")["body"])
    readyz = node.client("get", health(node) + "/readyz")
    metrics = node.client("get", health(node) + "/metrics")["body"]
    table = subprocess.run(
        ["nsenter", "-t", str(node.sleeper.pid), "-n", "--", sys.executable, "-m", "dpserve.daemons.cli.main", "status", health(node)],
        capture_output=True, text=True, timeout=60,
    )
    assert table.returncode == 0, table.stderr
    return {"status": status, "readyz_code": readyz["status"], "readyz": json.loads(readyz["body"]), "metrics": metrics, "table": table.stdout}


def states(seen: dict) -> list[str]:
    return [r["state"] for r in seen["status"]["cluster"]["ranks"]]


# Polls /status every 50 ms inside the node's namespace and prints the monotonic
# time (one clock for every namespace) at which the ranks first were `want`.
POLLER = """
import json, sys, time, urllib.request
url, want, deadline = sys.argv[1], sys.argv[2].split(","), time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    t = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            ranks = json.load(resp)["cluster"]["ranks"]
        if [r["state"] for r in ranks] == want:
            print(t)
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.05)
sys.exit(1)
"""


def start_poller(node, want: list[str], timeout: float) -> subprocess.Popen:
    cmd = ["nsenter", "-t", str(node.sleeper.pid), "-n", "--", sys.executable, "-c", POLLER, health(node) + "/status", ",".join(want), str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def wait_for(node, want: list[str], timeout: float) -> tuple[dict, float]:
    """Polls /status until the ranks are in `want`; then every view, and when /status first said so."""
    t0 = time.monotonic()
    while True:
        status = json.loads(node.client("get", health(node) + "/status")["body"])
        if [r["state"] for r in status["cluster"]["ranks"]] == want:
            return look(node), time.monotonic()
        assert time.monotonic() - t0 < timeout, f"{node.name}: ranks {[r['state'] for r in status['cluster']['ranks']]}, want {want}"
        time.sleep(0.1)


@pytest.mark.parametrize("mode", list(MODES))
def test_head_shows_a_stopped_worker_lost_then_back(mode, network, demo_model_dir, key_file, tmp_path):  # noqa: F811
    flags, headless = MODES[mode]
    dep = start(network, demo_model_dir, key_file, tmp_path, [*flags, "--min-ready-ranks", "3"], headless)
    head, worker = dep.head, dep.worker
    # the head routes to every rank only in internal and global mode: only there does it need 3 of them
    head_needs_the_worker = mode in ("internal", "global")

    seen = look(head)
    assert states(seen) == ["ready"] * 4, seen["status"]
    assert [r["node"] for r in seen["status"]["cluster"]["ranks"]] == [0, 0, 2, 2]
    assert seen["readyz_code"] == 200 and seen["readyz"]["ranks_routable"] == 4
    assert 'dpserve_cluster_ranks{state="ready"} 4.0' in seen["metrics"]
    w = look(worker)
    assert states(w) == ["ready"] * 4 and w["readyz_code"] == 200
    if headless:
        assert w["status"]["port"] is None and w["status"]["api_server_count"] == 0, w["status"]
        assert not [c for c in w["status"]["children"] if c["kind"] == "api"]
    if mode == "external":
        apis = [c for c in w["status"]["children"] if c["kind"] == "api"]
        assert [(c["name"], c["rank"], c["routes_to"]) for c in apis] == [("api-0", None, [2]), ("api-1", None, [3])]

    # stop the worker: the head's four views say ranks 2-3 are lost, within interval x threshold
    lost = ["ready", "ready", "lost", "lost"]
    poller = start_poller(head, lost, 90)
    try:
        time.sleep(1.0)  # the poller is up and polling
        dep.worker.stop_all()
        exited = time.monotonic()
        out, _ = poller.communicate(timeout=120)
    finally:
        if poller.poll() is None:
            poller.kill()
            poller.wait()
    assert poller.returncode == 0, "the head never showed ranks 2-3 lost"
    took = float(out) - exited
    seen, _ = wait_for(head, lost, 10)
    assert took <= LOST_BUDGET_S + SLACK_S, f"lost seen {took:.1f} s after the worker exited (budget {LOST_BUDGET_S} s)"
    assert seen["status"]["cluster"]["ranks_lost"] == 2 and seen["readyz"]["ranks_lost"] == 2
    assert [r["address"] for r in seen["status"]["cluster"]["ranks"]] == [head.address] * 2 + [worker.address] * 2
    assert seen["readyz"]["ranks_routable"] == 2
    assert 'dpserve_cluster_ranks{state="lost"} 2.0' in seen["metrics"]
    assert 'dpserve_cluster_rank_state{node="2",rank="3",state="lost"} 1.0' in seen["metrics"]
    assert seen["table"].count("LOST") == 3, seen["table"]  # the header and both rows
    if head_needs_the_worker:
        assert seen["readyz_code"] == 503 and "below --min-ready-ranks 3" in seen["readyz"]["reason"], seen["readyz"]
        assert "dpserve_node_ready 0.0" in seen["metrics"] and "NOT READY: 2/4 ranks routable" in seen["table"]
        assert seen["status"]["ready"] is False
    else:
        assert seen["readyz_code"] == 200 and seen["status"]["ready"] is True  # its own ranks serve its clients
    print(f"\n{mode}: worker lost on the head's views {took:.1f} s after it exited\n{seen['table']}")

    # the worker comes back: all four views agree again
    dep.start_worker()
    dep.wait_ready(worker)
    seen, _ = wait_for(head, ["ready"] * 4, 60)
    assert seen["readyz_code"] == 200 and seen["readyz"]["ranks_lost"] == 0
    assert 'dpserve_cluster_ranks{state="lost"} 0.0' in seen["metrics"] and "LOST" not in seen["table"]

    if mode != "internal":
        return
    # cut the worker off: it says it lost the head on its own /readyz, and is ready again once the link returns
    worker.link(False)
    try:
        t0 = time.monotonic()
        while True:
            got = worker.client("get", health(worker) + "/readyz")
            if got["status"] == 503:
                break
            assert time.monotonic() - t0 < 30, got
            time.sleep(0.2)
        body = json.loads(got["body"])
        assert body["reason"].startswith("lost the head") and body["head_connected"] is False, body
        print(f"worker: /readyz 503 ({body['reason']}) {time.monotonic() - t0:.1f} s after the cut")
    finally:
        worker.link(True)
    got = worker.client("wait-ready", health(worker) + "/readyz", "60", timeout=90)
    assert got["status"] == 200, got
