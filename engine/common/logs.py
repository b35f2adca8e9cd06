"""One-line-per-event logging for every dpserve process (structlog).

Each line starts with the syslog priority prefix (`<3>` error, `<4>` warning,
`<6>` info, `<7>` debug) so journald files it at the right priority, and names
its component (and rank) so `journalctl -u dpserve-head@m` can be read without
guessing which process spoke. Nothing here may import torch.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import structlog

_PRIORITY = {"critical": 2, "error": 3, "exception": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7}
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _render(_logger, method_name: str, event_dict: dict) -> str:
    prio = _PRIORITY.get(method_name, 6)
    component = event_dict.pop("component", "dpserve")
    event = event_dict.pop("event", "")
    exc = event_dict.pop("exception", None)
    parts = [f"<{prio}>{component}:", str(event)]
    for key, value in event_dict.items():
        text = str(value)
        if " " in text or "=" in text or not text:
            text = repr(text)
        parts.append(f"{key}={text}")
    line = " ".join(parts)
    if exc:
        # A traceback stays one journal entry per line, each with the prefix.
        line += "".join(f"\n<{prio}>{component}: {tb_line}" for tb_line in str(exc).rstrip().splitlines())
    return line


def setup_logging(component: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process; every line carries `component`."""
    level = (level or os.environ.get("DPSERVE_LOG_LEVEL", "info")).lower()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.format_exc_info,
            _render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component)
    # Libraries that use the stdlib logging module (aiohttp, transformers) get
    # the same prefix and component through a plain handler.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StdlibFormatter(component))
    handler.addFilter(_FloodFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    return structlog.get_logger()


class _FloodFilter(logging.Filter):
    """Keeps what any client can trigger from flooding the journal.

    aiohttp logs every malformed HTTP request with a traceback at error level
    (a 24-byte request cost 687 bytes of journal), and asyncio logs every failed
    accept() when fds run out. Malformed requests are the client's fault: they
    become one info line per window with a count. Failed accepts are ours: they
    stay warnings, one per window with a count. Everything else passes untouched.
    """

    WINDOW_S = 10.0

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[str, int] = {}
        self._said_at: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind, level = self._classify(record)
        if not kind:
            return True
        self._seen[kind] = self._seen.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._said_at.get(kind, -self.WINDOW_S) < self.WINDOW_S:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300] if exc is not None else ""
        said = record.getMessage()
        record.msg = "%s%s (%d since the last such line; at most one per %.0f s)"
        record.args = (said, f": {detail}" if detail else "", self._seen[kind], self.WINDOW_S)
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = level, logging.getLevelName(level)
        self._seen[kind] = 0
        self._said_at[kind] = now
        return True

    @staticmethod
    def _classify(record: logging.LogRecord) -> tuple[str, int]:
        if record.name == "aiohttp.server" and record.exc_info:
            exc = record.exc_info[1]
            code = getattr(exc, "code", None)
            if type(exc).__module__.startswith("aiohttp.") and isinstance(code, int) and 400 <= code < 500:
                return "bad-http", logging.INFO
        if record.name == "asyncio" and str(record.msg).startswith("socket.accept() out of system resource"):
            return "accept", logging.WARNING
        return "", 0


class _StdlibFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelname.lower(), 6)
        text = f"<{prio}>{self.component}: {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "".join(
                f"\n<{prio}>{self.component}: {line}"
                for line in self.formatException(record.exc_info).splitlines()
            )
        return text


def get_logger() -> structlog.stdlib.BoundLogger:
    return structlog.get_logger()
