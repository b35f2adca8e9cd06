"""Ray backend vs native multi-node, on the same two nodes, in one run.

The two nodes are a Ray cluster of two nodes on loopback (tests/raycluster.py:
a head and a second node, 1 CPU each), left running for the whole run, as a
user's cluster would be. Each round starts, measures and stops:

- native: `dpserve head` (rank 0, 2 API servers) + `dpserve worker --headless`
  (rank 1), authenticated TCP on 127.0.0.1, ready = the head's /readyz after
  both were spawned;
- ray: `dpserve serve --data-parallel-backend ray` (DP 2, 2 API servers, ranks
  as actors spread over the two Ray nodes), ready = its /readyz after spawn.

Then req/s at max_tokens=1 with 128 clients (non-streamed completions)
through the node's port. The order alternates between rounds; ratios are
ray / native within the run. Issue 17's targets: ready within 1.5x, req/s
within 10% (Ray must not sit on the request path).

  .venv/bin/python benchmarks/ray_bench.py [--rounds 2] [--duration 10] [--concurrency 128]
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import begin, ensure_demo_model, fmt, load_average, machine_info, parser, ratio, render  # noqa: E402
from benchmarks.load import LoadConfig  # noqa: E402
from benchmarks.nodes import SERVED_MODEL, DpNode, Server, measure_sync  # noqa: E402
from tests.raycluster import LOOPBACK_ENV, RayTestCluster  # noqa: E402
from tests.server import free_port_run  # noqa: E402

# One torch thread per rank on both sides, as the Ray side's 1-CPU bundles give
# (natively a headless worker's rank would take both cores of its node).
SAME_THREADS = {"OMP_NUM_THREADS": "1"}


class HeadNode(DpNode):
    """`dpserve head`: rank 0 of 2 on this node, the coordinator and the API servers."""

    def __init__(self, model_dir: str, key_file: str, rpc_port: int, api: int) -> None:
        super().__init__(model_dir, dp=2, api=api, env=dict(SAME_THREADS))
        self.key_file, self.rpc_port = key_file, rpc_port
        self.label = f"native head+worker api{api}"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("serve")] = "head"
        return cmd + ["--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
                      "--data-parallel-rpc-port", str(self.rpc_port), "--data-parallel-key-file", self.key_file]


class WorkerNode(Server):
    """`dpserve worker --headless`: rank 1, connecting to the head on loopback."""

    name = "dpserve-worker"

    def __init__(self, model_dir: str, key_file: str, rpc_port: int) -> None:
        super().__init__(env=dict(SAME_THREADS))
        self.model_dir, self.key_file, self.rpc_port = model_dir, key_file, rpc_port

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dpserve.daemons.cli.main", "worker", self.model_dir, "--headless",
                "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
                "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(self.rpc_port),
                "--data-parallel-key-file", self.key_file, "--data-parallel-supervisor-port", "0",
                "--run-dir", os.path.join(self.tmp, "run")]

    def is_ready(self) -> bool:
        return True  # the head's readiness covers the worker's rank

    def api_processes(self):
        return []


def run_native(model_dir: str, key_file: str, load: LoadConfig, api: int) -> tuple[float, object]:
    rpc = free_port_run(5)
    head = HeadNode(model_dir, key_file, rpc, api)
    worker = WorkerNode(model_dir, key_file, rpc)
    try:
        head.spawn()
        worker.spawn()
        ready = head.wait_ready(300)
        load.url = head.url
        return ready, measure_sync(head, load, head.label)
    finally:
        head.stop()
        worker.stop()


def run_ray(model_dir: str, cluster: RayTestCluster, load: LoadConfig, api: int) -> tuple[float, object]:
    node = DpNode(model_dir, dp=2, api=api, env=dict(LOOPBACK_ENV),
                  extra=["--data-parallel-backend", "ray", "--ray-address", cluster.address, "--data-parallel-rpc-port", str(free_port_run(5))])
    node.label = f"ray backend api{api}"
    try:
        node.spawn()
        ready = node.wait_ready(300)
        load.url = node.url
        return ready, measure_sync(node, load, node.label)
    finally:
        node.stop()
        cluster.wait_clean(30)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--api-server-count", type=int, default=2)
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    args, _ = begin(ap, None)
    model_dir = args.model or ensure_demo_model()
    tmp = tempfile.mkdtemp(prefix="ray-bench-")
    key_file = os.path.join(tmp, "dp.key")
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    print(f"# {machine_info()}")
    t0 = time.monotonic()
    cluster = RayTestCluster(nodes=2).start()
    print(f"# Ray cluster of 2 nodes up in {time.monotonic() - t0:.1f} s at {cluster.address} (left running for every round)")
    rows, ratios_ready, ratios_rps = [], [], []
    try:
        for rnd in range(args.rounds):
            order = ("native", "ray") if rnd % 2 == 0 else ("ray", "native")
            got = {}
            for kind in order:
                load = LoadConfig(model=SERVED_MODEL, concurrency=args.concurrency, duration=args.duration, warmup=args.warmup, max_tokens=1)
                if kind == "native":
                    got[kind] = run_native(model_dir, key_file, load, args.api_server_count)
                else:
                    got[kind] = run_ray(model_dir, cluster, load, args.api_server_count)
            for kind in ("native", "ray"):
                ready, m = got[kind]
                r = m.result
                rows.append([str(rnd + 1), m.label, fmt(ready, 2), fmt(r.req_per_s), str(sum(r.errors.values())), fmt(m.api_cpu_us_per_req, 0), m.loadavg])
            ratios_ready.append(ratio(got["ray"][0], got["native"][0]))
            ratios_rps.append(ratio(got["ray"][1].result.req_per_s, got["native"][1].result.req_per_s))
    finally:
        cluster.stop()
    print(render(["round", "mode", "ready s", "req/s", "errors", "API us/req", "loadavg"], rows))
    print()
    print("ray / native, per round: ready " + ", ".join(fmt(x, 2) + "x" for x in ratios_ready)
          + "; req/s " + ", ".join(fmt(x, 2) + "x" for x in ratios_rps))
    print(f"# targets: ready <= 1.5x, req/s >= 0.90x; load average at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
