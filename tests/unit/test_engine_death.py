"""An engine's death announcement is sure to leave.

EngineDead goes out NOBLOCK on sockets that linger 0 while serving; the
process then destroys its ZeroMQ context and exits. Here the API server binds
its socket only after the engine has announced and begun to close, so the
message is still queued when the context goes: only a linger delivers it.
Real EngineProcess sockets, a real peer; no model is loaded.
"""

from __future__ import annotations

import threading
import time

import structlog
import zmq
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.config import EngineConfig, EngineProcessConfig
from dpserve.engine.common.protocol import EngineDead, EngineToApi
from dpserve.engine.rank.process import DEATH_LINGER_S, EngineProcess


def test_engine_dead_reaches_an_api_server_that_binds_after_the_close_began(tmp_path):
    api_address = f"ipc://{tmp_path}/api-0"
    cfg = EngineProcessConfig(
        name="engine-dp3",
        engine=EngineConfig(model=str(tmp_path), rank=3),
        node_rank=0,
        key_file="",
        coordinator_address=f"ipc://{tmp_path}/coordinator",
        supervisor_address=f"ipc://{tmp_path}/supervisor",
        fingerprint="test",
        heartbeat_interval_s=1.0,
        parent_pid=0,
    )
    proc = EngineProcess(cfg, structlog.get_logger())
    proc.io.connect_api_servers([api_address])
    ctx = zmq.Context()
    api = ctx.socket(zmq.ROUTER)
    api.setsockopt(zmq.LINGER, 0)
    received = []

    def api_server_comes_up_late() -> None:
        time.sleep(DEATH_LINGER_S / 4)
        api.bind(api_address)
        if api.poll(int(DEATH_LINGER_S * 2000)):
            received.append(api.recv_multipart())

    thread = threading.Thread(target=api_server_comes_up_late)
    try:
        thread.start()
        proc.announce_death("engine shut down")
        proc.close()  # waits for the announcement, at most DEATH_LINGER_S
        thread.join(DEATH_LINGER_S * 3)
    finally:
        api.close(0)
        ctx.term()
    assert len(received) == 1, "EngineDead was dropped with the context"
    identity, data = received[0][0], received[0][-1]
    msg = Codec(EngineToApi).decode(data)
    assert identity == f"3:{proc.incarnation}".encode() and isinstance(msg, EngineDead)
    assert (msg.rank, msg.incarnation, msg.reason) == (3, proc.incarnation, "engine shut down")


class _Log:
    """Records (level, event) the way structlog's bound logger is called."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **kw: self.lines.append((level, event, kw))


class _Frame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def test_a_clean_stop_is_info_and_a_death_is_a_warning(tmp_path):
    """`journalctl -p warning` stays quiet through a requested stop: an engine that
    announces a clean stop with no request in flight is logged at info; a failure
    (or a clean stop that still failed requests) stays a warning."""
    import zmq.asyncio
    from dpserve.daemons.api.engine_client import EngineClient
    from dpserve.daemons.api.router import Router
    from dpserve.engine.common.protocol import EngineHello, LoadTable, RankLoad

    ctx = zmq.asyncio.Context()
    log = _Log()
    client = EngineClient(ctx, Router(2), f"ipc://{tmp_path}/engines", f"ipc://{tmp_path}/table", log)
    codec = Codec(EngineToApi)
    client.router.update_table(LoadTable(1, 2, [RankLoad(0, "inc0", True), RankLoad(1, "inc1", True)]))
    try:
        for rank, clean, level in ((0, True, "info"), (1, False, "warning")):
            peer = (f"{rank}:inc{rank}".encode(),)  # the rank's own connection (RankIO.api_identity)
            client._handle_engine_message(peer, _Frame(codec.encode(EngineHello(rank, f"inc{rank}"))), client.requests)
            reason = "engine shut down" if clean else f"engine rank {rank} failed: boom"
            client._handle_engine_message(peer, _Frame(codec.encode(EngineDead(rank, f"inc{rank}", reason, clean))), client.requests)
            deaths = [line for line in log.lines if line[1] == "engine announced its death" and line[2]["rank"] == rank]
            assert [line[0] for line in deaths] == [level], log.lines
        # a peer of the version before `clean` still decodes: the field is trailing and defaulted
        old = msgspec_encode_without_clean(EngineDead(1, "x", "gone"))
        assert codec.decode(old) == EngineDead(1, "x", "gone", False)
    finally:
        client.engines.close(0)
        client.table.close(0)
        ctx.term()


def msgspec_encode_without_clean(msg: EngineDead) -> bytes:
    import msgspec

    class OldEngineDead(msgspec.Struct, tag="dead", array_like=True):
        rank: int
        incarnation: str
        reason: str

    return msgspec.msgpack.encode(OldEngineDead(msg.rank, msg.incarnation, msg.reason))
