"""systemd notification (sd_notify) for the supervisor, via the sdnotify package.

Without NOTIFY_SOCKET every call is a no-op, so the same code runs under
systemd, in a terminal and in tests. The watchdog is armed only when
WATCHDOG_USEC is set for this very process (WATCHDOG_PID, if present, matches).
"""

from __future__ import annotations

import os
import time

import sdnotify


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self.enabled else None
        self.watchdog_interval_s = self._watchdog_interval()
        self._last_status = ""

    @staticmethod
    def _watchdog_interval() -> float | None:
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
            return None
        try:
            return int(usec) / 1e6 / 2  # systemd asks for a ping at least every half period
        except ValueError:
            return None

    def send(self, *lines: str) -> None:
        if self._sd is not None:
            self._sd.notify("\n".join(lines))

    def status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def ready(self, status: str) -> None:
        self._last_status = status
        self.send("READY=1", f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def reloading(self, status: str = "reloading: rolling restart of the API servers") -> None:
        """Type=notify-reload protocol: MONOTONIC_USEC says which reload this is;
        READY=1 (ready()) ends it."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._last_status = status
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", f"STATUS={status}")
