"""Issue 25: a worker node joins a running head under load, takes traffic, and retires
under load; network-namespace nodes (tests/multinode/netns.py), every process stopped
by the fixtures.

The head starts with ranks 0-1 of at most 4 (--data-parallel-size 2
--data-parallel-size-max 4); a closed loop of short requests runs on the head's
port the whole time. A headless worker with ranks 2-3, which the head has never
seen, starts in its own namespace: its ranks must serve requests within 2 s of
the worker's readiness, with no head restart. Then `dpserve retire --node` on
the worker: its ranks leave routing and the head's membership, and not one
request of the loop fails across the join and the retirement.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.multinode.netns import CLIENT
from tests.multinode.test_multinode import HEALTH_PORT, Deployment, key_file, network  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

ELASTIC = ["--data-parallel-size", "2", "--data-parallel-size-max", "4"]  # the last of a repeated flag wins
LOOP_S = 75


def in_node(node, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(node.sleeper.pid), "-n", "--", *cmd], capture_output=True, text=True, timeout=timeout)


def test_a_worker_joins_under_load_and_retires_under_load(network, demo_model_dir, key_file, tmp_path):  # noqa: F811
    dep = Deployment(network, demo_model_dir, key_file, tmp_path, ELASTIC, worker_headless=True)
    head, worker = dep.head, dep.worker
    dep.start_head()
    dep.wait_ready(head)
    status = json.loads(head.client("get", f"http://{head.address}:{HEALTH_PORT}/status")["body"])
    assert (status["data_parallel_size"], status["data_parallel_size_max"]) == (2, 4), status
    loop = subprocess.Popen(
        ["nsenter", "-t", str(head.sleeper.pid), "-n", "--", sys.executable, CLIENT, "loop", dep.url(head), str(LOOP_S), "4"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(2.0)
        dep.start_worker()
        dep.wait_ready(worker)
        ready_wall = time.time()
        time.sleep(5.0)
        retire = in_node(worker, sys.executable, "-m", "dpserve.daemons.cli.main", "retire", "--node",
                         "--data-parallel-key-file", key_file, f"http://{worker.address}:{HEALTH_PORT}")
        retired_wall = time.time()
        assert retire.returncode == 0 and "rank 2: retiring" in retire.stdout, retire.stdout + retire.stderr
        deadline = time.monotonic() + 5
        while True:
            status = json.loads(head.client("get", f"http://{head.address}:{HEALTH_PORT}/status")["body"])
            if [r["rank"] for r in status["cluster"]["ranks"]] == [0, 1]:
                break
            assert time.monotonic() < deadline, status["cluster"]["ranks"]
            time.sleep(0.05)
        left_s = time.time() - retired_wall
        out, _ = loop.communicate(timeout=LOOP_S + 60)
    finally:
        if loop.poll() is None:
            loop.kill()
    result = json.loads(out)
    records = [(result["started_wall"] + start, result["started_wall"] + end, status, rank)
               for start, end, status, rank in result["records"]]
    failed = [r for r in records if r[2] != "200"]
    on_worker = [r for r in records if r[3] in ("2", "3")]
    assert on_worker, "the joined ranks never served"
    first = min(r[1] for r in on_worker) - ready_wall
    late = [r for r in on_worker if r[0] > retired_wall + 1.0]
    print(f"\n{len(records)} requests, {len(failed)} failed; the worker's ranks served {len(on_worker)}, the first"
          f" {first:.2f} s after its node was ready; retired out of the head's /status after {left_s:.2f} s")
    assert not failed, f"{failed[:10]}\n{dep.notable_logs()}"
    assert first <= 2.0, first
    assert not late, late[:5]  # routing: none sent to them later than 1 s after the retirement
    assert left_s < 3.0  # /status: each look here is a process started in the namespace (~0.5 s)
