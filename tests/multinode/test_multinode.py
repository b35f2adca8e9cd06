"""Multi-node data parallelism on network-namespace nodes: 2 nodes x 2 ranks, every LB mode,
a cut link, a restarted head, and outsiders without the key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.multinode.netns import CLIENT, Network, available
from tests.server import notable_lines
from tests.support import skip_unless_required

pytestmark = pytest.mark.slow

RPC_PORT = 29550
API_PORT = 8000
HEALTH_PORT = 9256
FAST_PROBES = [
    "--dp-supervisor-probe-interval-s", "0.5",
    "--dp-supervisor-probe-timeout-s", "0.5",
    "--dp-supervisor-probe-failure-threshold", "3",
]
# Besides warnings and errors, the log lines a membership failure is read by.
_MEMBERSHIP_WORDS = ("retir", "join", "registered", "routing", "death", "moved", "lost")


class Deployment:
    """A head and one worker, 2 ranks each, in the given load-balancing mode."""

    def __init__(self, net: Network, model_dir: str, key_file: str, tmp_path, mode_flags: list[str], worker_headless: bool) -> None:
        self.net = net
        self.model_dir = model_dir
        self.key_file = key_file
        self.tmp = tmp_path
        self.mode_flags = mode_flags
        self.headless = worker_headless
        self.head = net.add_node("head")
        self.worker = net.add_node("worker")
        self.head_proc = None
        self.worker_proc = None

    def _cmd(self, role: str, node, extra: list[str]) -> list[str]:
        return [
            sys.executable, "-m", "dpserve.daemons.cli.main", role, self.model_dir,
            "--served-model-name", "demo",
            "--data-parallel-size", "4", "--data-parallel-size-local", "2",
            "--data-parallel-address", self.head.address, "--data-parallel-rpc-port", str(RPC_PORT),
            "--data-parallel-key-file", self.key_file,
            "--host", node.address, "--port", str(API_PORT),
            "--data-parallel-supervisor-host", node.address, "--data-parallel-supervisor-port", str(HEALTH_PORT),
            "--kill-grace-s", "1",
            *FAST_PROBES, *self.mode_flags, *extra,
        ]

    def start_head(self) -> None:
        self.head_proc = self.head.spawn(self._cmd("head", self.head, []), str(self.tmp / "head.log"))

    def start_worker(self) -> None:
        extra = ["--data-parallel-start-rank", "2"] + (["--headless"] if self.headless else [])
        self.worker_proc = self.worker.spawn(self._cmd("worker", self.worker, extra), str(self.tmp / "worker.log"))

    def wait_ready(self, node, timeout: float = 240) -> float:
        t0 = time.monotonic()
        got = node.client("wait-ready", f"http://{node.address}:{HEALTH_PORT}/readyz", str(timeout), timeout=timeout + 30)
        assert got["status"] == 200, f"{node.name} not ready: {got}\n{self.logs()}"
        return time.monotonic() - t0

    def url(self, node) -> str:
        return f"http://{node.address}:{API_PORT}"

    def rank_finished(self, node) -> dict[int, float]:
        text = node.client("get", self.url(node) + "/metrics")["body"]
        out = {}
        for line in text.splitlines():
            if line.startswith("dpserve_rank_requests_finished_total{"):
                out[int(line.split('rank="')[1].split('"')[0])] = float(line.rsplit(" ", 1)[1])
        return out

    def logs(self) -> str:
        parts = []
        for name in ("head.log", "worker.log"):
            path = self.tmp / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-6000:])
        return "\n".join(parts)

    def notable_logs(self, n: int = 80) -> str:
        """Each node's warnings and errors (journal priorities 0-4) and its membership lines, the last `n`:
        what a failure message needs when the tails of the logs are past the moment that matters."""
        parts = []
        for name in ("head.log", "worker.log"):
            path = self.tmp / name
            if path.exists():
                lines = notable_lines(path.read_text(errors="replace"), _MEMBERSHIP_WORDS, n)
                parts.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(parts)


@pytest.fixture
def network():
    reason = available()
    if reason:
        skip_unless_required(reason)
    net = Network()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="session")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("key") / "dp.key"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


def start(net, demo_model_dir, key_file, tmp_path, flags, headless) -> Deployment:
    dep = Deployment(net, demo_model_dir, key_file, tmp_path, flags, headless)
    dep.start_head()
    dep.start_worker()
    dep.wait_ready(dep.head)
    dep.wait_ready(dep.worker)
    return dep


def test_internal_mode_link_cut_head_restart_and_outsiders(network, demo_model_dir, key_file, tmp_path):
    dep = start(network, demo_model_dir, key_file, tmp_path, [], headless=True)
    head, worker = dep.head, dep.worker
    url = dep.url(head)

    # every one of the 4 ranks serves, through the head's API servers
    got = head.client("burst", url, "200", "16")
    assert got["statuses"] == {"200": 200}, got
    assert set(got["ranks"]) == {"0", "1", "2", "3"}, got
    # Not an even split: load-aware routing sends more to whichever ranks finish sooner, and
    # the worker's ranks answer over a network hop that can cost more than a demo-model step
    # (on a CPU with bf16 kernels CI saw 8-17 of 200 on each worker rank, 83-89 on the head's).
    assert min(got["ranks"].values()) >= 5, got

    # outsiders: no key, wrong key, wrong config; injection into an API server
    rogue = head.client("rogue", head.address, str(RPC_PORT), f"tcp://{head.address}:{RPC_PORT + 2}", key_file)
    assert rogue["no_key"] == "no answer", rogue
    assert rogue["wrong_key"] == "no answer", rogue
    assert rogue["wrong_config"].startswith("accepted=False") and "fingerprint" in rogue["wrong_config"], rogue
    assert rogue["api_reply_without_key"] == "nothing", rogue
    head_log = (tmp_path / "head.log").read_text()
    assert "engine registration refused" in head_log and "fingerprint" in head_log

    # cut the worker's link under load: its ranks leave routing, then return
    loop_proc = subprocess.Popen(
        ["nsenter", "-t", str(head.sleeper.pid), "-n", "--", sys.executable, CLIENT, "loop", url, "14", "8"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(2)
        worker.link(False)
        cut_at = time.time()  # once the cable is down (the nsenter call takes ~0.1 s)
        time.sleep(5)
        restored_at = time.time()
        worker.link(True)
        out, _ = loop_proc.communicate(timeout=60)
    finally:
        if loop_proc.poll() is None:
            loop_proc.kill()
    result = json.loads(out)
    base = result["started_wall"]
    records = [(base + s, base + e, st, r) for s, e, st, r in result["records"]]
    failures = [r for r in records if r[2] != "200"]
    # Requests in flight on the lost ranks move to the head's (issue 25): none fails, and
    # the longest wait of a request sent during the cut, one routed to a lost rank before
    # the head knew, is the detection time.
    assert not failures, failures[:5]
    detection = max(e - s for s, e, _, _ in records if cut_at < s < restored_at)
    detected_at = cut_at + detection
    assert detection < 0.5 * 3 + 2.5, f"detection took {detection:.1f} s"
    after = [r for r in records if r[0] > detected_at]
    assert after and all(r[2] == "200" for r in after), [r for r in after if r[2] != "200"][:5]
    # the cut took effect: ranks 2-3 served before it, none of the requests sent
    # while it lasted reached them, and they served again once it was over
    before = {r[3] for r in records if r[1] < cut_at and r[2] == "200"}
    assert {"2", "3"} <= before, f"worker ranks did not serve before the cut: {sorted(before)}"
    during = [r for r in records if detected_at < r[0] < restored_at]
    assert len(during) >= 10, f"only {len(during)} requests were sent during the cut"
    assert {r[3] for r in during} <= {"0", "1"}, f"requests reached the cut-off ranks: {sorted({r[3] for r in during})}"
    back = [r for r in records if r[0] > restored_at and r[3] in ("2", "3")]
    assert back, "worker ranks did not return to routing after the link came back"
    recovery = min(r[0] for r in back) - restored_at
    print(f"\nlink cut: detected after {detection:.2f} s (the longest wait of a request sent during the cut), no request failed, "
          f"worker ranks back {recovery:.2f} s after the link returned")

    # restart the head: the worker re-registers by itself
    dep.head.stop_all()
    t0 = time.monotonic()
    dep.start_head()
    dep.wait_ready(head)
    print(f"head restart: ready with all 4 ranks after {time.monotonic() - t0:.1f} s")
    got = head.client("burst", url, "100", "16")
    assert got["statuses"] == {"200": 100}, got
    assert set(got["ranks"]) == {"0", "1", "2", "3"}, got
    assert dep.worker_proc.poll() is None  # the worker was never touched
    worker_log = (tmp_path / "worker.log").read_text()
    assert "registered again with the coordinator" in worker_log


def test_streams_of_a_torn_down_worker_finish_on_the_heads_ranks(network, demo_model_dir, key_file, tmp_path):
    """Issue 25: the worker node vanishes mid-stream (its cable cut, every process in it
    SIGKILLed); the head judges its ranks lost by their silence, and their streams move to
    the head's ranks and end exactly as the undisturbed reference, with no error (float32:
    bf16 answers depend on the batch)."""
    dep = start(network, demo_model_dir, key_file, tmp_path, ["--dtype", "float32"], headless=True)
    head, worker = dep.head, dep.worker
    url = dep.url(head)
    want = head.client("streams", url, "16", "400")["results"]
    assert all(r["error"] is None for r in want), want
    assert {"2", "3"} & {r["rank"] for r in want}, "no reference stream reached the worker"
    proc = subprocess.Popen(
        ["nsenter", "-t", str(head.sleeper.pid), "-n", "--", sys.executable, CLIENT, "streams", url, "16", "400"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(1.0)
        worker.link(False)
        worker.stop_all(signal.SIGKILL)
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
    got = json.loads(out)["results"]
    moved = [r for r in got if r["rank"] in ("2", "3")]
    assert moved, "no stream was on the worker's ranks"
    assert [r["error"] for r in got] == [None] * 16, [r["error"] for r in got]
    assert [r["text"] for r in got] == [r["text"] for r in want]
    assert "moved_requests" in (tmp_path / "head.log").read_text()


def test_global_mode_frontends_on_every_node_route_cluster_wide(network, demo_model_dir, key_file, tmp_path):
    dep = start(network, demo_model_dir, key_file, tmp_path, ["--api-servers-on-every-node"], headless=False)
    for node in (dep.head, dep.worker):
        got = node.client("burst", dep.url(node), "160", "16")
        assert got["statuses"] == {"200": 160}, got
        assert set(got["ranks"]) == {"0", "1", "2", "3"}, (node.name, got)


def test_hybrid_mode_each_node_serves_its_own_ranks(network, demo_model_dir, key_file, tmp_path):
    dep = start(network, demo_model_dir, key_file, tmp_path, ["--data-parallel-hybrid-lb"], headless=False)
    for node, local in ((dep.head, {"0", "1"}), (dep.worker, {"2", "3"})):
        got = node.client("burst", dep.url(node), "80", "16")
        assert got["statuses"] == {"200": 80}, got
        assert set(got["ranks"]) == local, (node.name, got)
    # a pin to a rank on the other node is the client's error, naming this node's ranks
    got = dep.head.client("burst", dep.url(dep.head), "1", "1", "3")
    assert got["statuses"] == {"400": 1}, got
    got = dep.worker.client("burst", dep.url(dep.worker), "4", "2", "3")
    assert got["statuses"] == {"200": 4} and got["ranks"] == {"3": 4}, got


def test_external_mode_each_port_serves_its_rank(network, demo_model_dir, key_file, tmp_path):
    dep = start(network, demo_model_dir, key_file, tmp_path, ["--data-parallel-multi-port-external-lb"], headless=False)
    for node, first in ((dep.head, 0), (dep.worker, 2)):
        for i in range(2):
            url = f"http://{node.address}:{API_PORT + i}"
            got = node.client("burst", url, "20", "4")
            assert got["statuses"] == {"200": 20}, got
            assert got["ranks"] == {str(first + i): 20}, (node.name, i, got)


def test_ranks_reach_every_node_s_api_servers_through_their_node_s_hops(network, demo_model_dir, key_file, tmp_path):
    """--rank-links node across nodes: each node's ranks reach the other node's API servers
    through their node's hops, over TCP with the deployment's CURVE keys, and every
    frontend routes to all four ranks."""
    dep = start(network, demo_model_dir, key_file, tmp_path, ["--api-servers-on-every-node", "--rank-links", "node"], headless=False)
    for node in (dep.head, dep.worker):
        got = node.client("burst", dep.url(node), "160", "16")
        assert got["statuses"] == {"200": 160}, got
        assert set(got["ranks"]) == {"0", "1", "2", "3"}, (node.name, got)
    for name in ("head.log", "worker.log"):
        log = (tmp_path / name).read_text(errors="replace")
        assert log.count("node hop opened") == 4, (name, log[-3000:])  # 2 API servers on each of 2 nodes
        assert "via=node-0-" in log and "via=node-2-" in log, (name, log[-3000:])
