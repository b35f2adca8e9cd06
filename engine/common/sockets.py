"""The one place a dpserve ZeroMQ socket is made: LINGER 0, the deployment's CURVE
role, high-water marks and reconnect intervals, then bind or connect.

Why one helper: every socket in the suite must close without lingering (a dying
process may never block on unsent messages) and must take the CURVE role of its
side (servers bind, clients connect) before it binds or connects, or a
multi-node deployment accepts unauthenticated peers. Written once, neither can
be forgotten.
"""

from __future__ import annotations

import zmq
from dpserve.engine.common.auth import CurveKeys, make_client, make_server


def make_socket(
    ctx: zmq.Context,
    kind: int,
    keys: CurveKeys | None = None,
    *,
    bind: str | None = None,
    connect: str | None = None,
    server: bool | None = None,
    identity: bytes | None = None,
    sndhwm: int | None = None,
    rcvhwm: int | None = None,
    reconnect_ms: tuple[int, int] | None = None,
    subscribe: bytes | None = None,
    router_mandatory: bool = False,
) -> zmq.Socket:
    """A socket of `kind` from `ctx` (sync or asyncio), bound to `bind` or connected to
    `connect`; with neither, the caller binds or connects it (after attaching a monitor,
    say), and `server` says which CURVE role it takes (default: client).

    `reconnect_ms` is (first interval, cap) for a connecting socket; `subscribe` a SUB
    prefix; `router_mandatory` makes a send to an unknown peer raise instead of a silent
    drop. There is deliberately no ROUTER_HANDOVER: with it, any peer that connects
    with an identity already in use takes it over (and the messages meant for it)."""
    if bind is not None and connect is not None:
        raise ValueError("a socket binds or connects, not both")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    if reconnect_ms is not None:
        sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ms[0])
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ms[1])
    if subscribe is not None:
        sock.setsockopt(zmq.SUBSCRIBE, subscribe)
    if router_mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if bind is not None or server:
        make_server(sock, keys)
    else:
        make_client(sock, keys)
    if bind is not None:
        sock.bind(bind)
    elif connect is not None:
        sock.connect(connect)
    return sock


def peer_name(identity: bytes) -> str:
    """A ZeroMQ peer identity fit for a log line: as text when it is printable ASCII
    (every identity dpserve sets), else hex, so that a stray peer's bytes can
    neither garble the journal nor pose as a rank's name."""
    if identity and len(identity) <= 64 and all(0x20 < b < 0x7F for b in identity):
        return identity.decode("ascii")
    return "0x" + identity[:64].hex() + ("..." if len(identity) > 64 else "")
