"""The simulated engine's poll: zmq.Poller over every socket vs one epoll over their
ZMQ_FDs (engine/testing/sim_poll.py, issue 30). RANKS x (API_SERVERS + 1) idle
DEALER sockets, as one sim-engine process holds; CPU per poll(0).

    .venv/bin/python benchmarks/sim_poll_bench.py 256 32
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402
from dpserve.engine.common.procutil import raise_fd_limit  # noqa: E402
from dpserve.engine.testing.sim_poll import FdPoller  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ranks", type=int, help="simulated ranks in the process")
    ap.add_argument("api_servers", type=int, help="API servers each rank connects to")
    args = ap.parse_args(argv)
    raise_fd_limit()
    n_ranks, n_api = args.ranks, args.api_servers
    tmp = tempfile.mkdtemp()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 100_000)
    routers = [ctx.socket(zmq.ROUTER) for _ in range(n_api + 1)]
    for i, router in enumerate(routers):
        router.bind(f"ipc://{tmp}/a{i}")
    socks = []
    for _ in range(n_ranks):
        for i in range(n_api + 1):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{tmp}/a{i}")
            socks.append(sock)
    time.sleep(2)  # every connection up
    zpoller, fpoller = zmq.Poller(), FdPoller()
    for sock in socks:
        zpoller.register(sock, zmq.POLLIN)
        fpoller.register(sock)
    fpoller.poll(0)
    for name, poll in (("zmq.Poller", lambda: zpoller.poll(0)), ("FdPoller (epoll)", lambda: fpoller.poll(0))):
        t0, num = time.process_time(), 0
        while time.process_time() - t0 < 1.0:
            poll()
            num += 1
        print(f"{name}: {len(socks)} sockets, {1e3 * (time.process_time() - t0) / num:.3f} ms CPU a poll")
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
