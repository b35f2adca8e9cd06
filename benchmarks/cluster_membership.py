"""Part 3 of benchmarks/cluster_bench.py: simulated ranks join a running cluster under
load, then retire under it (issue 25's membership), on benchmarks/simcluster.py.
Figures are returned, never asserted; every process is stopped at the end."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.engine.common.codec import Codec  # noqa: E402
from dpserve.engine.common.protocol import LoadTable, TableChannel  # noqa: E402

from benchmarks.load import LoadConfig, run_load  # noqa: E402
from benchmarks.simcluster import SimCluster  # noqa: E402


class GrowingCluster(SimCluster):
    """A cluster of `num_ranks` slots (the head's --data-parallel-size-max) that starts
    with the first `start_with` ranks; the others join later through start_sim()."""

    def __init__(self, *args, start_with: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.start_with = start_with
        self.holding = True

    def start_sim(self, first: int, last: int) -> str:
        if self.holding and first >= self.start_with:
            return ""
        return super().start_sim(first, last)


def part_membership(args) -> dict:
    """4 simulated ranks join a running 4-rank cluster under load, then retire under load
    (SIGTERM: they announce their death, their requests move; then their supervisor's
    RankDown 'retired' takes them out of the membership)."""
    from dpserve.engine.common.protocol import CoordinatorInput, RankDown

    n, half = 8, 4
    cluster = GrowingCluster(n, 4, half, start_with=half, report_interval_s=args.report_interval_s, stale_after_s=args.stale_after_s)
    out: dict = {"ranks_before": half, "ranks_joining": n - half, "api_servers": 4}
    with cluster:
        cluster.wait_routable(half, timeout=120)
        cluster.holding = False
        cfg = LoadConfig(url=f"http://127.0.0.1:{cluster.port}", model="sim", concurrency=32, duration=14.0, max_tokens=64, stream=True)
        result: dict = {}
        load = threading.Thread(target=lambda: result.setdefault("r", asyncio.run(run_load(cfg))), daemon=True)
        load.start()
        time.sleep(2.0)
        joined = threading.Event()
        alive_at: list[float] = []
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(cluster.table_address)
        codec, alive = Codec(TableChannel), set()

        def watch() -> None:  # when the joining ranks are ready (alive in the coordinator's table)
            while not joined.is_set():
                if sub.poll(50):
                    table = codec.decode_or_none(sub.recv())
                    if type(table) is LoadTable:
                        alive.update(e.rank for e in table.ranks if e.is_alive and e.rank >= half)
                        if len(alive) == n - half and not alive_at:
                            alive_at.append(time.monotonic())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        name = cluster.start_sim(half, n - 1)
        cluster.wait_routable(n, timeout=60, interval=0.02)
        routable_at = time.monotonic()
        joined.set()
        watcher.join(5)
        sub.close(0)
        out["join_routable_after_ready_s"] = routable_at - alive_at[0] if alive_at else float("nan")
        out["join_routable_after_start_s"] = routable_at - t0
        time.sleep(4.0)
        t1 = time.monotonic()
        cluster.kill(name, signal.SIGTERM)
        link = zmq.Context.instance().socket(zmq.DEALER)
        link.setsockopt(zmq.IDENTITY, b"supervisor-4")
        link.setsockopt(zmq.LINGER, 1000)
        link.connect(cluster.coordinator_address)
        wire = Codec(CoordinatorInput)
        for rank in range(half, n):
            link.send(wire.encode(RankDown(rank, "retired (dpserve retire)")))
        link.close()
        cluster.wait_routable(half, timeout=30, interval=0.02)
        out["retire_out_of_routing_s"] = time.monotonic() - t1
        load.join(60)
    res = result["r"]
    out.update(ok=res.ok, errors=sum(res.errors.values()), error_kinds=dict(res.errors), ranks_used=len(res.per_rank))
    return out


if __name__ == "__main__":
    # Run as a script: cluster_bench.py's membership part alone (same options).
    from benchmarks.cluster_bench import main

    sys.exit(main(["--skip", "cluster,coordinator,memory", *sys.argv[1:]]))
