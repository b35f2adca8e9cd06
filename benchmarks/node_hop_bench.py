"""What one data connection per node would cost the data path (issue 30, fourth round).

Today each rank holds a DEALER to every API server (32 API servers x 4,096 ranks:
131,072 ZeroMQ connections on a head, ~28 KiB each). The design in RESULTS (issue
30, fourth round) puts a hop on each node: its ranks connect to a node-local ROUTER,
and a ZeroMQ proxy (C, no GIL) forwards to a DEALER per API server, so an API server
holds one connection per node and sees [node, rank, message]. This measures that hop
alone, on ipc, against the direct path: the round trip of one small message (an
AddRequest's way in and a first token's way out) and, at a steady stream of outputs,
the proxy thread's CPU per message and the API side's. No dpserve process runs here:
plain sockets, the same socket types and frames.

    .venv/bin/python benchmarks/node_hop_bench.py [--ranks 8] [--round-trips 2000] [--rate 8000] [--seconds 3]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402

from benchmarks.common import begin, parser  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def node(api_address: str, local: str, hop: bool, ranks: int, rate: float, seconds: float, out) -> None:
    """The node's side: `ranks` DEALERs (directly to the API server, or to the local
    ROUTER whose proxy thread forwards), answering pings, then streaming outputs."""
    ctx = zmq.Context()
    tid = []
    if hop:
        front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        front.bind(local)
        back.setsockopt(zmq.IDENTITY, b"node-0")
        back.connect(api_address)

        def proxy() -> None:
            tid.append(threading.get_native_id())
            try:
                zmq.proxy(front, back)
            except zmq.ZMQError:
                pass  # the context ended under it (the run is over)

        threading.Thread(target=proxy, daemon=True).start()
    socks = []
    for r in range(ranks):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"{r}:inc".encode())
        s.connect(local if hop else api_address)
        socks.append(s)
    for s in socks:
        s.send(b"hello")
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    while True:  # 1. pings, answered by the rank they reached, until the API side says "stream"
        ready = dict(poller.poll(10_000))
        if not ready:
            break
        stop = False
        for s in ready:
            msg = s.recv()
            if msg == b"stream":
                stop = True
            else:
                s.send(msg)
        if stop:
            break
    # 2. a steady stream of outputs (~200 B, an EngineOutputs of a few tokens), all ranks in turn
    payload = b"o" * 200
    cpu0 = thread_cpu_s(tid[0]) if tid else 0.0
    t0, n = time.monotonic(), 0
    while (now := time.monotonic()) - t0 < seconds:
        due = int((now - t0) * rate)
        while n < due:
            socks[n % ranks].send(payload)
            n += 1
        time.sleep(0.001)
    for s in socks:
        s.send(b"end")
    time.sleep(0.5)
    out.put({"sent": n, "proxy_cpu_s": (thread_cpu_s(tid[0]) - cpu0) if tid else 0.0})
    ctx.destroy(linger=0)


def api(address: str, hop: bool, ranks: int, round_trips: int) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    routes = {}
    while len(routes) < ranks:  # hellos: [rank] direct, [node, rank] through the hop
        frames = sock.recv_multipart()
        routes[frames[-2]] = frames[:-1]
    order = sorted(routes)
    rtt = []
    for i in range(round_trips):
        route = routes[order[i % ranks]]
        t = time.perf_counter()
        sock.send_multipart([*route, b"ping"])
        sock.recv_multipart()
        rtt.append((time.perf_counter() - t) * 1e6)
    for route in routes.values():
        sock.send_multipart([*route, b"stream"])
    cpu0, got, ended = time.process_time(), 0, 0
    while ended < ranks:
        if sock.recv_multipart()[-1] == b"end":
            ended += 1
        else:
            got += 1
    cpu = time.process_time() - cpu0
    ctx.destroy(linger=0)
    rtt.sort()
    return {"rtt_p50_us": rtt[len(rtt) // 2], "rtt_p99_us": rtt[int(len(rtt) * 0.99)], "received": got, "api_cpu_s": cpu}


def run(hop: bool, args, tmp: str) -> dict:
    address, local = f"ipc://{tmp}/api-{hop}", f"ipc://{tmp}/node-{hop}"
    out = mp.Queue()
    proc = mp.Process(target=node, args=(address, local, hop, args.ranks, args.rate, args.seconds, out), daemon=True)
    proc.start()
    try:
        res = api(address, hop, args.ranks, args.round_trips)
        res.update(out.get(timeout=30))
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    n = max(1, res["received"])
    return {"path": "node hop" if hop else "direct", "rtt_p50_us": round(res["rtt_p50_us"], 1),
            "rtt_p99_us": round(res["rtt_p99_us"], 1), "messages_per_s": round(n / args.seconds),
            "proxy_us_per_msg": round(1e6 * res["proxy_cpu_s"] / n, 2), "api_us_per_msg": round(1e6 * res["api_cpu_s"] / n, 2),
            "loadavg": Path("/proc/loadavg").read_text().split()[0]}


def main(argv=None) -> int:
    p = parser(__doc__, json=True)
    p.add_argument("--ranks", type=int, default=8, help="ranks on the node")
    p.add_argument("--round-trips", type=int, default=2000)
    p.add_argument("--rate", type=float, default=8000.0, help="output messages a second from the node, all ranks together")
    p.add_argument("--seconds", type=float, default=3.0)
    args, _ = begin(p, argv)
    with tempfile.TemporaryDirectory(prefix="hop-") as tmp:
        rows = [run(hop, args, tmp) for hop in (False, True, False, True)]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
