"""Small pieces of issue 12's node hardening that need no running node: the open-file
limit, the API key's sources, and the log filter that stops malformed requests flooding
the journal (the integration side is tests/integration/test_node_hardening.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from dpserve.daemons.cli.main import _api_key
from dpserve.engine.common.logs import _FloodFilter


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
