"""Real systemd nodes on one machine: a private bridge, one network namespace per node.

Owns the throw-away testbed of the system tests (recipe and pitfalls:
../shared/TESTBED.md): a "switch" network namespace holding bridge br0
(10.77.0.1/24), and nodes that boot a real systemd with systemd-nspawn on an
overlay of `/` built in a private mount namespace, each in its own network
namespace wired to the bridge. It must never change the host: no mount, link,
route, sysctl or cgroup may survive `close()`, which also runs after failures.
Talk to a node only from inside it (`Node.run`) or the switch namespace;
from the host, 10.77.0.x is answered by the machine's sandbox, not by a node.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

SUBNET = "10.77.0"
SWITCH_ADDRESS = f"{SUBNET}.1"
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Host units that must not start in a node (they fail in a container, touch
# devices, or would serve the host's data from the overlay).
MASKED_UNITS = (
    "postgresql.service", "postgresql@.service", "getty@.service", "console-getty.service",
    "serial-getty@.service", "container-getty@.service", "systemd-timesyncd.service",
    "systemd-networkd.service", "systemd-networkd.socket", "systemd-networkd-wait-online.service",
    "systemd-resolved.service", "networking.service", "ssh.service", "cron.service",
    "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer",
    "e2scrub_reap.service", "fstrim.timer", "man-db.timer", "systemd-tmpfiles-clean.timer",
    "systemd-pstore.service", "machines.target", "var-lib-machines.mount", "remote-fs.target",
)

# Sysctls that move on their own; everything else under /proc/sys must not change.
VOLATILE_SYSCTLS = (
    "fs.dentry-state", "fs.file-nr", "fs.inode-nr", "fs.inode-state", "fs.aio-nr",
    "fs.quota.", "fs.fscache.", "kernel.ns_last_pid", "kernel.random.", "kernel.pty.nr",
    "kernel.tainted", "kernel.perf_event_max_sample_rate", "net.netfilter.nf_conntrack_count",
)


# Top-level cgroups that come and go with other work on a shared machine: other
# testbeds (each checks its own tag) and per-command groups named by a UUID or hash.
FOREIGN_CGROUP = re.compile(r"^(dpserve-tb-.*|[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}|[0-9a-f]{32})$")
TAG_PREFIX = "dpserve-tb-"


class TestbedError(RuntimeError):
    """The testbed could not be built or driven; the message says which step failed."""


def unsupported_reason() -> str | None:
    """Why this machine cannot run the testbed, or None when it can."""
    if os.geteuid() != 0:
        return "system tests need root (they boot systemd-nspawn nodes in network namespaces)"
    missing = [t for t in ("systemd-nspawn", "systemd-id128", "unshare", "nsenter", "ip", "mount", "curl") if shutil.which(t) is None]
    if missing:
        return f"system tests need {', '.join(missing)} (apt-get install systemd-container iproute2 util-linux curl)"
    if cgroup_layout() is None:
        return "system tests need a writable cgroup hierarchy (hybrid: /sys/fs/cgroup/{systemd,unified}, or unified cgroup2)"
    return None


def cgroup_layout() -> str | None:
    """'hybrid' (v1 name=systemd + cgroup2 at unified/, the proven layout), 'unified', or None."""
    fstype = _fstype(CGROUP_ROOT)
    if fstype == "cgroup2" and os.access(CGROUP_ROOT, os.W_OK):
        return "unified"
    if _fstype(CGROUP_ROOT / "systemd") == "cgroup" and _fstype(CGROUP_ROOT / "unified") == "cgroup2":
        if os.access(CGROUP_ROOT / "systemd", os.W_OK) and os.access(CGROUP_ROOT / "unified", os.W_OK):
            return "hybrid"
    return None


def _fstype(path: Path) -> str | None:
    best, best_type = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                target = fields[1].replace("\\040", " ")
                if (str(path) == target or str(path).startswith(target.rstrip("/") + "/")) and len(target) >= len(best):
                    best, best_type = target, fields[2]
    except OSError:
        return None
    return best_type if best == str(path) else None


def run_host(*cmd: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise TestbedError(f"{shlex.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TestbedError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _status_field(pid: int, field: str) -> str:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class _Sleeper:
    """A `sleep infinity` in a fresh network namespace; the namespace lives as long as it does."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        own = os.readlink("/proc/self/ns/net")

        def in_new_netns() -> bool:
            if self.proc.poll() is not None:
                raise TestbedError(f"unshare --net exited {self.proc.returncode}")
            try:
                return os.readlink(f"/proc/{self.proc.pid}/ns/net") != own and _read(f"/proc/{self.proc.pid}/comm").strip() == "sleep"
            except OSError:
                return False

        wait_for(in_new_netns, 10, "a new network namespace", 0.01)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ip(self, *args: str) -> None:
        run_host("nsenter", "-t", str(self.pid), "-n", "ip", *args)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


