"""Peers that fail the CURVE handshake on the coordinator's engine port (a node
with another key file). They never reach the ZAP handler, so only the socket's
monitor can tell the operator: warn at once, then at most every
HANDSHAKE_WARN_EVERY_S with a count. It reads the monitor and logs; it must
never touch the engine socket itself or any rank's state.
"""

from __future__ import annotations

import zmq
from dpserve.engine.common.auth import HANDSHAKE_EVENTS, describe_handshake_failure
from zmq.utils.monitor import parse_monitor_message

HANDSHAKE_WARN_EVERY_S = 10.0  # a peer with another key retries ~10 times a second


class HandshakeWatch:
    """The monitor socket of one CURVE-secured socket and the failures seen on it."""

    def __init__(self, sock: zmq.Socket, address: str, log) -> None:
        self.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self.address = address
        self.log = log
        self.num_failed = 0
        self.last_failure = ""
        self.last_warning = 0.0

    def note(self, has_events: bool, now: float) -> None:
        """Read the monitor's events (when `has_events`), and warn when one is due."""
        while has_events:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            why = describe_handshake_failure(event["event"], event["value"])
            if why:
                self.num_failed += 1
                self.last_failure = why
        if self.num_failed and now - self.last_warning >= HANDSHAKE_WARN_EVERY_S:
            self.log.warning(
                "refused a connection: " + self.last_failure,
                address=self.address,
                attempts=self.num_failed,
                hint="every node needs the same --data-parallel-key-file",
            )
            self.num_failed = 0
            self.last_warning = now
