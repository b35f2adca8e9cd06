"""The prefork launcher: API servers forked from a process that already imported them.

An API server spends most of its start importing (aiohttp, zmq, tokenizers,
jinja2, msgspec, structlog: about 0.4-0.7 CPU-s); eight of them on a small
node take that CPU from the engines loading their models, which are the
node's critical path. The launcher pays the imports once: the supervisor
starts it beside the engines, and each API server is then a fork of it
(a few ms) that reads its own config, descriptors and environment.

Each launch forks twice. The middle process exits at once, so the API
server is re-parented to the supervisor (a child subreaper) and is its
child like any other: reaped with waitpid, signalled by pid, and killed by
PDEATHSIG if the supervisor dies. A launcher that dies takes no API server
with it. The launcher holds no threads, no event loop and no socket but its
control channel, which is what makes forking it safe.

Protocol, over a SOCK_SEQPACKET socketpair, one datagram each way:
  launcher -> supervisor   b"ready" once the imports are done
  supervisor -> launcher   LaunchRequest (JSON) + fds [stdout, stderr, *pass_fds]
  launcher -> supervisor   LaunchReply (JSON): the API server's pid, or why not
The launcher exits when the supervisor closes its end.

A launcher keeps the code it imported: a rolling restart (SIGHUP) starts a
new launcher first, so upgraded code on disk reaches the new API servers.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import sys
import time

import msgspec
import psutil

_READY = b"ready"
_MAX_FDS = 8
_ADOPT_WAIT_S = 2.0


class LaunchRequest(msgspec.Struct, kw_only=True):
    name: str
    module: str  # the module whose main() the forked process runs
    env: dict[str, str]  # the whole environment the process gets (as exec would)
    target_fds: list[int]  # where each passed fd must land: [1, 2, *pass_fds]
    parent_pid: int  # the supervisor, which must adopt the process


class LaunchReply(msgspec.Struct, kw_only=True):
    pid: int = 0
    error: str = ""


class LauncherConfig(msgspec.Struct, kw_only=True):
    control_fd: int
    parent_pid: int
    preload: list[str]  # modules imported before the first fork
    log_level: str = "info"


# ==================================================================== launcher process


def _launch(sock: socket.socket, req: LaunchRequest, fds: list[int]) -> int:
    """Fork twice; returns the grandchild's pid once its middle parent has exited."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the API server, say its pid, vanish
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _become(sock, req, fds)  # never returns
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    os.waitpid(middle, 0)  # after this, the grandchild is the supervisor's
    if not data:
        raise OSError("the middle process died before forking")
    return int(data)


