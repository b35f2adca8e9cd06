"""One tenant's limit held across a head and a worker in network namespaces: 4 API
servers on 2 nodes (global mode, 1 rank and 2 API servers a node) read one tenants
file; a request admitted on one node uses up the tenant's requests_per_s on every
API server of both nodes, within the coordinator's forwarding interval."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.multinode.test_multinode import API_PORT, Deployment, key_file, network  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

KEY_CAPPED = "sk-capped-dddddddddddd"
KEY_FREE = "sk-free-eeeeeeeeeeee"
TENANTS = f"""
[tenants.capped]
key = "{KEY_CAPPED}"
requests_per_s = 0.05

[tenants.free]
key = "{KEY_FREE}"
"""
# N completions, each on a fresh connection (spread over the node's API servers): their statuses
POSTS = """
import json, sys, urllib.error, urllib.request
url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = json.dumps({"model": "demo", "prompt": "hello", "max_tokens": 2}).encode()
codes = []
for _ in range(n):
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            codes.append(resp.status)
    except urllib.error.HTTPError as err:
        codes.append(err.code)
print(json.dumps(codes))
"""


class TwoSmallNodes(Deployment):
    """Deployment's head and worker with one rank each (DP 2), two API servers each."""

    def _cmd(self, role: str, node, extra: list[str]) -> list[str]:
        cmd = super()._cmd(role, node, extra)
        for flag, value in (("--data-parallel-size", "2"), ("--data-parallel-size-local", "1"), ("--data-parallel-start-rank", "1")):
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = value
        return cmd


def posts(node, url: str, key: str, n: int) -> list[int]:
    out = subprocess.run(["nsenter", "-t", str(node.sleeper.pid), "-n", "--", sys.executable, "-c", POSTS, url, key, str(n)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_one_limit_across_a_head_and_a_worker(network, demo_model_dir, key_file, tmp_path):  # noqa: F811
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    flags = ["--api-servers-on-every-node", "--api-server-count", "2", "--api-key-file", str(tenants), "--max-model-len", "64"]
    dep = TwoSmallNodes(network, demo_model_dir, key_file, tmp_path, flags, worker_headless=False)
    dep.start_head()
    dep.start_worker()
    dep.wait_ready(dep.head)
    dep.wait_ready(dep.worker)
    head, worker = dep.url(dep.head), dep.url(dep.worker)
    assert posts(dep.worker, worker, KEY_FREE, 4) == [200] * 4, dep.logs()
    assert posts(dep.head, head, KEY_CAPPED, 1) == [200]  # the one request the next 20 s allow
    time.sleep(1.0)  # every API server hears of it (reports every 0.25 s, through the head's coordinator)
    on_worker = posts(dep.worker, worker, KEY_CAPPED, 6)
    on_head = posts(dep.head, head, KEY_CAPPED, 6)
    assert on_worker == [429] * 6 and on_head == [429] * 6, (on_worker, on_head)
    metrics = dep.head.client("get", head + "/metrics")["body"]
    assert 'dpserve_tenant_cluster_requests_per_s{tenant="capped"}' in metrics
    assert KEY_CAPPED not in dep.logs() and KEY_FREE not in dep.logs()
