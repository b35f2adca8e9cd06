"""Process plumbing shared by every dpserve child: exit codes, parent-death, supervisor link.

Must stay free of torch (see the package docstring).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import zmq
from dpserve.engine.common.protocol import ChildReady, Codec, Heartbeat, ToSupervisor
from dpserve.engine.common.sockets import make_socket

# Exit codes are a contract between children and the supervisor (and systemd):
EXIT_OK = 0
EXIT_ERROR = 1  # unexpected failure: restart with backoff
EXIT_CONFIG = 2  # bad configuration: restarting cannot help, halt the node
EXIT_STARTUP = 3  # failed to boot (model load, bind): halt instead of looping
EXIT_NODE_UNHEALTHY = 4  # supervisor: children kept crashing past the limit
EXIT_NOTHING_SERVES = 5  # supervisor: no rank or no API server can serve

EXIT_DESCRIPTIONS = {
    EXIT_OK: "clean exit",
    EXIT_ERROR: "unexpected error",
    EXIT_CONFIG: "configuration error",
    EXIT_STARTUP: "startup failure",
    EXIT_NODE_UNHEALTHY: "children crashed past the restart limit",
    EXIT_NOTHING_SERVES: "nothing left that can serve",
}

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36

CHILD_CONFIG_ENV = "DPSERVE_CHILD_CONFIG"


def child_config_from_env(kind):
    """The child's typed config, handed over by the supervisor in the environment."""
    import msgspec

    raw = os.environ.pop(CHILD_CONFIG_ENV, None)
    if raw is None:
        raise SystemExit(f"{CHILD_CONFIG_ENV} is not set: this entry point is started by the supervisor")
    return msgspec.json.decode(raw.encode(), type=kind)


def start_child(kind, process_name):
    """What every child does first: its typed config from the environment, death with
    its parent, and its process name (`process_name`, or `process_name(config)`)."""
    cfg = child_config_from_env(kind)
    die_with_parent(cfg.parent_pid)
    set_process_name(process_name(cfg) if callable(process_name) else process_name)
    return cfg


def _prctl(option: int, arg) -> bool:
    """prctl(2) on Linux; False elsewhere or when the kernel refuses."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies.

    Checked against the expected parent afterwards: if the parent died before
    prctl ran, we were already re-parented and must exit at once.
    """
    _prctl(_PR_SET_PDEATHSIG, int(sig))
    if parent_pid and os.getppid() != parent_pid:
        os._exit(EXIT_ERROR)


def set_process_name(name: str) -> None:
    """The name `ps -o comm`, top and journald's _COMM show (15 bytes at most)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux only)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as servers do; children inherit it.

    Many login shells keep the soft limit at 1,024, which a loaded API server
    outgrows. Returns (soft, hard) as they are afterwards.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # the kernel caps it at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            return soft, hard
    if soft != target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep what we have; the launcher does not depend on high fd numbers
    return soft, hard


def describe_exit(returncode: int, killed_by_us: bool = False) -> str:
    """'exit code 3 (startup failure)' or 'signal SIGKILL (out of memory?)'.

    A SIGKILL hints at the kernel's OOM killer only when the caller did not
    send it itself (killed_by_us: a child that did not stop in time)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = ""
        if -returncode == signal.SIGKILL:
            hint = " (killed by the supervisor: it did not stop in time)" if killed_by_us else " (out of memory?)"
        return f"signal {name}{hint}"
    desc = EXIT_DESCRIPTIONS.get(returncode)
    return f"exit code {returncode}" + (f" ({desc})" if desc else "")


class SupervisorLink:
    """A PUSH socket to the supervisor that never blocks the caller.

    If the supervisor is gone or slow, messages are dropped (HWM 1000, LINGER 0):
    a child must never stall its work loop on reporting.
    """

    def __init__(self, ctx: zmq.Context, address: str, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self._codec = Codec(ToSupervisor)
        self._sock = make_socket(ctx, zmq.PUSH, connect=address, sndhwm=1000)

    def send(self, msg: object) -> None:
        try:
            self._sock.send(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def ready(self, detail: str = "") -> None:
        self.send(ChildReady(self.name, self.pid, detail))

    def heartbeat(self, num_running: int = 0, num_waiting: int = 0, kv_usage: float = 0.0) -> None:
        self.send(Heartbeat(self.name, self.pid, num_running, num_waiting, kv_usage))

    def close(self) -> None:
        self._sock.close(0)
