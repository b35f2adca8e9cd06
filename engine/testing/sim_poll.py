"""One epoll over thousands of ZeroMQ sockets, for the simulated engine (issue 30).

zmq.Poller (zmq_poll) visits every socket it holds on every call: at 1,024 ranks x
32 API servers that is 33,000 sockets a wake-up, most of the simulator's CPU.
Here each socket's ZMQ_FD is registered once with the kernel's epoll, and a wake-up
costs what became readable. ZMQ_FD only says "look at ZMQ_EVENTS": it is reset by
any recv, send or EVENTS read, so a socket is reported when EVENTS says POLLIN,
and the owner must hand back every socket it sent on (`recheck`): a send may have
taken messages in without the FD signalling again. Readable sockets must be
drained (until zmq.Again) by the owner, as RankIO.read does.
"""

from __future__ import annotations

import select

import zmq

POLLIN = int(zmq.POLLIN)  # a plain int: an IntFlag's operators cost an enum call each


class FdPoller:
    """Invariant: `by_fd` holds every registered socket under its ZMQ_FD."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.by_fd: dict[int, zmq.Socket] = {}
        self.suspects: set[zmq.Socket] = set()  # to look at on the next poll: sent on, or readable last time

    def register(self, sock: zmq.Socket) -> None:
        fd = sock.getsockopt(zmq.FD)
        self.by_fd[fd] = sock
        self.epoll.register(fd, select.EPOLLIN)
        self.suspects.add(sock)  # it may hold messages already

    def recheck(self, socks) -> None:
        self.suspects.update(socks)

    def poll(self, timeout_ms: int) -> list[zmq.Socket]:
        """The sockets with messages waiting, after at most `timeout_ms` (none waited for
        if a suspect already has some)."""
        ready = _readable(self.suspects)
        self.suspects.clear()
        events = self.epoll.poll(0 if ready else timeout_ms / 1000)
        by_fd = self.by_fd
        ready += _readable(by_fd.get(fd) for fd, _ in events)
        # A socket drained now may receive more while the owner works: look again next time
        # (cheap: one EVENTS read each), as its FD will not signal what it already signalled.
        self.suspects.update(ready)
        return list(dict.fromkeys(ready))

    def close(self) -> None:
        self.epoll.close()


def _readable(socks) -> list[zmq.Socket]:
    """Those of `socks` (None and closed ones skipped) with a message waiting, in one
    zmq_poll of timeout 0: ~3 us a socket, against ~12 us for a getsockopt(EVENTS) and
    an IntFlag test each (pyzmq makes each option and flag an enum; at 256 ranks x 32
    API servers at rest those were 3/4 of a simulator process's CPU, issue 30)."""
    pollin = POLLIN
    items = [(s, pollin) for s in socks if s is not None and not s.closed]
    return [s for s, _ in zmq.zmq_poll(items, 0)] if items else []
