"""A control plane on simulated engines: the real coordinator and API servers, sim ranks.

Used by the simulated-engine tests (tests/integration/test_sim_cluster.py) and
the cluster-size benchmark (benchmarks/cluster_bench.py). It starts what a
head's supervisor would (the coordinator, N API servers sharing one port,
with their real configs through the child-config environment) plus
`dpserve.engine.testing.sim` processes of many ranks each, all on loopback / ipc.
No model and no torch anywhere: the API servers read only the demo
tokenizer. `stop()` ends every process it started, by pid, even after a
failure (use it as a context manager).

As a script (with the venv's Python) it starts such a cluster, prints its URL,
and serves until interrupted (or for --seconds):
    .venv/bin/python benchmarks/simcluster.py --ranks 64 --api-servers 4
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.config import ApiServerConfig, CoordinatorConfig  # noqa: E402
from dpserve.daemons.supervisor.launcher import LauncherConfig, LaunchReply, LaunchRequest  # noqa: E402
from dpserve.engine.common.codec import Codec, config_fingerprint
from dpserve.engine.common.procutil import CHILD_CONFIG_ENV, become_subreaper  # noqa: E402
from dpserve.engine.common.protocol import ChildReady, ToSupervisor  # noqa: E402
from dpserve.engine.testing.demo_model import write_tokenizer  # noqa: E402

from benchmarks.common import begin, parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 5.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def probe_json(path: str, route: str = "/readyz", timeout: float = 5.0) -> dict:
    """GET `route` on an API server's private probe socket."""
    conn = _UnixHTTP(path, timeout)
    try:
        conn.request("GET", route)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process used so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class _Adopted:
    """A forked API server adopted by this process (a child subreaper), with the
    part of Popen's interface the cluster uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode


class SimCluster:
    def __init__(
        self,
        num_ranks: int,
        num_api_servers: int = 2,
        ranks_per_process: int = 64,
        *,
        num_alone: int = 0,
        report_interval_s: float = 1.0,
        stale_after_s: float = 3.0,
        lb_policy: str = "tokens",
        decode_step_ms: float = 10.0,
        prefill_tokens_per_s: float = 50_000.0,
        max_waiting_per_rank: int = 4096,
        vary_load: bool = False,
        prefork: bool = False,
        run_dir: str | None = None,
        ranks_per_node: int = 8,
        node_heartbeat_s: float | None = None,
        max_num_seqs: int = 64,
        api_options: dict | None = None,
        monitors: bool = True,
        kv_cache_blocks: int = 0,
        rank_links: str = "direct",
    ) -> None:
        self.num_ranks = num_ranks
        self.num_api_servers = num_api_servers
        self.ranks_per_process = ranks_per_process
        self.num_alone = num_alone  # the last ranks, one process each: they can be lost alone
        self.report_interval_s = report_interval_s
        self.stale_after_s = stale_after_s
        self.lb_policy = lb_policy
        self.decode_step_ms = decode_step_ms
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.max_waiting_per_rank = max_waiting_per_rank
        self.vary_load = vary_load
        self.ranks_per_node = ranks_per_node  # simulated nodes: one NodeLoad each (0: one node a process)
        # a node's heartbeat: a quarter of the silence limit (changes still go within the report interval)
        self.node_heartbeat_s = stale_after_s / 4 if node_heartbeat_s is None else node_heartbeat_s
        self.max_num_seqs = max_num_seqs
        self.monitors = monitors  # False: simulated ranks keep no connection monitors (sim --no-monitors)
        self.kv_cache_blocks = kv_cache_blocks  # > 0: each rank a prefix cache of that many blocks, publishing KV events
        self.rank_links = rank_links  # node: ranks reach API servers through their simulated node's hop (sim --rank-links)
        self.api_options = api_options or {}  # other ApiServerConfig fields (e.g. admission's)
        # prefork: API servers forked from dpserve's launcher after one import, as
        # `dpserve serve` does by default (this process becomes a child subreaper)
        self.prefork = prefork
        self._launcher_sock: socket.socket | None = None
        self._tmp = None if run_dir else tempfile.TemporaryDirectory(prefix="dpsim-")
        self.run_dir = run_dir or self._tmp.name
        self.model_dir = write_tokenizer(os.path.join(self.run_dir, "tokenizer"))
        self.fingerprint = config_fingerprint("simulated", "none", 2048, num_ranks)
        self.procs: dict[str, subprocess.Popen] = {}
        self.sim_procs: list[str] = []
        self.listen: socket.socket | None = None
        self.ctx = zmq.Context()
        self.supervisor = self.ctx.socket(zmq.PULL)
        self.supervisor.setsockopt(zmq.LINGER, 0)
        self.supervisor_address = f"ipc://{self.run_dir}/supervisor.ctl"
        self.supervisor.bind(self.supervisor_address)
        self._sup_codec = Codec(ToSupervisor)
        self.ready: set[str] = set()
        self.started_at = 0.0

    # ---------------------------------------------------------------- processes

    @property
    def table_address(self) -> str:
        return f"ipc://{self.run_dir}/coordinator.table"

    @property
    def coordinator_address(self) -> str:
        return f"ipc://{self.run_dir}/coordinator.engines"

    def probe_path(self, i: int) -> str:
        return f"{self.run_dir}/api-{i}.http"

    @property
    def port(self) -> int:
        return self.listen.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _spawn(self, name: str, module: str, cfg: object | None, args: list[str] = (), pass_fds: tuple = ()) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        if cfg is not None:
            env[CHILD_CONFIG_ENV] = msgspec.json.encode(cfg).decode()
        log = open(os.path.join(self.run_dir, f"{name}.log"), "wb")
        try:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, *args], env=env, pass_fds=pass_fds, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    def start(self) -> SimCluster:
        self.started_at = time.monotonic()
        me = os.getpid()
        self.listen = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.listen.set_inheritable(True)
        coord = CoordinatorConfig(
            name="coordinator",
            lb_mode="internal",
            key_file="",
            engines_address=self.coordinator_address,
            table_address=self.table_address,
            supervisor_address=self.supervisor_address,
            data_parallel_size=self.num_ranks,
            fingerprint=self.fingerprint,
            heartbeat_interval_s=1.0,
            stale_after_s=self.stale_after_s,
            parent_pid=me,
            log_level="warning",
        )
        self._spawn("coordinator", "dpserve.daemons.coordinator.server", coord)
        for i in range(self.num_api_servers):
            api = ApiServerConfig(
                name=f"api-{i}",
                index=i,
                node_rank=0,
                coordinator_address=self.coordinator_address,
                eligible_ranks=list(range(self.num_ranks)),
                key_file="",
                model_dir=self.model_dir,
                served_model_name="sim",
                api_key=None,
                data_parallel_size=self.num_ranks,
                max_model_len=2048,
                lb_policy=self.lb_policy,
                max_waiting_per_rank=self.max_waiting_per_rank,
                max_request_body_bytes=1 << 20,
                shutdown_timeout_s=2.0,
                listen_fd=self.listen.fileno(),
                engine_address=f"ipc://{self.run_dir}/api-{i}.engines",
                table_address=coord.table_address,
                supervisor_address=self.supervisor_address,
                probe_path=self.probe_path(i),
                parent_pid=me,
                log_level="warning",
                wait_for_engine_s=1.0,
                request_first_token_timeout_s=30.0,
                max_num_seqs=self.max_num_seqs,
            )
            api = msgspec.structs.replace(api, **self.api_options)
            if self.prefork:
                self._fork_api(f"api-{i}", api)
            else:
                self._spawn(f"api-{i}", "dpserve.daemons.api.server", api, pass_fds=(self.listen.fileno(),))
        shared = self.num_ranks - self.num_alone
        for first in range(0, shared, self.ranks_per_process):
            self.start_sim(first, min(shared, first + self.ranks_per_process) - 1)
        for rank in range(shared, self.num_ranks):
            self.start_sim(rank, rank)
        return self

    def _start_launcher(self) -> None:
        become_subreaper()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = LauncherConfig(control_fd=theirs.fileno(), parent_pid=os.getpid(),
                             preload=["dpserve.daemons.api.server", "uvloop"], log_level="warning")
        self._spawn("launcher", "dpserve.daemons.supervisor.launcher", cfg, pass_fds=(theirs.fileno(),))
        theirs.close()
        ours.settimeout(60)
        if ours.recv(64) != b"ready":
            raise RuntimeError("the launcher did not start")
        self._launcher_sock = ours

    def _fork_api(self, name: str, cfg: ApiServerConfig) -> None:
        if self._launcher_sock is None:
            self._start_launcher()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        env[CHILD_CONFIG_ENV] = msgspec.json.encode(cfg).decode()
        req = LaunchRequest(name=name, module="dpserve.daemons.api.server", env=env,
                            target_fds=[1, 2, cfg.listen_fd], parent_pid=os.getpid())
        with open(os.path.join(self.run_dir, f"{name}.log"), "wb") as log:
            socket.send_fds(self._launcher_sock, [msgspec.json.encode(req)], [log.fileno(), log.fileno(), cfg.listen_fd])
        reply = msgspec.json.decode(self._launcher_sock.recv(1 << 16), type=LaunchReply)
        if not reply.pid:
            raise RuntimeError(f"launcher could not start {name}: {reply.error}")
        self.procs[name] = _Adopted(reply.pid)

    def start_sim(self, first: int, last: int) -> str:
        name = f"sim-{first}-{last}"
        args = [
            "--coordinator", self.coordinator_address, "--fingerprint", self.fingerprint, "--ranks", f"{first}-{last}",
            "--report-interval-s", str(self.report_interval_s), "--decode-step-ms", str(self.decode_step_ms),
            "--prefill-tokens-per-s", str(self.prefill_tokens_per_s), "--parent-pid", str(os.getpid()),
            "--ranks-per-node", str(self.ranks_per_node), "--max-num-seqs", str(self.max_num_seqs),
            "--node-heartbeat-s", str(self.node_heartbeat_s),
        ] + (["--vary-load"] if self.vary_load else []) + ([] if self.monitors else ["--no-monitors"]) \
            + (["--kv-cache-blocks", str(self.kv_cache_blocks)] if self.kv_cache_blocks else []) \
            + ["--rank-links", self.rank_links]
        self._spawn(name, "dpserve.engine.testing.sim", None, args)
        self.sim_procs.append(name)
        return name

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM everything, one deadline, SIGKILL survivors, reap."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._launcher_sock is not None:
            self._launcher_sock.close()
        if self.listen is not None:
            self.listen.close()
        self.ctx.destroy(linger=0)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> SimCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- observation

    def collect_ready(self) -> set[str]:
        """Children that reported ready to our stand-in supervisor socket."""
        while True:
            try:
                msg = self._sup_codec.decode_or_none(self.supervisor.recv(zmq.NOBLOCK))
            except zmq.Again:
                return self.ready
            if isinstance(msg, ChildReady):
                self.ready.add(msg.name)

    def routable_counts(self) -> list[int]:
        """Routable ranks as each API server sees them (-1: it does not answer yet)."""
        counts = []
        for i in range(self.num_api_servers):
            try:
                counts.append(len(probe_json(self.probe_path(i))["routable_ranks"]))
            except (OSError, ValueError, KeyError, http.client.HTTPException):
                counts.append(-1)
        return counts

    def wait_routable(self, expected: int, timeout: float, interval: float = 0.05) -> float:
        """Seconds since start() until every API server routes to `expected` ranks."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if all(c == expected for c in self.routable_counts()):
                return time.monotonic() - self.started_at
            time.sleep(interval)
        raise TimeoutError(f"routable ranks per API server after {timeout} s: {self.routable_counts()}")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and name not in self._expected_exits:
                log = Path(self.run_dir, f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")

    _expected_exits: set[str] = set()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self._expected_exits = self._expected_exits | {name}
        self.procs[name].send_signal(sig)
        self.procs[name].wait(10)

    def pids(self, prefix: str) -> list[int]:
        return [p.pid for n, p in self.procs.items() if n.startswith(prefix) and p.poll() is None]

    def rss_mib(self, prefix: str) -> list[float]:
        """Resident memory (MiB) of each live process whose name starts with `prefix`."""
        out = []
        for pid in self.pids(prefix):
            try:
                with open(f"/proc/{pid}/status") as f:
                    out += [int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")]
            except OSError:
                pass
        return out

    def start_table_relay(self) -> str:
        """A node's table relay (daemons/coordinator/table_relay.py): the local address to subscribe to."""
        local = f"ipc://{self.run_dir}/node.table"
        self._spawn("relay", "dpserve.daemons.coordinator.table_relay", None,
                    ["--upstream", self.table_address, "--bind", local, "--parent-pid", str(os.getpid())])
        return local

    def cpu(self, prefix: str) -> float:
        """CPU seconds used so far by the live processes whose name starts with `prefix`."""
        total = 0.0
        for pid in self.pids(prefix):
            try:
                total += cpu_seconds(pid)
            except OSError:
                pass
        return total


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--api-servers", type=int, default=2)
    p.add_argument("--ranks-per-process", type=int, default=64)
    p.add_argument("--lb-policy", default="tokens")
    p.add_argument("--decode-step-ms", type=float, default=10.0)
    p.add_argument("--prefork", action="store_true", help="fork the API servers from dpserve's launcher, as `dpserve serve` does")
    p.add_argument("--seconds", type=float, default=0.0, help="serve this long, then stop (0: until interrupted)")
    p.add_argument("--kv-cache-blocks", type=int, default=0, help="each rank a prefix cache of this many 16-token blocks, publishing KV events")
    args, run = begin(p, argv)
    cluster = SimCluster(args.ranks, args.api_servers, args.ranks_per_process, lb_policy=args.lb_policy,
                         decode_step_ms=args.decode_step_ms, prefork=args.prefork, kv_cache_blocks=args.kv_cache_blocks)
    with cluster:
        ready_s = cluster.wait_routable(args.ranks, timeout=120)
        run.log(f"{args.ranks} simulated ranks behind {args.api_servers} API servers at {cluster.url} (routable in {ready_s:.1f} s)")
        deadline = time.monotonic() + args.seconds if args.seconds else float("inf")
        try:
            while time.monotonic() < deadline:
                cluster.check_alive()
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            pass
    run.log("stopped")


if __name__ == "__main__":
    main()
