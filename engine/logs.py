"""One-line-per-event logging for every dpserve process (structlog).

Each line starts with the syslog priority prefix (`<3>` error, `<4>` warning,
`<6>` info, `<7>` debug) so journald files it at the right priority, and names
its component (and rank) so `journalctl -u dpserve-head@m` can be read without
guessing which process spoke. Shared by engines and daemons, so it lives in engine/ (engine/ never imports
daemons/). Nothing here may import torch.
"""

from __future__ import annotations

import logging
import os
import sys

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
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    return structlog.get_logger()


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
