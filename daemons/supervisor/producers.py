"""Tasks that turn the outside world into events on the supervisor's queue.

Each one only reads its source (a process, a socket, a monitor socket) and
posts an event (events.py); none of them reads or writes a child record, so
the loop stays the single writer of the node's state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq
from dpserve.daemons.coordinator.delta import expand
from dpserve.daemons.supervisor.events import Event, Exited, Fatal, Heartbeat, Ready, TableSeen
from dpserve.engine.common.auth import HANDSHAKE_EVENTS, describe_handshake_failure
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.procutil import EXIT_CONFIG
from dpserve.engine.common.protocol import ChildReady, LoadDelta, LoadTable, TableChannel, ToSupervisor
from dpserve.engine.common.protocol import Heartbeat as HeartbeatMsg
from zmq.utils.monitor import parse_monitor_message

Post = Callable[[Event], None]


async def watch_exit(name: str, proc, post: Post) -> None:
    """Posts Exited the moment the process ends (asyncio's child watcher uses a pidfd)."""
    rc = await proc.wait()
    post(Exited(name, proc.pid, rc))


async def read_control(sock: zmq.asyncio.Socket, post: Post) -> None:
    """Children's ChildReady and Heartbeat messages (undecodable ones: Codec's policy)."""
    codec = Codec(ToSupervisor, "supervisor control")
    while True:
        msg = codec.decode_or_none(await sock.recv())
        if isinstance(msg, HeartbeatMsg):
            post(Heartbeat(msg.name, msg.pid, msg.num_running, msg.num_waiting, msg.kv_usage, time.monotonic()))
        elif isinstance(msg, ChildReady):
            post(Ready(msg.name, msg.pid, msg.detail))


async def read_table(sock: zmq.asyncio.Socket, post: Post, held: Callable[[], list] | None = None) -> None:
    """The coordinator's load table, as the API servers get it: the cluster view's source.
    The channel also carries the API servers' PrefixRouted news (cache-aware
    routing): a message of the channel, skipped here, never "undecodable".
    A LoadDelta updates the entries `held()` returns (the cluster view's)."""
    codec = Codec(TableChannel, "load table")
    while True:
        table = codec.decode_or_none(await sock.recv())
        if type(table) is LoadDelta and held is not None:
            post(TableSeen(expand(table, held()), time.monotonic(), time.time()))
        elif type(table) is LoadTable:
            post(TableSeen(table.ranks, time.monotonic(), time.time()))


async def watch_coordinator_link(link: zmq.asyncio.Socket, address: str, key_file: str, log, is_starting: Callable[[], bool], post: Post) -> None:
    """Workers: a coordinator that never completes a CURVE handshake means a wrong
    key file or address. Say so within seconds, not after the startup timeout;
    during startup a failed handshake (the head holds another key) halts the node."""
    question = f"no answer from the coordinator at {address}: wrong key file or address?"
    monitor = link.get_monitor_socket(HANDSHAKE_EVENTS)
    started = time.monotonic()
    answered = False
    failures = 0
    last_said = 0.0
    try:
        while True:
            try:
                frames = await asyncio.wait_for(monitor.recv_multipart(), timeout=10.0)
            except asyncio.TimeoutError:
                now = time.monotonic()
                if not answered and now - last_said >= 60.0:
                    last_said = now
                    log.warning(question, waited_s=round(now - started), detail="no handshake yet (is the head up?)")
                continue
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not answered and failures:
                    log.info("the coordinator answers", address=address)
                answered, failures = True, 0
                continue
            failures += 1
            answered = False
            now = time.monotonic()
            if failures >= 3 and now - last_said >= 60.0:
                last_said = now
                detail = describe_handshake_failure(event["event"], event["value"])
                log.error(question, detail=detail, attempts=failures, key_file=key_file)
                if is_starting():
                    post(Fatal(EXIT_CONFIG, detail))
    finally:
        monitor.close(0)
