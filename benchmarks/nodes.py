"""Servers the benchmarks start, measure and stop: dpserve nodes and vLLM.

Run with the venv's Python; this module is a library (benchmarks/common.py has
the shared preamble). Owns process lifecycles (own session per server, loopback only, ports from the
kernel), readiness timing, and the psutil view of each server's API-server
processes (CPU seconds, RSS). Every process started here is stopped by
process group, even when the benchmark fails; nothing here asserts figures.
"""

from __future__ import annotations

import asyncio
import atexit
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The preamble's helpers are imported from here too (profile_api.py, hotpath_bench.py).
from benchmarks.common import (  # noqa: E402, F401
    DEFAULT_VLLM_VENV,
    ROOT,
    ensure_demo_model,
    exit_on_sigterm,
    fmt,
    load_average,
    machine_info,
    ratio,
    render,
    vllm_python,
)
from benchmarks.load import LoadConfig, LoadResult, run_load  # noqa: E402

SERVED_MODEL = "demo"
# vLLM's fastest single-node configuration on the 2-core machine (ANCHORS.md).
VLLM_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


_LIVE: set[Server] = set()  # spawned and not yet stopped


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_LIVE):
        server.stop(timeout=5)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def code_tree_env(tree: str, into: str | None = None) -> dict:
    """Env that makes `import dpserve.*` load `tree`'s engine/ and daemons/ instead of
    the installed (editable) ones: a dpserve/{engine,daemons} shim first on PYTHONPATH,
    which the import system searches before the editable finder. `tree` is any folder
    holding engine/ and daemons/, e.g. `git archive HEAD engine daemons | tar -x -C DIR`."""
    tree = os.path.abspath(tree)
    for sub in ("engine", "daemons"):
        if not os.path.isfile(os.path.join(tree, sub, "__init__.py")):
            raise ValueError(f"{tree} has no {sub}/__init__.py: not a dpserve source tree")
    into = into or tempfile.mkdtemp(prefix="dpserve-code-")
    pkg = os.path.join(into, "dpserve")
    os.makedirs(pkg, exist_ok=True)
    for sub in ("engine", "daemons"):
        link = os.path.join(pkg, sub)
        if not os.path.islink(link):
            os.symlink(os.path.join(tree, sub), link)
    extra = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": into + (os.pathsep + extra if extra else "")}


# ----------------------------------------------------------------- processes


