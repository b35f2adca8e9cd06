"""Process plumbing shared by every dpserve child: exit codes, parent-death, supervisor link.

Must stay free of torch (see the package docstring).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import zmq
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import ChildReady, Heartbeat, ToSupervisor
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


def describe_exit(returncode: int, killed_by_us: bool = False, oom_killed: bool = False) -> str:
    """'exit code 3 (startup failure)' or 'signal SIGKILL (killed by the OOM killer)'.

    A SIGKILL names the OOM killer only when the kernel's record says so
    (oom_killed: OomRecord.killed_since_last); one the caller did not send and the
    record does not explain is said to come from outside dpserve."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = ""
        if -returncode == signal.SIGKILL:
            if killed_by_us:
                hint = " (killed by the supervisor: it did not stop in time)"
            elif oom_killed:
                hint = " (killed by the OOM killer)"
            else:
                hint = " (not sent by dpserve)"
        return f"signal {name}{hint}"
    desc = EXIT_DESCRIPTIONS.get(returncode)
    return f"exit code {returncode}" + (f" ({desc})" if desc else "")


def _oom_counter_file() -> str | None:
    """The file that counts OOM kills in this process's own cgroup (and the cgroups below
    it, where children live): cgroup v2's memory.events, else v1's memory.oom_control;
    both readable without privileges. None when neither can be read."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2 = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    v1 = next((ln.split(":", 2)[2] for ln in lines if ":memory:" in ln), None)
    candidates = []
    if v2 is not None:  # a container's cgroup namespace shows its own cgroup at the mount's root
        candidates += [f"/sys/fs/cgroup{v2.rstrip('/')}/memory.events", "/sys/fs/cgroup/memory.events"]
    if v1 is not None:
        candidates += [f"/sys/fs/cgroup/memory{v1.rstrip('/')}/memory.oom_control", "/sys/fs/cgroup/memory/memory.oom_control"]
    return next((path for path in candidates if read_oom_kills(path) is not None), None)


def read_oom_kills(path: str) -> int | None:
    """The `oom_kill N` count in a memory.events or memory.oom_control file."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


class OomRecord:
    """The kernel's count of OOM kills in our cgroup, read before and after a SIGKILL.

    Each kill the count shows is taken by one SIGKILLed child; with no readable count
    (no memory controller, an older kernel) no kill is ever put on the OOM killer."""

    def __init__(self, path: str | None = "") -> None:
        self.path = _oom_counter_file() if path == "" else path
        self.seen = read_oom_kills(self.path) if self.path else None

    def killed_since_last(self) -> bool:
        if self.seen is None:
            return False
        now = read_oom_kills(self.path)
        if now is None or now <= self.seen:
            return False
        self.seen += 1
        return True


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
