"""A node's relay of the coordinator's load table (issue 30; `serve` runs it on a
thread of the supervisor when the node has enough API servers, supervisor/relays.py):
one subscription to the head, re-published on a local socket that the node's API
servers subscribe to instead, so the head sends each table once per node, not once
per API server. ZeroMQ's XSUB/XPUB proxy moves the bytes in C (no Python per
message); it never reads, keeps or changes a message.

    python -m dpserve.daemons.coordinator.table_relay --upstream ipc://.../coordinator.table --bind ipc://.../node.table

benchmarks/cluster_bench.py --table-relay measures the head's CPU and bytes with
and without it; RESULTS.md (issue 30) says which is the default and why.
"""

from __future__ import annotations

import argparse
import os
import signal

import zmq
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.procutil import die_with_parent, set_process_name
from dpserve.engine.common.sockets import make_socket


def relay(ctx: zmq.Context, upstream: str, bind: str, keys: CurveKeys | None = None) -> None:
    """Proxy the table from `upstream` (a CURVE client with `keys`, as every node is
    to its head) to subscribers of `bind` (node-local) until the context ends."""
    sub = make_socket(ctx, zmq.XSUB, keys, rcvhwm=10_000, reconnect_ms=(100, 2000))
    sub.connect(upstream)
    # the same CURVE keys as the head's: the node's subscribers need not know whom they subscribe to
    pub = make_socket(ctx, zmq.XPUB, keys, sndhwm=10_000, bind=bind)
    try:
        zmq.proxy(sub, pub)
    except zmq.ContextTerminated:
        pass
    finally:
        sub.close(0)
        pub.close(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dpserve table-relay", description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="the coordinator's table address")
    ap.add_argument("--bind", required=True, help="the local address the node's API servers subscribe to")
    ap.add_argument("--parent-pid", type=int, default=0)
    args = ap.parse_args(argv)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    set_process_name("dpserve-relay")
    # The proxy blocks in C and holds nothing to save: a SIGTERM ends the process (exit 0).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    relay(zmq.Context(), args.upstream, args.bind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
