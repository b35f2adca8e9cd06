"""What one rank's connection costs an API server in memory (issue 30, second round).

An API server's engine socket is a ROUTER that every rank connects a DEALER to. This
opens N such connections (the ranks in a second process), has each say hello and
get an answer, as a rank and an API server do, and reports the ROUTER process's RSS
growth per connection, for libzmq's defaults and for the socket options that could
cut it: smaller kernel buffers (SNDBUF/RCVBUF: kernel memory, not RSS, measured to
show it), HWMs (queues grow on demand), and ZMQ_IN/OUT_BATCH_SIZE (draft options:
this libzmq may refuse them, which is reported). Linux only (reads /proc).

    .venv/bin/python benchmarks/zmq_conn_cost.py [--connections 1024]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import zmq

OPTIONS = {
    "defaults": {},
    "kernel buffers 16 KiB": {"SNDBUF": 16384, "RCVBUF": 16384},
    "hwm 100": {"SNDHWM": 100, "RCVHWM": 100},
    "batch 1 KiB (draft)": {"IN_BATCH_SIZE": 1024, "OUT_BATCH_SIZE": 1024},
}


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _ranks(address: str, n: int, go, done) -> None:
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    socks = []
    for i in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"{i}:inc".encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        s.send(b"hello" * 8)
        socks.append(s)
    go.wait(60)
    for s in socks:
        s.poll(5000)
        s.recv(zmq.NOBLOCK)
    done.set()
    time.sleep(60)


def measure(n: int, opts: dict) -> dict:
    tmp = tempfile.mkdtemp(prefix="zconn-")
    address = f"ipc://{tmp}/engines"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    refused = []
    for name, value in opts.items():
        try:
            router.setsockopt(getattr(zmq, name), value)
        except zmq.ZMQError as exc:
            refused.append(f"{name}: {exc}")
    router.setsockopt(zmq.BACKLOG, 4096)
    router.bind(address)
    time.sleep(0.2)
    before = _rss_kib()
    go, done = mp.Event(), mp.Event()
    p = mp.Process(target=_ranks, args=(address, n, go, done), daemon=True)
    p.start()
    got, deadline = 0, time.monotonic() + 120
    while got < n and time.monotonic() < deadline:
        if router.poll(1000):
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, b"welcome" * 8])
            got += 1
    go.set()
    done.wait(60)
    time.sleep(0.3)
    grown = _rss_kib() - before
    p.kill()
    p.join(5)
    ctx.destroy(linger=0)
    return {"connections": got, "rss_growth_mib": round(grown / 1024, 1), "kib_per_connection": round(grown / max(got, 1), 1),
            "refused": refused}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = {}
    for label, opts in OPTIONS.items():
        rows[label] = measure(args.connections, opts)
        if not args.json:
            print(label, rows[label], flush=True)
    out = {"zmq": zmq.zmq_version(), "draft_api": zmq.has("draft"), "loadavg": os.getloadavg(), "runs": rows}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
