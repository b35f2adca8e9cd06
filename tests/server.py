"""Start and stop a real `dpserve serve` for tests: its own process group, port 0, deadlines.

Every server a test starts is stopped by that test (fixture finalizer or
`with`), by process group, even when the test fails; the node's child pids
are collected from /status so a test can prove none survived. Stopping also
removes the server's own temporary folder (ports file, log); its log stays
readable through log().
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

READY_TIMEOUT_S = float(os.environ.get("DPSERVE_TEST_READY_TIMEOUT_S", "180"))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 free on loopback right now (a node's rpc port and the ones after it)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n > 65000:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port run")


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")


def stream_request(port: int, max_tokens: int, result: dict, model: str = "demo", api_key: str | None = None) -> None:
    """One streamed completion (run it in a thread): records when it started, its finish
    reasons, any error event or exception, and whether [DONE] came."""
    body = json.dumps({"model": model, "prompt": "drain me", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers=headers)
    finishes, done = [], False
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            result["started"] = time.monotonic()
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        result["error"] = event["error"]
                    finishes += [c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")]
    except Exception as exc:  # recorded for the assertion, not swallowed
        result["exception"] = repr(exc)
    result["finishes"] = finishes
    result["done"] = done


# Journal priorities emerg..warning: the lines of a log that say something went wrong.
_WARNING_OR_WORSE = ("<0>", "<1>", "<2>", "<3>", "<4>")


def notable_lines(text: str, words: tuple[str, ...] = (), n: int = 40) -> list[str]:
    """The last `n` lines of a dpserve log (journal-prefixed) that are warnings or worse, or
    that hold one of `words` (lower case; a Python traceback's lines have no prefix)."""
    return [line for line in text.splitlines()
            if line[:3] in _WARNING_OR_WORSE or any(w in line.lower() for w in words)][-n:]


class DpServer:
    # Servers started and not yet stopped: a failing test's report shows their logs' tails (conftest.py).
    running: weakref.WeakSet[DpServer] = weakref.WeakSet()

    def __init__(
        self, model_dir: str, *args: str, env: dict | None = None, served_model_name: str | None = "demo", preexec_fn=None,
        python: str | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.python = python or sys.executable  # another venv's interpreter (the vLLM engine's)
        self.args = list(args)
        self.env = env
        self.preexec_fn = preexec_fn  # e.g. to start under a low RLIMIT_NOFILE
        self.model = served_model_name
        self.tmp = tempfile.mkdtemp(prefix="dpserve-test-")
        self.ports_file = os.path.join(self.tmp, "ports.json")
        self.log_path = os.path.join(self.tmp, "server.log")
        self.final_log = ""  # the log's text once stop() removed the folder
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.supervisor_port = 0
        self.child_pids: set[int] = set()

    # ---------------------------------------------------------------- lifecycle

    def start(self, wait_ready: bool = True) -> DpServer:
        cmd = [
            self.python, "-m", "dpserve.daemons.cli.main", "serve", self.model_dir,
            *(["--served-model-name", self.model] if self.model else []),
            "--port", "0",
            "--data-parallel-supervisor-port", "0",
            "--ports-file", self.ports_file,
            *self.args,
        ]
        env = {**os.environ, "DPSERVE_DIE_WITH_PARENT": "1", **(self.env or {})}
        os.makedirs(self.tmp, exist_ok=True)  # started again after a stop
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=self.preexec_fn
        )
        DpServer.running.add(self)
        try:
            wait_until(lambda: os.path.exists(self.ports_file) or self.proc.poll() is not None, 60, what="ports file")
            if self.proc.poll() is not None:
                raise RuntimeError(f"dpserve exited with {self.proc.returncode} before binding:\n{self.log()}")
            ports = json.loads(Path(self.ports_file).read_text())
            self.port, self.supervisor_port = ports["port"], ports["supervisor_port"]
            if wait_ready:
                self.wait_ready()
        except BaseException:
            self.kill_group()  # `with DpServer(...)` never reaches __exit__ when start() raises
            raise
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"dpserve exited with {self.proc.returncode} while starting:\n{self.log()}")
            try:
                return http_get(self.health_url + "/readyz", 2)[0] == 200
            except OSError:
                return False

        wait_until(ready, timeout, 0.1, "readiness")
        self.refresh_child_pids()

    def refresh_child_pids(self) -> None:
        status = self.status()
        self.child_pids |= {c["pid"] for c in status["children"] if c["pid"]}
        if (status.get("launcher") or {}).get("pid"):
            self.child_pids.add(status["launcher"]["pid"])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Stop the server; SIGKILL the whole group if it does not exit in time."""
        if self.proc is None:
            shutil.rmtree(self.tmp, ignore_errors=True)  # never started
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        DpServer.running.discard(self)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.child_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if not self._log.closed:
            self._log.close()
        self.final_log = self._read_log() or self.final_log
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> DpServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- views

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.supervisor_port}"

    def status(self) -> dict:
        code, body = http_get(self.health_url + "/status")
        assert code == 200, body
        return json.loads(body)

    def child(self, name: str) -> dict:
        return next(c for c in self.status()["children"] if c["name"] == name)

    def metrics(self) -> str:
        return http_get(self.url + "/metrics")[1].decode()

    def rank_finished(self) -> dict[int, float]:
        out = {}
        for line in self.metrics().splitlines():
            if line.startswith("dpserve_rank_requests_finished_total{"):
                rank = int(line.split('rank="')[1].split('"')[0])
                out[rank] = float(line.rsplit(" ", 1)[1])
        return out

    def log(self, limit: int | None = 20000) -> str:
        """The log's last `limit` characters (None: all of it)."""
        text = self._read_log() or self.final_log
        return text[-limit:] if limit else text

    def _read_log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
