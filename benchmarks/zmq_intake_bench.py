#!/usr/bin/env python3
"""What a ZeroMQ ROUTER pays per small message arriving at a steady rate, without dpserve.

    python benchmarks/zmq_intake_bench.py [--rate 10240] [--peers 1024,64] [--seconds 3]

The coordinator's intake at 1,024 ranks reporting every 100 ms is ~10,000
small messages a second from 1,024 peers. This measures the floor under that:
a bare receiver (poll, wake at most every 2 ms like the coordinator, two
recv() a message, nothing else) while a sender process spreads `--rate`
70-byte messages a second evenly over `--peers` DEALER sockets. Printed:
messages received per second and the receiver process's CPU (its thread and
ZeroMQ's I/O thread) per message. Whether the same rate comes from many peers
or few tells whether the cost is per connection or per message.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from functools import partial

import zmq


def send(address: str, peers: int, rate: float, seconds: float) -> None:
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * peers + 64)
    socks = []
    for i in range(peers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"p{i}".encode())
        s.connect(address)
        socks.append(s)
    time.sleep(1.0)
    msg = b"x" * 70
    start, k = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        socks[k % peers].send(msg)
        k += 1
        wait = start + k / rate - time.monotonic()
        if wait > 0.0005:
            time.sleep(wait)
    ctx.destroy(linger=0)


def receive(address: str, peers: int, rate: float, seconds: float) -> tuple[float, float]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    sender = subprocess.Popen([sys.executable, __file__, "--send", address, "--peers", str(peers),
                               "--rate", str(rate), "--seconds", str(seconds + 3)])
    try:
        time.sleep(2.0)  # connections up, sending at its pace
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        recv, more = router.recv, partial(router.getsockopt, zmq.RCVMORE)
        end = time.monotonic() + seconds
        cpu0, n, last = time.process_time(), 0, 0.0
        while time.monotonic() < end:
            if not poller.poll(100):
                continue
            gap = 0.002 - (time.monotonic() - last)
            if gap > 0:
                time.sleep(gap)
            last = time.monotonic()
            while True:
                try:
                    recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if more():
                    recv(zmq.NOBLOCK)
                n += 1
        cpu = time.process_time() - cpu0
        return n / seconds, cpu / max(n, 1)
    finally:
        sender.kill()
        sender.wait(10)
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=10_240)
    ap.add_argument("--peers", default="1024,64")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--send", help=argparse.SUPPRESS)  # the sender process
    args = ap.parse_args(argv)
    if args.send:
        send(args.send, int(args.peers), args.rate, args.seconds)
        return 0
    print("| peers | messages/s received | receiver CPU | per message |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for peers in map(int, args.peers.split(",")):
            got, per = receive(f"ipc://{tmp}/intake-{peers}", peers, args.rate, args.seconds)
            print(f"| {peers:,} | {got:,.0f} | {100 * got * per:.1f}% of a core | {per * 1e6:.1f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