class Node:
    """One booted node. Commands run inside all of its namespaces with a clean environment."""

    def __init__(self, testbed: Testbed, name: str, address: str, netns: _Sleeper, workdir: Path) -> None:
        self.testbed = testbed
        self.name = name
        self.address = address
        self.netns = netns
        self.workdir = workdir
        self.console_log = workdir / "console.log"
        self.nspawn: subprocess.Popen | None = None
        self.init_pid = 0

    # ---------------------------------------------------------------- commands

    def _argv(self, cmd: tuple[str, ...], env: dict[str, str] | None) -> list[str]:
        environ = {"PATH": NODE_PATH, "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", "TERM": "dumb", **(env or {})}
        return ["nsenter", "-t", str(self.init_pid), "-a", "env", "-i", *(f"{k}={v}" for k, v in environ.items()), *cmd]

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(self._argv(cmd, env), capture_output=True, text=True, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise TestbedError(f"[{self.name}] {shlex.join(cmd)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run("/bin/sh", "-c", script, **kw)

    def popen(self, *cmd: str, env: dict | None = None, **kw) -> subprocess.Popen:
        """A background command in the node; the caller stops it (it dies with the node at the latest)."""
        return subprocess.Popen(self._argv(cmd, env), start_new_session=True, **kw)

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        self.sh(f"mkdir -p {shlex.quote(os.path.dirname(path))} && cat > {shlex.quote(path)} && chmod {mode:o} {shlex.quote(path)}", input=text)

    def systemctl(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.run("systemctl", "--no-ask-password", *args, check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> list[dict]:
        out = self.run("journalctl", "--no-pager", "-o", "json", *args, check=False).stdout
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def http(self, url: str, *curl_args: str, timeout: float = 30) -> tuple[int, str]:
        """(HTTP status, body) of a curl run inside the node; status 0 when nothing answered."""
        proc = self.run("curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "--max-time", str(timeout), *curl_args, url, check=False, timeout=timeout + 10)
        body, _, code = proc.stdout.rpartition("\n")
        return (int(code) if code.isdigit() else 0), body

    # ---------------------------------------------------------------- boot

    def boot(self, binds: list[tuple[str, str]], hosts: str, timeout: float = 60) -> None:
        script = self.workdir / "inner.sh"
        script.write_text(self._inner_script(binds, hosts))
        log = open(self.console_log, "wb")
        try:
            # A private mount namespace: the overlay, its tmpfs and /run/systemd's
            # tmpfs exist only for this node and vanish with its last process.
            self.nspawn = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", str(script)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            log.close()
        self.init_pid = wait_for(self._find_init, timeout, f"{self.name}'s systemd (PID 1 in the node)", 0.05)

        def booted() -> bool:
            state = self.run("systemctl", "is-system-running", check=False, timeout=30).stdout.strip()
            return state in ("running", "degraded")

        wait_for(booted, timeout, f"{self.name} to finish booting")

    def _inner_script(self, binds: list[tuple[str, str]], hosts: str) -> str:
        tb = self.testbed
        q = shlex.quote
        scratch = self.workdir / "scratch"
        root = scratch / "root"
        etc = root / "etc"
        lines = [
            "set -eu",
            *(f"echo $$ > {q(str(d / 'cgroup.procs'))}" for d in tb.node_cgroups(self.name)),
            # nspawn keeps state under /run/systemd; give it a private tmpfs
            "mount -t tmpfs -o mode=0755 tmpfs /run/systemd",
            f"mount -t tmpfs -o mode=0755 tmpfs {q(str(scratch))}",
            f"mkdir -p {q(str(scratch / 'upper'))} {q(str(scratch / 'work'))} {q(str(root))}",
            f"mount -t overlay overlay -o lowerdir=/,upperdir={q(str(scratch / 'upper'))},workdir={q(str(scratch / 'work'))} {q(str(root))}",
            f"systemd-id128 new > {q(str(etc / 'machine-id'))}",
            f"echo {q(self.name)} > {q(str(etc / 'hostname'))}",
            f"printf %s {q(hosts)} > {q(str(etc / 'hosts'))}",
            f"mkdir -p {q(str(etc / 'systemd/system'))}",
            f"ln -sfn /lib/systemd/system/multi-user.target {q(str(etc / 'systemd/system/default.target'))}",
            *(f"ln -sfn /dev/null {q(str(etc / 'systemd/system' / u))}" for u in MASKED_UNITS),
            "exec systemd-nspawn -q -D " + q(str(root)) + f" -M {q(self.name)} --hostname={q(self.name)}"
            " -b --register=no --keep-unit --console=read-only"
            f" --network-namespace-path=/proc/{self.netns.pid}/ns/net"
            + "".join(f" --bind-ro={q(src)}:{q(dst)}" for src, dst in binds),
        ]
        return "\n".join(lines) + "\n"

    def _find_init(self) -> int:
        """The node's PID 1 seen from the host: a child of nspawn with NSpid `<pid> 1`, comm systemd."""
        if self.nspawn.poll() is not None:
            raise TestbedError(f"{self.name}: systemd-nspawn exited {self.nspawn.returncode}:\n{_read(str(self.console_log))[-4000:]}")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            if _status_field(pid, "PPid") != str(self.nspawn.pid):
                continue
            nspid = _status_field(pid, "NSpid").split()
            if len(nspid) >= 2 and nspid[-1] == "1" and _read(f"/proc/{pid}/comm").strip() == "systemd":
                return pid
        return 0

    def power_off(self, timeout: float = 30) -> None:
        """SIGTERM to nspawn shuts the node down cleanly; SIGKILL everything left after the deadline."""
        if self.nspawn is None:
            return
        if self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)
            try:
                self.nspawn.wait(timeout)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait(10)
        for cgroup in self.testbed.node_cgroups(self.name):
            _kill_cgroup(cgroup)


def _kill_cgroup(path: Path) -> None:
    """SIGKILL every process left in a cgroup subtree, then wait until it is empty."""
    if not path.is_dir():
        return

    def pids() -> set[int]:
        found = set()
        for dirpath, _dirs, files in os.walk(path):
            if "cgroup.procs" in files:
                found |= {int(p) for p in _read(os.path.join(dirpath, "cgroup.procs")).split()}
        return found

    for pid in pids():
        _kill(pid)
    try:
        wait_for(lambda: not pids(), 10, f"the processes in {path} to die", 0.05)
    except TestbedError:
        pass


def _remove_cgroup(path: Path) -> None:
    if not path.is_dir():
        return
    for dirpath, dirs, _files in os.walk(path, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(dirpath, d))
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


class Testbed:
    """A switch namespace with bridge br0 and the nodes plugged into it.

    `binds` are (host path, node path) pairs bind-mounted read-only into every
    node. Use as a context manager, or call close() in a finally block.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, binds: list[tuple[str, str]] = (), tag: str | None = None) -> None:
        self.binds = list(binds)
        self.tag = tag or f"{TAG_PREFIX}{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
        self.layout = cgroup_layout()
        self.workdir = Path(tempfile.mkdtemp(prefix=self.tag + "-"))
        self.nodes: list[Node] = []
        self.switch: _Sleeper | None = None
        self._sleepers: list[_Sleeper] = []

    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.layout is None:
            raise TestbedError(unsupported_reason() or "unsupported cgroup layout")
        self.switch = self._sleeper()
        self.switch.ip("link", "set", "lo", "up")
        self.switch.ip("link", "add", "br0", "type", "bridge")
        self.switch.ip("link", "set", "br0", "up")
        self.switch.ip("addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0")

    def _sleeper(self) -> _Sleeper:
        sleeper = _Sleeper()
        self._sleepers.append(sleeper)
        return sleeper

    def leftovers(self) -> list[str]:
        """What of this testbed is still on the host (empty after close())."""
        left = [str(d) for d in self.cgroup_dirs() if d.exists()]
        left += [f"sleeper {s.pid}" for s in self._sleepers if s.proc.poll() is None]
        left += [f"nspawn of {n.name}" for n in self.nodes if n.nspawn is not None and n.nspawn.poll() is None]
        left += [str(self.workdir)] if self.workdir.exists() else []
        return left

    def cgroup_dirs(self) -> list[Path]:
        """This testbed's own cgroup subtrees (one per hierarchy the nodes join)."""
        if self.layout == "unified":
            return [CGROUP_ROOT / self.tag]
        return [CGROUP_ROOT / "systemd" / self.tag, CGROUP_ROOT / "unified" / self.tag]

    def node_cgroups(self, name: str) -> list[Path]:
        return [d / name for d in self.cgroup_dirs()]

    def add_node(self, name: str, binds: list[tuple[str, str]] = (), boot_timeout: float = 60) -> Node:
        """Boot a node on the next free address (10.77.0.11, .12, ...); `binds` add to the testbed's."""
        address = f"{SUBNET}.{11 + len(self.nodes)}"
        workdir = self.workdir / name
        (workdir / "scratch").mkdir(parents=True)
        netns = self._sleeper()
        node = Node(self, name, address, netns, workdir)
        self.nodes.append(node)
        veth = f"v-{name}"[:15]
        self.switch.ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(netns.pid))
        self.switch.ip("link", "set", veth, "master", "br0", "up")
        netns.ip("link", "set", "lo", "up")
        netns.ip("addr", "add", f"{address}/24", "dev", "eth0")
        netns.ip("link", "set", "eth0", "up")
        for cgroup in self.node_cgroups(name):
            cgroup.mkdir(parents=True, exist_ok=True)
        hosts = f"127.0.0.1 localhost\n::1 localhost\n{address} {name}\n{SWITCH_ADDRESS} switch\n"
        node.boot(self.binds + list(binds), hosts, boot_timeout)
        return node

    def in_switch(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a host command inside the switch's network namespace (it sees every node)."""
        return run_host("nsenter", "-t", str(self.switch.pid), "-n", *cmd, check=check, timeout=timeout)

    def close(self) -> None:
        """Power off every node, drop the namespaces, remove the cgroups and scratch dirs.
        Each step runs even when an earlier one failed."""
        errors = []
        for node in reversed(self.nodes):
            try:
                node.power_off()
            except Exception as exc:  # keep tearing down; report at the end
                errors.append(f"{node.name}: {exc!r}")
        for sleeper in reversed(self._sleepers):
            sleeper.stop()
        for cgroup in self.cgroup_dirs():
            _kill_cgroup(cgroup)
            _remove_cgroup(cgroup)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise TestbedError("teardown: " + "; ".join(errors))


# -------------------------------------------------------------------- host state


def host_state() -> dict:
    """What the testbed must leave exactly as it found it."""
    return {
        "mounts": sorted(_mounts()),
        "links": sorted(_links()),
        "routes": sorted(run_host("ip", "route", "show", "table", "all").stdout.splitlines()
                         + run_host("ip", "-6", "route", "show", "table", "all").stdout.splitlines()),
        "addresses": sorted(run_host("ip", "-o", "addr", "show").stdout.splitlines()),
        "cgroup_roots": _cgroup_roots(),
        "run_systemd": sorted(os.listdir("/run/systemd")) if os.path.isdir("/run/systemd") else None,
        "sysctls": _sysctls(),
    }


def _mounts() -> list[str]:
    out = []
    for line in _read("/proc/self/mountinfo").splitlines():
        fields = line.split()
        sep = fields.index("-")
        # mount point, options, fs type, source, super options (ids and peer groups vary)
        out.append(" ".join([fields[4], fields[5], fields[sep + 1], fields[sep + 2], fields[sep + 3]]))
    return out


def _links() -> list[str]:
    out = []
    for line in run_host("ip", "-o", "link", "show").stdout.splitlines():
        _idx, name, rest = line.split(":", 2)
        out.append(f"{name.strip()} {rest.split()[0]}")
    return out


def _cgroup_roots() -> dict[str, list[str]]:
    roots = {}
    for hierarchy in sorted(os.listdir(CGROUP_ROOT)) if CGROUP_ROOT.is_dir() else []:
        path = CGROUP_ROOT / hierarchy
        if path.is_dir() and not path.is_symlink():
            roots[hierarchy] = sorted(e.name for e in os.scandir(path)
                                      if e.is_dir(follow_symlinks=False) and not FOREIGN_CGROUP.match(e.name))
    return roots


def _sysctls() -> dict[str, str]:
    values = {}
    for dirpath, _dirs, files in os.walk("/proc/sys"):
        for name in files:
            path = os.path.join(dirpath, name)
            key = path[len("/proc/sys/"):].replace("/", ".")
            if key.startswith(VOLATILE_SYSCTLS):
                continue
            try:
                with open(path) as f:
                    values[key] = f.read()
            except OSError:
                continue
    return values


def diff_host_state(before: dict, after: dict) -> list[str]:
    """Human-readable differences; empty when the host is unchanged."""
    problems = []
    for key in before:
        a, b = before[key], after[key]
        if a == b:
            continue
        if isinstance(a, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    problems.append(f"{key}[{k}]: {a.get(k)!r} -> {b.get(k)!r}")
        elif isinstance(a, list):
            problems += [f"{key}: gone {x!r}" for x in a if x not in b]
            problems += [f"{key}: new {x!r}" for x in b if x not in a]
        else:
            problems.append(f"{key}: {a!r} -> {b!r}")
    return problems
