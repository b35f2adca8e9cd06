"""A real Ray cluster of two nodes on loopback, for the Ray backend's tests and benchmark.

Ray's own multi-node test utility (ray.cluster_utils.Cluster) starts a head
(GCS + raylet) and a second raylet, each with its own resources (1 CPU), no
dashboard and a small object store, so Ray stays within this machine's two
cores. Ray would advertise the machine's network address; with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 every node, driver and worker uses
127.0.0.1 instead, so nothing leaves loopback. Every process the cluster
started is killed on exit, even when Ray's own shutdown fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
NODE_ARGS = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}


class RayTestCluster:
    def __init__(self, nodes: int = 2, cpus_per_node: int = 1) -> None:
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.cluster = None
        self.address = ""
        self.pids: set[int] = set()
        self._saved_env: dict[str, str | None] = {}

    def start(self) -> RayTestCluster:
        for key, value in LOOPBACK_ENV.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value  # the nodes inherit it, and so do the dpserve nodes the tests start
        from ray.cluster_utils import Cluster

        args = dict(NODE_ARGS, num_cpus=self.cpus_per_node)
        self.cluster = Cluster(initialize_head=True, head_node_args=args)
        for _ in range(self.nodes - 1):
            self.cluster.add_node(**args)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address
        self.pids = {p.pid for p in psutil.Process().children(recursive=True)}
        return self

    def stop(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.shutdown()
        finally:
            # Ray's workers are the raylets' children; take whatever is left of the tree.
            for pid in list(self.pids):
                try:
                    for p in psutil.Process(pid).children(recursive=True):
                        self.pids.add(p.pid)
                except psutil.Error:
                    pass
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def replace_node(self, node_id_prefix: str, graceful: bool = False) -> None:
        """Lose the (non-head) Ray node whose id starts with the prefix (its raylet
        and workers killed), and add a fresh node with the same resources."""
        victim = next(n for n in self.cluster.worker_nodes if n.node_id.startswith(node_id_prefix))
        self.cluster.remove_node(victim, allow_graceful=graceful)
        self.cluster.add_node(**dict(NODE_ARGS, num_cpus=self.cpus_per_node))
        self.cluster.wait_for_nodes()
        self.pids |= {p.pid for p in psutil.Process().children(recursive=True)}

    def driver(self, script: str, timeout: float = 60) -> str:
        """Run a short Ray driver script against the cluster in a process of its
        own (`ray` and `address` are defined for it); returns its stdout."""
        prelude = (
            "import ray, sys\n"
            f"address = {self.address!r}\n"
            "ray.init(address=address, namespace='dpserve', log_to_driver=False, logging_level='ERROR')\n"
        )
        done = subprocess.run([sys.executable, "-c", prelude + script], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **LOOPBACK_ENV})
        if done.returncode != 0:
            raise RuntimeError(f"ray driver failed ({done.returncode}): {done.stderr[-3000:]}")
        return done.stdout

    def leftovers(self) -> dict:
        """dpserve's placement groups that are not removed, and actors that are not dead, and free CPUs."""
        out = self.driver(
            "import json\n"
            "from ray._private import state\n"
            "groups = {v['name']: v['state'] for v in ray.util.placement_group_table().values() if v['name'].startswith('dpserve-')}\n"
            "actors = [a['ActorID'] for a in state.actors().values() if a['State'] != 'DEAD']\n"
            "print(json.dumps({'groups': {k: v for k, v in groups.items() if v != 'REMOVED'}, 'actors': actors,"
            " 'free_cpus': ray.available_resources().get('CPU', 0)}))\n"
        )
        import json

        return json.loads(out.strip().splitlines()[-1])

    def wait_clean(self, timeout: float = 30) -> dict:
        """Leftovers once Ray has finished cleaning up (it removes a job's groups and actors asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.leftovers()
            if (not state["groups"] and not state["actors"] and state["free_cpus"] >= self.nodes * self.cpus_per_node) or time.monotonic() > deadline:
                return state
            time.sleep(0.5)
