"""Small pieces of the node hardening that need no running node: the open-file
limit, the API key's sources, the log filter that stops malformed requests flooding
the journal, and the one policy for undecodable wire messages (the integration side
is tests/integration/test_node_hardening.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import msgspec
import pytest
import structlog
from dpserve.daemons.cli.main import _api_key
from dpserve.engine.common.logs import _FloodFilter
from dpserve.engine.common.protocol import UNDECODABLE_LOG_INTERVAL_S, Codec, LoadTable, PrefixRouted, RankLoad, TableChannel


def test_soft_fd_limit_is_raised_to_the_hard_limit():
    code = (
        "import resource; from dpserve.engine.common.procutil import raise_fd_limit;"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096));"
        "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "(4096, 4096) (4096, 4096)"


def test_api_key_comes_from_the_flag_or_the_first_line_of_a_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("s3cret\n# comment\n")
    assert _api_key({"api_key": "k", "api_key_file": None}) == "k"
    assert _api_key({"api_key": None, "api_key_file": str(path)}) == "s3cret"
    with pytest.raises(ValueError, match="not both"):
        _api_key({"api_key": "k", "api_key_file": str(path)})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        _api_key({"api_key": None, "api_key_file": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="cannot read"):
        _api_key({"api_key": None, "api_key_file": str(tmp_path / "missing")})


class BadHttp(Exception):
    """Shaped like aiohttp.http_exceptions.BadHttpMessage: a module under aiohttp and a 4xx code."""

    __module__ = "aiohttp.http_exceptions"
    code = 400


def _record(name: str, msg: str, exc: BaseException | None, level: int = logging.ERROR) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(name, level, __file__, 1, msg, ("10.0.0.9",) if "%s" in msg else (), exc_info)


def test_malformed_requests_become_one_info_line_per_window(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("dpserve.engine.common.logs.time.monotonic", lambda: clock[0])
    flt = _FloodFilter()
    passed = []
    for _ in range(500):
        rec = _record("aiohttp.server", "Error handling request from %s", BadHttp("400, message:\n  Invalid method"))
        if flt.filter(rec):
            passed.append(rec)
    assert len(passed) == 1
    first = passed[0]
    assert first.levelno == logging.INFO and first.exc_info is None
    assert "\n" not in first.getMessage() and "10.0.0.9" in first.getMessage() and "Invalid method" in first.getMessage()
    clock[0] += _FloodFilter.WINDOW_S
    rec = _record("aiohttp.server", "Error handling request from %s", BadHttp("again"))
    assert flt.filter(rec) and "(500 since the last such line" in rec.getMessage()
    # a real server error (500) is left alone, traceback and all
    boom = RuntimeError("boom")
    rec = _record("aiohttp.server", "Error handling request from %s", boom)
    assert flt.filter(rec) and rec.levelno == logging.ERROR and rec.exc_info[1] is boom


def test_undecodable_messages_are_counted_and_logged_rate_limited_never_raised(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("dpserve.engine.common.protocol.time.monotonic", lambda: clock[0])
    codec = Codec(LoadTable, "load table")
    good = codec.encode(LoadTable(7, 2, [RankLoad(1, "inc", True)]))
    wrong_type = Codec(PrefixRouted).encode(PrefixRouted("api", []))  # valid msgpack, another message
    with structlog.testing.capture_logs() as logs:
        assert codec.decode_or_none(good).seq == 7
        dropped = [codec.decode_or_none(b, peer="p1") for b in (b"\xc1garbage", wrong_type, b"", good[:-1])]
        assert dropped == [None] * 4 and codec.num_undecodable == 4
        clock[0] += UNDECODABLE_LOG_INTERVAL_S  # a window later: one more line, with the running count
        assert codec.decode_or_none(b"\xff") is None
        assert codec.decode_or_none(good).seq == 7  # and the channel still works
    warned = [e for e in logs if e["event"] == "undecodable message dropped"]
    assert [(e["log_level"], e["channel"], e["num_undecodable"]) for e in warned] == [("warning", "load table", 1), ("warning", "load table", 5)]
    assert warned[0]["peer"] == "p1" and warned[0]["error"]
    with pytest.raises(msgspec.DecodeError):
        codec.decode(b"\xc1")  # decode() is for a caller's own bytes: it still raises


def test_the_supervisor_reads_the_table_channel_without_calling_prefix_news_undecodable():
    """The coordinator's PUB socket carries LoadTables and the API servers'
    PrefixRouted (cache-aware routing); the supervisor keeps only the tables."""
    import asyncio

    from dpserve.daemons.supervisor.events import TableSeen
    from dpserve.daemons.supervisor.producers import read_table

    enc = Codec(TableChannel)
    frames = [enc.encode(PrefixRouted("api-x", [(0, [1, 2])])), enc.encode(LoadTable(3, 1, [RankLoad(0, "i", True)]))]

    class Sub:
        async def recv(self):
            if not frames:
                raise asyncio.CancelledError
            return frames.pop(0)

    posted = []
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(read_table(Sub(), posted.append))
    assert [type(e) for e in posted] == [TableSeen] and posted[0].entries[0].rank == 0
    assert not [e for e in logs if e["event"] == "undecodable message dropped"]
