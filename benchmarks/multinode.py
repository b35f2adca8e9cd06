"""Multi-node figures on network-namespace nodes (root only): 2 nodes x 2 ranks.

Prints, for internal and global load balancing: the time for the worker to
register (head ready with 4/4 ranks after the worker starts), req/s at
max_tokens=1 through the head, and in global mode also through both nodes at
once. Every request goes to the project's own namespaces (10.77.0.x), never
elsewhere; processes and namespaces are removed at the end.

  sudo .venv/bin/python benchmarks/multinode.py [--duration 10] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.multinode.netns import Network, available  # noqa: E402
from tests.multinode.test_multinode import API_PORT, Deployment  # noqa: E402

LOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "load.py")


def load_inside(node, url: str, duration: float, concurrency: int) -> dict:
    # --allow-remote: the target is this harness's own namespace address, not a remote host
    cmd = [
        "nsenter", "-t", str(node.sleeper.pid), "-n", "--", sys.executable, LOAD,
        "--url", url, "--model", "demo", "--max-tokens", "1", "--concurrency", str(concurrency),
        "--duration", str(duration), "--warmup", "2", "--json", "--allow-remote",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


def run_mode(model_dir: str, key_file: str, mode: str, args) -> dict:
    flags = {"internal": [], "global": ["--api-servers-on-every-node"]}[mode]
    net = Network()
    tmp = tempfile.mkdtemp(prefix=f"dpserve-mn-{mode}-")
    from pathlib import Path

    try:
        dep = Deployment(net, model_dir, key_file, Path(tmp), flags, worker_headless=(mode == "internal"))
        dep.start_head()
        dep.start_worker()
        t0 = time.monotonic()
        dep.wait_ready(dep.worker)
        worker_ready = time.monotonic() - t0
        dep.wait_ready(dep.head)
        register = time.monotonic() - t0
        result = {"mode": mode, "worker_ready_s": round(worker_ready, 1), "all_ranks_registered_s": round(register, 1)}
        head_url = f"http://{dep.head.address}:{API_PORT}"
        result["head_only"] = load_inside(dep.head, head_url, args.duration, args.concurrency)
        if mode == "global":
            # both nodes' frontends at once, half the clients each
            procs = []
            for node in (dep.head, dep.worker):
                url = f"http://{node.address}:{API_PORT}"
                cmd = [
                    "nsenter", "-t", str(node.sleeper.pid), "-n", "--", sys.executable, LOAD,
                    "--url", url, "--model", "demo", "--max-tokens", "1", "--concurrency", str(args.concurrency // 2),
                    "--duration", str(args.duration), "--warmup", "2", "--json", "--allow-remote",
                ]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
            both = [json.loads(p.communicate(timeout=args.duration + 120)[0]) for p in procs]
            result["both_nodes_req_s"] = round(sum(b["req_per_s"] for b in both), 1)
            result["both_nodes_errors"] = sum(b["error_count"] for b in both)
        return result
    finally:
        net.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model", default="", help="model dir (default: build the demo model)")
    args = parser.parse_args()
    reason = available()
    if reason:
        print(f"skipped: {reason}")
        return
    model = args.model
    if not model:
        model = os.path.join(tempfile.mkdtemp(prefix="dpserve-mn-model-"), "demo")
        subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "demo-model", model], check=True, capture_output=True)
    key = os.path.join(tempfile.mkdtemp(prefix="dpserve-mn-key-"), "dp.key")
    with open(key, "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(key, 0o600)
    rows = [run_mode(model, key, mode, args) for mode in ("internal", "global")]
    print(f"{'mode':<10} {'worker ready':>13} {'4/4 registered':>15} {'req/s via head':>15} {'req/s via both':>15}")
    for r in rows:
        both = f"{r['both_nodes_req_s']:.0f}" if "both_nodes_req_s" in r else "-"
        print(f"{r['mode']:<10} {r['worker_ready_s']:>12.1f}s {r['all_ranks_registered_s']:>14.1f}s "
              f"{r['head_only']['req_per_s']:>15.0f} {both:>15}")
    print(json.dumps(rows, default=str)[:4000] if os.environ.get("DPSERVE_BENCH_JSON") else "")


if __name__ == "__main__":
    main()