def _become(sock: socket.socket, req: LaunchRequest, fds: list[int]) -> None:
    """In the grandchild: take the supervisor as parent, the given fds and env, run main()."""
    code = 1
    try:
        deadline = time.monotonic() + _ADOPT_WAIT_S
        while os.getppid() != req.parent_pid:  # the middle process is exiting
            if time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.0005)
        sock.close()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        # Move the received fds out of the way (above every target, so no dup2 below
        # lands on one), then onto their target numbers. No fixed floor such as 1024:
        # under a soft RLIMIT_NOFILE of 1,024 that is EINVAL.
        floor = max(req.target_fds) + 1
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
        for fd in fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for src, target in zip(high, req.target_fds):
            os.dup2(src, target)  # inheritable, like pass_fds
            os.close(src)
        keep = {0, 1, 2, *req.target_fds}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.environ.clear()
        os.environ.update(req.env)
        module = sys.modules.get(req.module) or __import__(req.module, fromlist=["main"])
        module.main()  # ends in os._exit
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def main() -> None:
    from dpserve.engine.common.logs import setup_logging
    from dpserve.engine.common.procutil import child_config_from_env, die_with_parent, set_process_name

    cfg = child_config_from_env(LauncherConfig)
    die_with_parent(cfg.parent_pid)
    set_process_name("dpserve-launch")
    log = setup_logging("launcher", cfg.log_level)
    # The supervisor stops us by closing the channel, after its API servers: a signal to
    # the whole group (Ctrl-C, `kill -- -PGID`, KillMode=control-group) must not end us first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    started = time.monotonic()
    for name in cfg.preload:
        try:
            __import__(name)
        except ImportError as exc:  # optional speedups (uvloop); the child copes
            log.debug("preload skipped", module=name, error=str(exc))
    sock = socket.socket(fileno=cfg.control_fd)
    sock.setblocking(True)
    log.debug("launcher ready", preloaded=cfg.preload, seconds=round(time.monotonic() - started, 3))
    sock.send(_READY)
    decode = msgspec.json.Decoder(LaunchRequest).decode
    encode = msgspec.json.Encoder().encode
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, _MAX_FDS)
        except (ConnectionError, OSError):
            break
        if not data:
            break  # the supervisor closed its end
        try:
            req = decode(data)
            if len(fds) != len(req.target_fds):
                raise ValueError(f"{len(fds)} fds for {len(req.target_fds)} targets")
            reply = LaunchReply(pid=_launch(sock, req, fds))
        except Exception as exc:
            reply = LaunchReply(error=f"{type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(encode(reply))
    os._exit(0)


# ==================================================================== supervisor side


class AdoptedProcess:
    """A forked API server, now the supervisor's child: the part of
    asyncio.subprocess.Process the supervisor uses (pid, returncode, wait,
    stdout/stderr readers), reaped through a pidfd."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._pidfd = os.pidfd_open(pid)
        self._loop.add_reader(self._pidfd, self._poll)
        self._poll()  # it may have exited already

    def _poll(self) -> None:
        if self._done.done():
            return
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: the status is lost
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._done.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


def reap_strays(known: set[int]) -> list[tuple[int, int]]:
    """Reap zombies re-parented to us (a subreaper) that we never started.

    Only zombies whose pid is not in `known` are touched, so no status that
    asyncio's child watcher or an AdoptedProcess waits for is taken.
    Returns (pid, returncode) of each one reaped.
    """
    reaped = []
    try:
        children = psutil.Process().children()  # every thread's children, as /proc lists them
    except psutil.Error:
        return reaped
    for proc in children:
        if proc.pid in known:
            continue
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                continue
            wpid, status = os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.Error, OSError):
            continue
        if wpid:
            reaped.append((proc.pid, os.waitstatus_to_exitcode(status)))
    return reaped


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
    return reader


class Launcher:
    """The supervisor's handle on its launcher process: start, launch, stop.

    launch() returns None whenever the launcher cannot do it (not started,
    not ready in time, died, refused): the caller then starts the process the
    ordinary way, with exec. A launcher that failed is not retried until
    restart() is called.
    """

    def __init__(self, parent_pid: int, preload: list[str], log, log_level: str = "info") -> None:
        self.parent_pid = parent_pid
        self.preload = preload
        self.log = log
        self.log_level = log_level
        self.proc: asyncio.subprocess.Process | None = None
        self.sock: socket.socket | None = None
        self._ready: asyncio.Future | None = None
        self._lock = asyncio.Lock()
        self.launches_in_flight = 0
        self.failed = False
        self.stopping = False  # the node is stopping: losing the launcher is expected, not a warning

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def as_dict(self) -> dict:
        ready = self._ready is not None and self._ready.done() and not self._ready.cancelled() and self._ready.result()
        alive = self.proc is not None and self.proc.returncode is None
        state = "failed" if self.failed else "ready" if ready and alive else "starting" if alive else "stopped"
        return {"pid": self.pid if alive else None, "state": state}

    async def start(self, log_stream) -> None:
        from dpserve.daemons.supervisor.children import pump
        from dpserve.engine.common.procutil import CHILD_CONFIG_ENV

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = LauncherConfig(control_fd=theirs.fileno(), parent_pid=self.parent_pid, preload=self.preload, log_level=self.log_level)
        env = {**os.environ, CHILD_CONFIG_ENV: msgspec.json.encode(cfg).decode()}
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(theirs.fileno(),), close_fds=True,
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.failed = False
        asyncio.create_task(pump(self.proc.stdout, "launcher", b"<6>", log_stream))
        asyncio.create_task(pump(self.proc.stderr, "launcher", b"<4>", log_stream))
        self._ready = asyncio.ensure_future(self._wait_ready(ours))
        asyncio.create_task(self._watch(self.proc))

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Say when the launcher dies, as it happens (not at the next API-server start)."""
        from dpserve.engine.common.procutil import describe_exit

        rc = await proc.wait()
        if self.proc is proc:  # not stopped by us (stop() lets go of it first)
            self._give_up(f"the launcher (pid {proc.pid}) exited: {describe_exit(rc)}")

    async def _wait_ready(self, sock: socket.socket) -> bool:
        loop = asyncio.get_running_loop()
        try:
            return await loop.sock_recv(sock, 64) == _READY
        except OSError:
            return False

    async def launch(self, name: str, module: str, env: dict[str, str], pass_fds: tuple[int, ...], timeout: float = 30.0) -> AdoptedProcess | None:
        if self.sock is None or self._ready is None or self.failed:
            return None
        self.launches_in_flight += 1
        try:
            try:
                ready = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
            except asyncio.TimeoutError:
                ready = False
            if not ready:
                return self._give_up("the launcher did not become ready")
            async with self._lock:
                return await self._launch_locked(name, module, env, pass_fds, timeout)
        finally:
            self.launches_in_flight -= 1

    async def _launch_locked(self, name, module, env, pass_fds, timeout) -> AdoptedProcess | None:
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        req = LaunchRequest(name=name, module=module, env=env, target_fds=[1, 2, *pass_fds], parent_pid=self.parent_pid)
        pid, why = 0, ""
        try:
            socket.send_fds(self.sock, [msgspec.json.encode(req)], [out_w, err_w, *pass_fds])
            raw = await asyncio.wait_for(loop.sock_recv(self.sock, 4096), timeout)
            reply = msgspec.json.decode(raw, type=LaunchReply) if raw else None
            if reply is None:
                why = "the launcher exited"
            elif reply.error or not reply.pid:
                why = f"the launcher refused: {reply.error}"
            else:
                pid = reply.pid
        except (OSError, asyncio.TimeoutError) as exc:
            why = f"launch failed: {type(exc).__name__}: {exc}"
        finally:
            os.close(out_w)
            os.close(err_w)
        if pid:
            try:
                # Ours only if re-parenting reached us (WNOWAIT: an early exit stays reapable).
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                why = "the launched process is not our child (no subreaper?)"
        if not why:
            stdout, stderr = await _pipe_reader(out_r), await _pipe_reader(err_r)  # they own the fds now
            try:
                return AdoptedProcess(pid, stdout, stderr)
            except OSError as exc:  # no pidfd_open (Linux < 5.3): exec from now on
                why = f"cannot watch the launched process: {exc}"
        else:
            os.close(out_r)
            os.close(err_r)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)  # reaped as a stray
            except ProcessLookupError:
                pass
        return self._give_up(why)

    def _give_up(self, why: str) -> None:
        if self.stopping:
            self.log.info("prefork launcher gone while the node stops", reason=why)
        elif not self.failed:
            self.log.warning("prefork launcher unavailable; starting API servers with exec", reason=why)
        self.failed = True
        return None

    async def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        async with self._lock:  # never close the channel under a launch waiting for its reply
            sock, proc = self.sock, self.proc
            self.sock = self.proc = None
            if sock is not None:
                sock.close()  # the launcher reads EOF and exits
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()

    async def restart(self, log_stream) -> None:
        await self.stop()
        self.stopping = False
        await self.start(log_stream)


if __name__ == "__main__":
    main()
