"""Ranks leaving and joining a running node on purpose: `dpserve drain` / `undrain`.

One DP=2 node (no key file: the health port's verbs are for loopback peers).
A drained rank is out of routing and every view within a second, says
"drained" (not lost, not unhealthy), is not restarted by the policy, and
serves again after undrain. The admin token of a node with a key file is
checked on the health port's own handlers (aiohttp's test server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from tests.server import DpServer, http_get, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def node(demo_model_dir):
    srv = DpServer(demo_model_dir, "--data-parallel-size", "2", "--api-server-count", "1")
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def dpserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", *args], capture_output=True, text=True, timeout=60)


def rank_row(srv: DpServer, rank: int) -> dict:
    return next(r for r in srv.status()["cluster"]["ranks"] if r["rank"] == rank)


def post(url: str, body: bytes, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_drain_checks_its_rank(node):
    url = node.health_url
    assert post(url + "/drain", b'{"rank": "1"}') == 400
    assert post(url + "/drain", b"{}") == 400
    assert post(url + "/drain", b'{"rank": 7}') == 404  # not this node's
    assert rank_row(node, 1)["state"] == "ready"


def test_a_drained_rank_leaves_at_once_stays_stopped_and_returns_on_undrain(node):
    pid = node.child("engine-dp1")["pid"]
    t0 = time.monotonic()
    assert post(node.health_url + "/drain", b'{"rank": 1}') == 202  # what `dpserve drain --rank 1` sends
    wait_until(lambda: rank_row(node, 1)["state"] == "drained", 5, 0.01, "rank 1 drained in /status")
    drained_after = time.monotonic() - t0
    print(f"\ndrained in /status after {drained_after:.3f} s")
    assert drained_after < 1.0
    row = rank_row(node, 1)
    assert "drained" in row["reason"]
    wait_until(lambda: node.child("engine-dp1")["state"] == "drained", 10, 0.05, "the child drained")
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    # a pin to it fails at once, unpinned requests go to rank 0
    with openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        t1 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="demo", prompt="x", max_tokens=2, extra_headers={"X-data-parallel-rank": "1"})
        assert err.value.status_code == 503 and "drained" in err.value.body["message"]
        assert time.monotonic() - t1 < 1.0
        raw = client.completions.with_raw_response.create(model="demo", prompt="x", max_tokens=2)
        assert raw.headers["X-data-parallel-rank"] == "0"
    # drained, not failed: /health stays 200, the views say so
    assert http_get(node.health_url + "/health")[0] == 200
    readyz = json.loads(http_get(node.health_url + "/readyz")[1])
    assert readyz["ranks_drained"] == 1 and readyz["ranks_lost"] == 0
    metrics = http_get(node.health_url + "/metrics")[1].decode()
    assert 'dpserve_cluster_ranks{state="drained"} 1.0' in metrics
    table = dpserve("status", node.health_url).stdout
    assert "1 drained" in table and "drained (dpserve drain)" in table
    # not restarted by the policy (its backoff would be 0.5 s)
    time.sleep(2.0)
    child = node.child("engine-dp1")
    assert child["state"] == "drained" and child["pid"] is None
    # a second drain is no error
    again = dpserve("drain", "--rank", "1", node.health_url)
    assert again.returncode == 0 and "already drained" in again.stdout
    # undrain: started again, routed again
    out = dpserve("undrain", "--rank", "1", node.health_url)
    assert out.returncode == 0 and "rank 1: starting" in out.stdout, out
    wait_until(lambda: rank_row(node, 1)["state"] == "ready", 120, 0.1, "rank 1 ready again")
    with openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        pinned = client.completions.create(model="demo", prompt="x", max_tokens=2, extra_headers={"X-data-parallel-rank": "1"})
        assert pinned.usage.completion_tokens == 2


def test_a_rolling_restart_of_ranks_moves_their_requests(node):
    """Each rank stops at once and its streams move: no stream fails, and the restart
    takes about ranks x a rank's restart, not the answers' length."""
    import threading

    from tests.server import stream_request

    wait_until(lambda: all(rank_row(node, r)["state"] == "ready" for r in (0, 1)), 120, 0.1, "both ranks ready")
    pids = {r: node.child(f"engine-dp{r}")["pid"] for r in (0, 1)}
    results = [{} for _ in range(6)]
    threads = [threading.Thread(target=stream_request, args=(node.port, 1500, r)) for r in results]
    for t in threads:
        t.start()
    wait_until(lambda: all("started" in r for r in results), 60, 0.05, "every stream under way")
    t0 = time.monotonic()
    assert post(node.health_url + "/rolling-restart", b'{"ranks": true}') == 202
    assert post(node.health_url + "/rolling-restart", b'{"ranks": true}') == 409  # one at a time
    assert post(node.health_url + "/rolling-restart", b"{}") == 400
    wait_until(lambda: node.log().count("rolling restart done") >= 1, 240, 0.1, "the rolling restart")
    took = time.monotonic() - t0
    for t in threads:
        t.join(120)
    print(f"\nrolling restart of 2 ranks under 6 streams of 1,500 tokens: {took:.1f} s; "
          f"streams still running then: {sum(t.is_alive() for t in threads)}")
    assert all(node.child(f"engine-dp{r}")["pid"] != pids[r] for r in (0, 1))
    errors = [r.get("error") or r.get("exception") for r in results]
    assert errors == [None] * 6, errors
    assert all(r["done"] and r["finishes"] == ["length"] for r in results), results
    moved = sum(float(line.rsplit(" ", 1)[1]) for line in node.metrics().splitlines()
                if line.startswith("dpserve_api_requests_migrated_total"))
    print(f"requests moved: {moved:g}")
    assert moved >= 1  # the streams on the first rank to restart, at least


def test_the_token_and_loopback_rules(tmp_path):
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from dpserve.daemons.supervisor.draining import DrainEndpoints, _is_loopback, admin_token

    assert _is_loopback("127.0.0.1") and _is_loopback("::1")
    assert not _is_loopback("10.0.0.1") and not _is_loopback(None) and not _is_loopback("unix")
    key = tmp_path / "dp.key"
    key.write_bytes(b"0123456789abcdef0123456789abcdef")
    asked = []

    def post(event):  # the loop's part: answer at once
        asked.append((event.rank, event.verb))
        event.reply.set_result((202, {"rank": event.rank, "state": "draining"}))

    async def run() -> list[int]:
        app = web.Application()
        DrainEndpoints(post, str(key)).add_routes(app)
        async with TestClient(TestServer(app)) as client:
            good = {"Authorization": f"Bearer {admin_token(str(key))}"}
            codes = []
            for headers in ({}, {"Authorization": "Bearer nope"}, good):
                resp = await client.post("/drain", json={"rank": 3}, headers=headers)
                codes.append(resp.status)
            codes.append((await client.post("/undrain", json={"rank": 3}, headers=good)).status)
            return codes

    assert asyncio.run(run()) == [401, 401, 202, 202]
    assert asked == [(3, "drain"), (3, "undrain")]
    assert admin_token(str(key)) != key.read_text()  # derived, never the secret


# ---------------------------------------------------------------- ranks that join and leave a running head


class Node:
    """One `dpserve head|worker` on loopback in its own process group, stopped by the test."""

    def __init__(self, tmp, name: str, role: str, model: str, key: str, rpc: int, *extra: str) -> None:
        self.log_path = tmp / f"{name}.log"
        self.ports_file = tmp / f"{name}.ports"
        cmd = [
            sys.executable, "-m", "dpserve.daemons.cli.main", role, model, "--served-model-name", "demo",
            "--data-parallel-size", "1", "--data-parallel-size-max", "3", "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
            "--data-parallel-key-file", key, "--port", "0", "--data-parallel-supervisor-port", "0",
            "--ports-file", str(self.ports_file), "--kill-grace-s", "2", *extra,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "DPSERVE_DIE_WITH_PARENT": "1"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def ports(self) -> dict:
        wait_until(lambda: self.ports_file.exists() or self.proc.poll() is not None, 60, what="ports file")
        assert self.proc.poll() is None, self.log()
        return json.loads(self.ports_file.read_text())

    @property
    def health(self) -> str:
        return f"http://127.0.0.1:{self.ports()['supervisor_port']}"

    def status(self) -> dict:
        return json.loads(http_get(self.health + "/status")[1])

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
def cluster_nodes():
    started: list[Node] = []
    yield started
    for n in started:
        n.stop()


def members(head: Node) -> dict[int, str]:
    return {r["rank"]: r["state"] for r in head.status()["cluster"]["ranks"]}


def test_a_worker_joins_a_running_head_retires_and_is_replaced(demo_model_dir, tmp_path, cluster_nodes):
    from tests.server import free_port_run

    key = tmp_path / "dp.key"
    key.write_bytes(os.urandom(32).hex().encode())
    key.chmod(0o600)
    rpc = free_port_run(4)
    head = Node(tmp_path, "head", "head", demo_model_dir, str(key), rpc, "--api-server-count", "1")
    cluster_nodes.append(head)
    wait_until(lambda: http_get(head.health + "/readyz")[0] == 200, 180, 0.2, "the head ready")
    status = head.status()
    assert (status["data_parallel_size"], status["data_parallel_size_max"], members(head)) == (1, 3, {0: "ready"})
    url = f"http://127.0.0.1:{head.ports()['port']}/v1"

    def pin(rank: int):
        with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as client:
            return client.completions.create(model="demo", prompt="x", max_tokens=2, extra_headers={"X-data-parallel-rank": str(rank)})

    # 1. a worker with a rank the head has never seen joins: no restart of the head
    worker = Node(tmp_path, "worker", "worker", demo_model_dir, str(key), rpc, "--headless", "--data-parallel-start-rank", "1")
    cluster_nodes.append(worker)
    wait_until(lambda: http_get(worker.health + "/readyz")[0] == 200, 180, 0.05, "the worker ready")
    joined = time.monotonic()
    wait_until(lambda: members(head).get(1) == "ready", 5, 0.02, "rank 1 a member of the head's cluster")
    api = json.loads(http_get(f"http://127.0.0.1:{head.ports()['port']}/readyz")[1])
    wait_until(lambda: 1 in json.loads(http_get(f"http://127.0.0.1:{head.ports()['port']}/readyz")[1])["routable_ranks"],
               2, 0.02, "rank 1 routable by the head's API server")
    print(f"\nrank 1 routable {time.monotonic() - joined:.2f} s after its node said ready")
    assert pin(1).usage.completion_tokens == 2
    status = head.status()
    assert status["data_parallel_size"] == 2 and status["cluster"]["ranks_routable"] == 2
    assert "dpserve_cluster_data_parallel_size 2.0" in http_get(head.health + "/metrics")[1].decode()
    assert api["eligible_ranks"] == [0, 1, 2]  # sized by the max; rank 2 simply is no member

    # 2. the worker's node retires: out of every view within a second, a pin fails at once
    from dpserve.daemons.cli.drain import ask

    t0 = time.monotonic()
    status, answer = ask(worker.health, "retire", None, str(key))  # what `dpserve retire --node` sends
    assert status == 202 and answer["ranks"][0]["state"] == "retiring", answer
    wait_until(lambda: 1 not in members(head), 5, 0.01, "rank 1 out of the head's cluster")
    print(f"retired out of the head's /status after {time.monotonic() - t0:.3f} s")
    assert time.monotonic() - t0 < 1.0
    out = dpserve("retire", "--node", "--data-parallel-key-file", str(key), worker.health)
    assert out.returncode == 0 and "rank 1: drained (already retired)" in out.stdout, (out.stdout, out.stderr)
    assert head.status()["data_parallel_size"] == 1
    assert "dpserve_cluster_data_parallel_size 1.0" in http_get(head.health + "/metrics")[1].decode()
    assert "retired" in dpserve("status", worker.health).stdout  # the worker's own child says why
    with pytest.raises(openai.APIStatusError) as err:
        pin(1)
    assert err.value.status_code == 503 and "retired" in err.value.body["message"]
    worker.stop()
    assert http_get(head.health + "/readyz")[0] == 200  # the head never needed it

    # 3. a new worker with the same rank replaces the node
    again = Node(tmp_path, "worker2", "worker", demo_model_dir, str(key), rpc, "--headless", "--data-parallel-start-rank", "1")
    cluster_nodes.append(again)
    wait_until(lambda: members(head).get(1) == "ready", 180, 0.1, "rank 1 back on the new node")
    assert pin(1).usage.completion_tokens == 2
    again.stop()

    # 4. a worker that disagrees on the max (the fingerprint) is refused as before
    wrong = Node(tmp_path, "wrong", "worker", demo_model_dir, str(key), rpc, "--headless", "--data-parallel-start-rank", "2",
                 "--data-parallel-size-max", "4")
    cluster_nodes.append(wrong)
    assert wrong.proc.wait(180) != 0
    assert "config fingerprint" in head.log() or "registration refused" in head.log()
    assert 2 not in members(head)


# ---------------------------------------------------------------- the rules, alone (no process)


def test_the_max_size_rules(tmp_path):
    from dpserve.daemons.config import ServeConfig

    (tmp_path / "config.json").write_text("{}")
    key = tmp_path / "dp.key"
    key.write_bytes(b"0123456789abcdef0123456789abcdef")

    def check(**kw) -> str:
        try:
            ServeConfig(model=str(tmp_path), served_model_name="m", key_file=str(key), **kw).validate()
        except ValueError as exc:
            return str(exc)
        return ""

    worker = dict(role="worker", headless=True, data_parallel_size=2, data_parallel_size_local=2, data_parallel_start_rank=2)
    assert check(**worker, data_parallel_size_max=4) == ""  # ranks 2-3 join a head started with 2
    assert "exceeds --data-parallel-size 2" in check(**worker)  # no max: nothing may join
    assert "exceeds --data-parallel-size-max 3" in check(**worker, data_parallel_size_max=3)
    assert "below --data-parallel-size" in check(**worker, data_parallel_size_max=1)
    assert check(role="head", data_parallel_size=2, data_parallel_size_max=8) == ""  # every starting rank here, more may join
    assert "is for `dpserve head`" in check(data_parallel_size=2, data_parallel_size_max=4)
    head = ServeConfig(model=str(tmp_path), served_model_name="m", role="head", data_parallel_size=2, data_parallel_size_max=8)
    assert head.is_multi_node and head.eligible_ranks() == list(range(8))


def test_membership_counts_only_members():
    from dpserve.daemons.supervisor.cluster import ClusterState
    from dpserve.engine.common.protocol import RankLoad

    c = ClusterState(2, 1.5, 0.0, size_max=4)
    assert (c.num_members, c.count("absent"), [r.rank for r in c.members]) == (2, 2, [0, 1])
    c.apply([RankLoad(0, "a", True), RankLoad(1, "b", True)], 1.0, 1.0)
    c.apply([RankLoad(3, "c", True)], 1.0, 1.0)  # joined
    assert (c.num_members, c.count("ready"), c.routable()) == (3, 3, 3)
    c.apply([RankLoad(3, "c", False, down_reason="retired (dpserve retire)")], 1.0, 1.0)
    c.apply([RankLoad(1, "b", False, down_reason="drained (dpserve drain)")], 1.0, 1.0)
    assert (c.num_members, c.count("ready"), c.count("drained"), [r.rank for r in c.members]) == (2, 1, 1, [0, 1])
    c.apply([RankLoad(3, "d", False, down_reason="registering")], 1.0, 1.0)  # a replacement
    assert (c.num_members, c.count("registered")) == (3, 1)
    assert c.counts == {s: sum(r.state == s for r in c.members) for s in c.counts}
