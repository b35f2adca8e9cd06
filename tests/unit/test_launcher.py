"""The prefork launcher's pieces that need no supervisor (the rest runs in tests/integration/test_faults.py)."""

from __future__ import annotations

import os
import signal
import time

import psutil
from dpserve.daemons.supervisor.launcher import reap_strays


def _zombie(code: int) -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(code)
    deadline = time.monotonic() + 5
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return pid


def test_reap_strays_takes_only_unknown_zombies():
    others = {p.pid for p in psutil.Process().children()}  # other tests' processes: never touched
    stray = _zombie(7)
    kept = _zombie(0)
    try:
        assert reap_strays(others | {kept}) == [(stray, 7)]
        assert psutil.Process(kept).status() == psutil.STATUS_ZOMBIE  # a known pid keeps its status
        assert reap_strays(others | {kept}) == []
    finally:
        assert os.waitpid(kept, 0)[0] == kept


def test_reap_strays_leaves_running_children():
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        others = {p.pid for p in psutil.Process().children()} - {pid}
        assert reap_strays(others) == []
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
