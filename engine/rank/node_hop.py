"""One connection per node per API server (issue 30, `--rank-links node`): a node's
ranks reach an API server through the node's hop for it, so that an API server holds
a connection per node instead of one per rank.

Each hop is a ROUTER bound node-locally (ipc in the node's run dir, where its ranks
connect) and a DEALER connected to the API server (CURVE, identity
`node-{node_rank}-{boot}-{n}`), joined by ZeroMQ's proxy in C on a thread of its own
(no GIL, no Python a message). The frames do the routing, nothing is decoded:

- up: a rank's DEALER sends [body]; the local ROUTER prepends the rank's identity
  ("{rank}:{incarnation}", as today); the API server's ROUTER prepends the hop's:
  it reads [node, rank, body], a route of two frames;
- down: the API server sends [node, rank, body]; the hop's DEALER gets [rank, body];
  the local ROUTER routes it by that frame. A rank gone behind a live hop has its
  messages dropped there (never ROUTER_MANDATORY in a proxy: a failed send would end
  it); its death reaches the API servers as today: its last words (EngineDead pass the
  hop), the supervisor's pidfd (RankDown, at once), the table's staleness.

Why it pays: ~28 KiB of libzmq state a connection in every API server (4,096 ranks:
~115 MiB; 512 nodes: ~14 MiB) and the start's handshakes (1,024 ranks x 32 API
servers: 32,768 connections; 4,096 with nodes of 8). What it costs:
benchmarks/node_hop_bench.py measured ~+50 us a message one way and ~6 us of the
node's CPU (RESULTS, issue 30 fourth round).

The hops live in the node's supervisor, opened by its load relay's thread when a rank
asks (OpenHop, through the relay's node-local socket): the supervisor outlives its
ranks and dies with them, as the load relay does; no process of its own. A simulated
node forwards the same frames in its own loop (engine/testing/sim.py).
"""

from __future__ import annotations

import hashlib
import threading
import uuid

import zmq
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.sockets import make_socket

MAX_HOPS = 1024  # API servers one node links to; beyond it an OpenHop is refused (logged)
NODE_PREFIX = b"node-"


def hop_address(relay_address: str, api_address: str) -> str:
    """Where a node's ranks connect for the API server at `api_address`: next to the
    node's load relay (`ipc://{run_dir}/node.loads`), named by a digest of the address
    (the rank and its supervisor agree on it without asking)."""
    base = relay_address.rpartition("/")[0]
    return f"{base}/hop-{hashlib.sha1(api_address.encode()).hexdigest()[:16]}"


def hop_identity(node_rank: int, boot: str, n: int) -> bytes:
    """A hop's identity on the API server's engine socket: its node, this supervisor's
    boot (a restarted node never reuses a live identity) and the hop's number."""
    return f"node-{node_rank}-{boot}-{n}".encode()


def node_of(frame: bytes) -> int | None:
    """The node rank a hop's identity names, or None for anything else."""
    if not frame.startswith(NODE_PREFIX):
        return None
    head = frame[len(NODE_PREFIX):].partition(b"-")[0]
    return int(head) if head.isdigit() and len(head) <= 9 else None


def is_api_address(address: str) -> bool:
    """An address a rank may ask a hop for: what ApiServerList carries (tcp or ipc)."""
    return address.startswith(("tcp://", "ipc://")) and 6 < len(address) <= 256 and address.isprintable()


class NodeHops:
    """The node's hops, one per API server its ranks asked for.

    Invariant: `hops[address]` is the hop thread for that API server, replaced only once it
    ended; every hop's sockets belong to `ctx`, so the owner's ctx.term() ends
    them all (the proxy raises ContextTerminated and the thread closes its sockets).
    Only the owner's thread calls open().
    """

    def __init__(self, ctx: zmq.Context, relay_address: str, node_rank: int, keys: CurveKeys | None, log) -> None:
        self.ctx, self.relay_address, self.node_rank, self.keys, self.log = ctx, relay_address, node_rank, keys, log
        self.boot = uuid.uuid4().hex[:8]
        self.hops: dict[str, threading.Thread] = {}
        self.num_opened = 0  # hops started, the current ones and any that ended: each its own identity

    def open(self, address: str) -> bool:
        """Start the hop for `address` unless it runs; False when refused. A hop whose thread
        ended (it could not bind, say) is started again, under a new identity, when a rank
        asks again (its reconnection after an API server's plea)."""
        hop = self.hops.get(address)
        if hop is not None and hop.is_alive():
            return True
        if hop is None and (not is_api_address(address) or len(self.hops) >= MAX_HOPS):
            self.log.warning("a rank asked for a hop that is refused", address=address[:80], hops=len(self.hops))
            return False
        front = hop_address(self.relay_address, address)
        self.num_opened += 1
        identity = hop_identity(self.node_rank, self.boot, self.num_opened)
        thread = threading.Thread(
            target=self._run, args=(front, address, identity), name=f"hop-{self.num_opened}", daemon=True
        )
        self.hops[address] = thread
        thread.start()
        self.log.info("node hop opened", api_server=address, local=front)
        return True

    def _run(self, front_address: str, api_address: str, identity: bytes) -> None:
        front = back = None
        try:
            # Unbounded both ways, as the rank's and the API server's own sockets: an output
            # is never dropped for want of room (a hop only moves what the ends already hold).
            front = make_socket(self.ctx, zmq.ROUTER, bind=front_address, sndhwm=0, rcvhwm=0)  # node-local: no CURVE
            back = make_socket(self.ctx, zmq.DEALER, self.keys, identity=identity, sndhwm=0, rcvhwm=0, reconnect_ms=(50, 1000))
            back.connect(api_address)
            zmq.proxy(front, back)
        except zmq.ContextTerminated:
            pass
        except Exception:
            self.log.exception("a node hop failed; its ranks cannot reach that API server", api_server=api_address)
        finally:
            for sock in (front, back):
                if sock is not None:
                    sock.close(0)
