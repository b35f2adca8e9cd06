"""--data-parallel-backend ray on a real two-node Ray cluster (tests/raycluster.py).

DP 2 with --ray-placement strict-spread puts one rank on each Ray node. The
node serves through the official openai client with pins to both ranks; a
killed rank actor is noticed, routed around and re-created; a stopped node
leaves no placement group, actor or reserved CPU on the cluster; and the
configuration errors are exit 2 naming what is missing, within bounded time.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from tests.raycluster import LOOPBACK_ENV, RayTestCluster
from tests.server import DpServer, free_port_run, wait_until

pytestmark = pytest.mark.slow

pytest.importorskip("ray", reason="the Ray backend's tests need Ray (pip install 'dpserve[ray]')")

_DETAIL = re.compile(r"ray node (\w+) \(([\d.]+)\), actor (\w+), pid (\d+)")


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayTestCluster(nodes=2).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def ray_server(model_dir: str, cluster: RayTestCluster, *args: str) -> DpServer:
    return DpServer(
        model_dir,
        "--data-parallel-backend", "ray",
        "--ray-address", cluster.address,
        "--data-parallel-rpc-port", str(free_port_run(5)),
        *args,
        env=dict(LOOPBACK_ENV),
    )


def rank_details(server: DpServer) -> dict[int, tuple[str, str, str, int]]:
    """rank -> (Ray node id, node ip, actor id, actor pid), from /status."""
    out = {}
    for child in server.status()["children"]:
        if child["kind"] == "engine" and child["state"] == "ready" and child.get("detail"):
            node, ip, actor, pid = _DETAIL.match(child["detail"]).groups()
            out[child["rank"]] = (node, ip, actor, int(pid))
    return out


@pytest.fixture(scope="module")
def ray_node(demo_model_dir, ray_cluster):
    server = ray_server(demo_model_dir, ray_cluster, "-dp", "2", "--ray-placement", "strict-spread",
                        "--dp-supervisor-probe-interval-s", "0.5", "--dp-supervisor-probe-timeout-s", "1")
    with server:
        yield server


def test_ranks_are_actors_on_distinct_ray_nodes_and_serve_pinned_requests(ray_node):
    details = rank_details(ray_node)
    assert sorted(details) == [0, 1]
    assert details[0][0] != details[1][0], f"strict-spread put both ranks on one Ray node: {details}"
    placement = ray_node.child("ray-placement")
    assert placement["state"] == "ready" and placement["detail"].startswith("dpserve-")
    with openai.OpenAI(base_url=ray_node.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        texts = []
        for rank in (0, 1):
            done = client.completions.create(model="demo", prompt="hello", max_tokens=6, temperature=0,
                                             extra_headers={"X-data-parallel-rank": str(rank)})
            assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
            texts.append(done.choices[0].text)
        assert texts[0] == texts[1], "the same greedy answer from both ranks"
        stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                                stream=True, extra_headers={"X-data-parallel-rank": "1"})
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(chunks)
    # each rank's count reaches the API servers' /metrics with its next load report
    wait_until(lambda: (f := ray_node.rank_finished()).get(0, 0) >= 1 and f.get(1, 0) >= 2, 10, 0.1, "both ranks' finished counts")


def test_a_killed_rank_actor_is_routed_around_and_recreated(ray_node):
    before = rank_details(ray_node)
    assert sorted(before) == [0, 1]
    old_actor, old_pid = before[1][2], before[1][3]
    stream: dict = {}
    streamer = threading.Thread(target=stream_request_pinned, args=(ray_node.port, stream, 1))
    streamer.start()
    wait_until(lambda: "started" in stream, 30, what="the stream on rank 1")
    killed_at = time.monotonic()
    subprocess.run(["kill", "-9", str(old_pid)], check=True)
    streamer.join(30)
    assert not streamer.is_alive()
    assert stream.get("error") or stream.get("exception"), f"the stream on the killed rank did not fail: {stream}"
    assert time.monotonic() - killed_at < 10, "the request in flight failed fast"
    # out of routing: unpinned requests keep being served meanwhile, by rank 0
    with openai.OpenAI(base_url=ray_node.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for _ in range(3):
            assert client.completions.create(model="demo", prompt="still", max_tokens=2).usage.completion_tokens == 2
    child = wait_until(lambda: (c := ray_node.child("engine-dp1"))["state"] == "ready" and c["restarts"] >= 1 and c,
                       120, 0.2, "rank 1 re-created")
    after = rank_details(ray_node)
    assert after[1][2] != old_actor and after[1][3] != old_pid, "a new actor"
    assert after[1][0] != after[0][0], "re-created in its own bundle, still on the other node"
    assert "Ray actor died" in ray_node.log()
    with openai.OpenAI(base_url=ray_node.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        done = wait_until(lambda: _try_pinned(client, 1), 60, 0.2, "rank 1 serving again")
    assert done.usage.completion_tokens == 3
    assert child["restarts"] >= 1


def test_a_lost_ray_node_is_detected_and_its_rank_recreated_on_a_new_node(ray_node, ray_cluster):
    before = rank_details(ray_node)
    workers = {n.node_id for n in ray_cluster.cluster.worker_nodes}
    rank = next(r for r, d in before.items() if any(w.startswith(d[0]) for w in workers))
    other = 1 - rank
    restarts = ray_node.child(f"engine-dp{rank}")["restarts"]
    lost_at = time.monotonic()
    ray_cluster.replace_node(before[rank][0])  # its raylet and the actor's worker are SIGKILLed; a fresh node joins
    # detected and out of routing well before Ray's own node health check gives up on it
    wait_until(lambda: ray_node.child(f"engine-dp{rank}")["state"] != "ready", 20, 0.1, f"rank {rank} out of service")
    with openai.OpenAI(base_url=ray_node.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert client.completions.create(model="demo", prompt="meanwhile", max_tokens=2).usage.completion_tokens == 2
        assert _try_pinned(client, other) is not None
    wait_until(lambda: (c := ray_node.child(f"engine-dp{rank}"))["state"] == "ready" and c["restarts"] > restarts, 120, 0.2,
               f"rank {rank} re-created")
    after = rank_details(ray_node)
    assert after[rank][0] not in (before[rank][0], before[other][0]), "re-created on the node that replaced the lost one"
    with openai.OpenAI(base_url=ray_node.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        wait_until(lambda: _try_pinned(client, rank), 60, 0.2, f"rank {rank} serving again")
    print(f"lost node: rank {rank} serving again after {time.monotonic() - lost_at:.1f} s")


def stream_request_pinned(port: int, result: dict, rank: int) -> None:
    import json
    import urllib.request

    body = json.dumps({"model": "demo", "prompt": "long", "max_tokens": 1900, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    result.setdefault("started", time.monotonic())
                    if "error" in event:
                        result["error"] = event["error"]
                elif line == "data: [DONE]":
                    result["done"] = True
    except Exception as exc:  # recorded for the assertion
        result["exception"] = repr(exc)


def _try_pinned(client, rank: int):
    try:
        return client.completions.create(model="demo", prompt="back", max_tokens=3, extra_headers={"X-data-parallel-rank": str(rank)})
    except openai.APIStatusError:
        return None


def test_stopping_the_node_leaves_nothing_on_the_cluster(ray_node, ray_cluster):
    server = ray_node  # the module's node, stopped here: the tests after this one need the cluster free
    assert sorted(rank_details(server)) == [0, 1]
    busy = ray_cluster.leftovers()
    assert len(busy["groups"]) == 1 and len(busy["actors"]) == 2 and busy["free_cpus"] == 0, busy
    code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
    log = server.log()
    assert "SIGTERM received" not in log, "Ray's own signal handler took over a child's stop"
    assert len(re.findall(r"rank actor stopped .*engine_exit_code=0", log)) == 2, "both engines stopped themselves before their actors went"
    left = ray_cluster.wait_clean()
    assert left == {"groups": {}, "actors": [], "free_cpus": 2.0}, left


def run_serve(demo_model_dir: str, *args: str, timeout: float = 90) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "dpserve.daemons.cli.main", "serve", demo_model_dir, "--port", "0", "--data-parallel-supervisor-port", "0",
         "--data-parallel-backend", "ray", *args],
        capture_output=True, text=True, timeout=timeout, env={**__import__("os").environ, **LOOPBACK_ENV},
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_an_unreachable_ray_address_is_exit_2_within_the_connect_timeout(demo_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens on it once closed
    code, out, took = run_serve(demo_model_dir, "--ray-address", f"127.0.0.1:{dead}", "--ray-connect-timeout-s", "3")
    assert code == 2, out
    assert f"cannot reach the Ray cluster at 127.0.0.1:{dead}" in out
    assert took < 30


def test_too_few_nodes_for_strict_spread_is_exit_2_naming_them(demo_model_dir, ray_cluster):
    code, out, _ = run_serve(demo_model_dir, "--ray-address", ray_cluster.address, "-dp", "3", "--ray-placement", "strict-spread")
    assert code == 2, out
    assert "strict-spread needs 3 nodes" in out and "2 can" in out


def test_missing_gpus_are_exit_2_naming_the_resource(demo_model_dir, ray_cluster):
    code, out, _ = run_serve(demo_model_dir, "--ray-address", ray_cluster.address, "-dp", "2", "--ray-gpus-per-rank", "1")
    assert code == 2, out
    assert "GPU: needs 2, the cluster has 0" in out
    assert ray_cluster.wait_clean()["groups"] == {}, "a refused start reserved nothing"