def _cpu_seconds(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _rss_mb(procs: Sequence[psutil.Process]) -> list[float]:
    out = []
    for p in procs:
        try:
            out.append(p.memory_info().rss / 2**20)
        except psutil.Error:
            pass
    return out


class Server:
    """A server in its own session; subclasses say how to start and find its API processes."""

    name = "server"

    def __init__(self, env: dict | None = None, log_dir: str | None = None) -> None:
        self.env = env or {}
        self.tmp = tempfile.mkdtemp(prefix=f"{self.name}-bench-", dir=log_dir)
        self.log_path = os.path.join(self.tmp, "server.log")
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.ready_s: float | None = None
        self._log = None
        self._t0 = 0.0
        self._known: dict[int, float] = {}  # pid -> create time, of every process seen in the tree
        self.keep_logs = bool(os.environ.get("DPSERVE_BENCH_KEEP_LOGS"))  # else removed on stop, unless start failed

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def spawn(self) -> None:
        env = {**os.environ, **self.env}
        self._log = open(self.log_path, "wb")
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.tmp)
        _LIVE.add(self)

    def is_ready(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> float:
        """Seconds from spawn to ready; raises RuntimeError if it exits or times out."""
        deadline = self._t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.keep_logs = True
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if self.is_ready():
                    self.ready_s = time.monotonic() - self._t0
                    self._remember_pids()
                    return self.ready_s
            except OSError:
                pass
            time.sleep(0.05)
        self.keep_logs = True
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def start(self, timeout: float = 300.0) -> Server:
        self.spawn()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _remember_pids(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self._known[p.pid] = p.create_time()
        except psutil.Error:
            pass

    def api_processes(self) -> list[psutil.Process]:
        raise NotImplementedError

    def all_processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the group, wait against one deadline, SIGKILL what is left, reap."""
        if self.proc is None:
            return
        _LIVE.discard(self)
        self._remember_pids()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid, created in self._known.items():  # children that left the group (none should) go too
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:  # not a recycled pid
                    p.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self._log is not None and not self._log.closed:
            self._log.close()
        if not self.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class DpNode(Server):
    """`dpserve serve` on port 0; ready when the supervisor's /readyz says 200."""

    name = "dpserve"

    def __init__(self, model_dir: str, dp: int = 1, api: int = 1, extra: Sequence[str] = (),
                 env: dict | None = None, log_dir: str | None = None, *, python: str | None = None) -> None:
        super().__init__(env, log_dir)
        self.model_dir = model_dir
        self.python = python or sys.executable  # another venv's interpreter, e.g. vLLM's for --engine vllm
        self.dp, self.api = dp, api
        self.extra = list(extra)
        self.ports_file = os.path.join(self.tmp, "ports.json")
        self.supervisor_port = 0
        self.label = f"dpserve dp{dp}/api{api}"

    def command(self) -> list[str]:
        return [self.python, "-m", "dpserve.daemons.cli.main", "serve", self.model_dir,
                "--served-model-name", SERVED_MODEL, "--port", "0",
                "--data-parallel-supervisor-port", "0", "--ports-file", self.ports_file,
                "--data-parallel-size", str(self.dp), "--api-server-count", str(self.api),
                "--run-dir", os.path.join(self.tmp, "run"), *self.extra]

    def is_ready(self) -> bool:
        if not self.supervisor_port:
            if not os.path.exists(self.ports_file):
                return False
            ports = json.loads(Path(self.ports_file).read_text())
            self.port, self.supervisor_port = ports["port"], ports["supervisor_port"]
        return http_get(f"http://127.0.0.1:{self.supervisor_port}/readyz", 2)[0] == 200

    def status(self) -> dict:
        code, body = http_get(f"http://127.0.0.1:{self.supervisor_port}/status")
        if code != 200:
            raise RuntimeError(f"/status answered {code}")
        return json.loads(body)

    def api_processes(self) -> list[psutil.Process]:
        out = []
        for child in self.status()["children"]:
            if child["kind"] == "api" and child["pid"]:
                try:
                    out.append(psutil.Process(child["pid"]))
                except psutil.Error:
                    pass
        return out


class BaselineNode(Server):
    """benchmarks/baseline_aiohttp.py: the bare-aiohttp ceiling (parse the body, fixed answer)."""

    name = "baseline"
    label = "bare aiohttp"

    def command(self) -> list[str]:
        return [sys.executable, str(ROOT / "benchmarks" / "baseline_aiohttp.py"), "--host", "127.0.0.1", "--port", "0"]

    def is_ready(self) -> bool:
        if not self.port:
            for line in self.log_tail(2000).splitlines():
                if line.startswith("listening on http://"):
                    self.port = int(line.rsplit(":", 1)[1])
            if not self.port:
                return False
        return http_get(self.url + "/v1/models", 2)[0] == 200

    def api_processes(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid)]


class VllmNode(Server):
    """`vllm serve` (CPU build) in its own venv; ready when /health and /v1/models answer 200."""

    name = "vllm"

    def __init__(self, venv: str, model_dir: str, api: int = 1, max_model_len: int = 512,
                 dtype: str = "bfloat16", extra: Sequence[str] = (), env: dict | None = None,
                 log_dir: str | None = None) -> None:
        super().__init__({**VLLM_ENV, **(env or {})}, log_dir)
        self.venv = venv
        self.model_dir = model_dir
        self.api = api
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.extra = list(extra)
        self.label = f"vllm uni/api{api}"

    def command(self) -> list[str]:
        self.port = free_port()
        return [os.path.join(self.venv, "bin", "vllm"), "serve", self.model_dir,
                "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
                "--distributed-executor-backend", "uni", "--api-server-count", str(self.api),
                *self.extra]

    def is_ready(self) -> bool:
        return (http_get(self.url + "/health", 2)[0] == 200
                and http_get(self.url + "/v1/models", 2)[0] == 200)

    def api_processes(self) -> list[psutil.Process]:
        """The processes that serve HTTP: the ones listening on the port.

        `vllm serve` runs its engine core in a process of its own (VLLM::EngineCore)
        even with VLLM_ENABLE_V1_MULTIPROCESSING=0, so these hold no model work;
        engine_separate says whether that held for this run."""
        out = []
        for p in self.all_processes():
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                       for c in p.net_connections(kind="tcp")):
                    out.append(p)
            except psutil.Error:
                pass
        # The parent that bound the port for its API-server children also
        # listens on it but serves nothing when there are several children.
        if self.api > 1 and len(out) > self.api:
            out = [p for p in out if p.pid != self.proc.pid]
        return out

    @property
    def engine_separate(self) -> bool:
        api = {p.pid for p in self.api_processes()}
        for p in self.all_processes():
            try:
                if p.pid not in api and "EngineCore" in p.name():
                    return True
            except psutil.Error:
                pass
        return False


