"""When does a node's table relay pay? (issue 30, second round)

The head's load table goes to every subscriber of a node: its API servers and its
supervisor. Direct, the head's PUB socket sends each message once per subscriber;
through the node's table relay (daemons/coordinator/table_relay.py, on a thread of
the supervisor), once per node, and the relay re-sends it locally. This measures
the publisher's CPU and the relay's, per message, for 1..N subscribers on ipc, so
that `serve`'s threshold (supervisor/relays.py TABLE_RELAY_MIN_SUBSCRIBERS) rests
on a figure. Process CPU time, not wall clock; the subscribers' cost is the same
either way and is not counted.

    .venv/bin/python benchmarks/table_relay_bench.py [--messages 4000] [--rate 2000] [--size 1500]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zmq  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _subscribers(address: str, n: int, total: int, heard, done) -> None:
    ctx = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.connect(address)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    got, warm = [0] * n, [False] * n
    deadline = time.monotonic() + 120
    while min(got) < total and time.monotonic() < deadline:
        for s, _ in poller.poll(200):
            i = socks.index(s)
            while True:
                try:
                    data = s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if data == b"warm":
                    warm[i] = True
                    if all(warm):
                        heard.set()  # every subscription reached the publisher
                else:
                    got[i] += 1
    done.put(min(got))
    ctx.destroy(linger=0)


def _relay(upstream: str, bind: str, out) -> None:
    import signal
    import threading

    from dpserve.daemons.coordinator.table_relay import relay

    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGUSR1])  # for sigwait, in every thread
    ctx = zmq.Context()
    t = threading.Thread(target=relay, args=(ctx, upstream, bind), daemon=True)
    t.start()
    signal.sigwait([signal.SIGUSR1])  # the measured part starts
    cpu0 = _cpu_s()
    signal.sigwait([signal.SIGTERM])
    out.put(_cpu_s() - cpu0)
    out.close()
    out.join_thread()  # the value must leave before the process does
    os._exit(0)


def run_one(n: int, via_relay: bool, messages: int, rate: float, size: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="tablerelay-")
    head, local = f"ipc://{tmp}/head", f"ipc://{tmp}/node"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(head)
    q, heard = mp.Queue(), mp.Event()
    relay = None
    if via_relay:
        relay = mp.Process(target=_relay, args=(head, local, q), daemon=True)
        relay.start()
    subs = mp.Process(target=_subscribers, args=(local if via_relay else head, n, messages, heard, q), daemon=True)
    subs.start()
    body = b"x" * size
    t_end = time.monotonic() + 30
    while not heard.is_set() and time.monotonic() < t_end:  # until every subscription reached the publisher
        pub.send(b"warm")
        time.sleep(0.02)
    if relay is not None:
        os.kill(relay.pid, 10)  # SIGUSR1: the relay starts counting
    cpu0 = _cpu_s()
    period, t = 1 / rate, time.monotonic()
    for _ in range(messages):
        pub.send(body)
        t += period
        if (delay := t - time.monotonic()) > 0:
            time.sleep(delay)
    pub_cpu = _cpu_s() - cpu0
    received = q.get(timeout=120)
    relay_cpu = 0.0
    if relay is not None:
        os.kill(relay.pid, 15)
        relay_cpu = q.get(timeout=10)
        relay.join(5)
    subs.join(5)
    ctx.destroy(linger=0)
    return {"subscribers": n, "via_relay": via_relay, "received": received,
            "publisher_us_per_msg": round(pub_cpu / messages * 1e6, 2), "relay_us_per_msg": round(relay_cpu / messages * 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=4000)
    ap.add_argument("--rate", type=float, default=2000.0, help="messages a second (the head's publishes)")
    ap.add_argument("--size", type=int, default=1500, help="bytes a message (a LoadDelta of ~100 rows)")
    ap.add_argument("--subscribers", default="1,2,4,8,16")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for n in [int(x) for x in args.subscribers.split(",")]:
        for via in (False, True):
            rows.append(run_one(n, via, args.messages, args.rate, args.size))
            if not args.json:
                print(rows[-1], flush=True)
    out = {"loadavg": open("/proc/loadavg").read().split()[:3], "runs": rows}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