# ----------------------------------------------------------------- measuring


@dataclass
class Measured:
    """One load run against one server, with the server's API-process CPU and RSS."""

    label: str
    result: LoadResult
    api_cpu_s_per_s: float | None = None  # CPU seconds per wall second, all API processes
    api_cpu_us_per_req: float | None = None
    api_rss_mb: list[float] = field(default_factory=list)
    loadavg: str = ""
    bystander_cpu_s_per_s: float | None = None  # CPU of other servers left running meanwhile
    extra: dict = field(default_factory=dict)  # a script's own figures for this run

    def to_dict(self) -> dict:
        return {"label": self.label, "extra": self.extra, "api_cpu_s_per_s": self.api_cpu_s_per_s,
                "api_cpu_us_per_req": self.api_cpu_us_per_req, "api_rss_mb": self.api_rss_mb,
                "loadavg": self.loadavg, "bystander_cpu_s_per_s": self.bystander_cpu_s_per_s,
                "result": self.result.to_dict()}


async def measure(server: Server, cfg: LoadConfig, label: str = "",
                  bystanders: Sequence[Server] = ()) -> Measured:
    """run_load against `server` while sampling its API processes' CPU over the
    measurement window. CPU per request = (CPU s per wall s) / (req per wall s):
    both are rates over nearly the same window, so a slightly misaligned edge
    costs nothing. `bystanders` (servers left running meanwhile) have all their
    processes' CPU sampled over the same window, to show any interference."""
    procs = server.api_processes()
    others = [p for b in bystanders for p in b.all_processes()]
    task = asyncio.ensure_future(run_load(cfg))
    cpu_rate = other_rate = None
    try:
        await asyncio.sleep(max(0.0, cfg.warmup))
        if not task.done():
            c0, o0, t0 = _cpu_seconds(procs), _cpu_seconds(others), time.perf_counter()
            await asyncio.sleep(max(0.1, (cfg.duration or 10.0) - 0.05))
            c1, o1, t1 = _cpu_seconds(procs), _cpu_seconds(others), time.perf_counter()
            cpu_rate = (c1 - c0) / (t1 - t0)
            other_rate = (o1 - o0) / (t1 - t0) if others else None
        result = await task
    finally:
        if not task.done():
            task.cancel()
    m = Measured(label or getattr(server, "label", server.name), result, cpu_rate,
                 api_rss_mb=[round(x, 1) for x in _rss_mb(procs)], loadavg=load_average(),
                 bystander_cpu_s_per_s=other_rate)
    if cpu_rate is not None and result.req_per_s > 0:
        m.api_cpu_us_per_req = cpu_rate / result.req_per_s * 1e6
    return m


def measure_sync(server: Server, cfg: LoadConfig, label: str = "", bystanders: Sequence[Server] = ()) -> Measured:
    from benchmarks.load import _new_loop

    loop = _new_loop()
    try:
        return loop.run_until_complete(measure(server, cfg, label, bystanders))
    finally:
        loop.close()


if __name__ == "__main__":
    from benchmarks.common import parser

    parser(__doc__, prog="benchmarks/nodes.py").parse_args()
    print(__doc__)
