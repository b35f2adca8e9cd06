"""What the supervisor boots before any child starts: the listening sockets it
owns (bound once, no SO_REUSEPORT, handed to every API server), the run
directory, its ZeroMQ sockets and relays, the child table and the prefork launcher."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from typing import TYPE_CHECKING

import msgspec
import psutil
import zmq
from dpserve.daemons.addresses import Addresses
from dpserve.daemons.supervisor.launcher import Launcher
from dpserve.daemons.supervisor.plan import (
    bind_listen_socket,
    check_rpc_ports,
    ephemeral_key_file,
    node_address_towards,
    plan_children,
    table_address,
    uses_table_relay,
)
from dpserve.daemons.supervisor.relays import LoadRelay, TableRelay, load_beat_s
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.config import resolve_max_model_len
from dpserve.engine.common.procutil import become_subreaper
from dpserve.engine.common.protocol import CoordinatorInput
from dpserve.engine.common.sockets import make_socket

if TYPE_CHECKING:
    from dpserve.daemons.supervisor.core import Supervisor

_enc = msgspec.json.Encoder().encode
# A private run directory is named after its supervisor's pid, so that the next start
# can remove one whose owner died without cleaning up (SIGKILL, a power cut in a
# persistent /tmp). Only names of this exact shape are ever touched.
RUN_DIR_PREFIX = "dpserve-run-"
_RUN_DIR = re.compile(re.escape(RUN_DIR_PREFIX) + r"([0-9]+)-[A-Za-z0-9_]{8}")


def _owner_alive(pid: int, dir_ctime: float) -> bool:
    """The directory's supervisor still runs: a process with its pid, not a zombie, that
    started before the directory last changed (a pid reused later is not the owner)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= dir_ctime + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # alive but unreadable: leave its directory
        return True


def sweep_run_dirs(tmp: str) -> list[str]:
    """Remove run directories in `tmp` that this user owns and whose supervisor is gone;
    returns their paths. A directory of a live supervisor, another user's, or a name of
    any other shape is left as it is."""
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        match = _RUN_DIR.fullmatch(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or _owner_alive(int(match.group(1)), st.st_ctime):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def prepare(sup: Supervisor) -> None:
    """Raises StartupError or ValueError when the node cannot start (exit 2 or 3)."""
    cfg = sup.cfg
    sup.max_model_len = resolve_max_model_len(cfg.model, cfg.max_model_len)
    if cfg.run_dir:
        os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
        sup.run_dir = cfg.run_dir
    else:
        for path in sweep_run_dirs(tempfile.gettempdir()):
            sup.log.info("removed the run directory of a supervisor that is gone", path=path)
        sup.run_dir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
        sup.own_run_dir = True
    ray = sup.ray_plan
    if ray is not None:
        sup.log.info("Ray cluster answers", address=ray.address, node_ip=ray.node_ip, placement=cfg.ray_placement)
        changes = {"data_parallel_address": cfg.data_parallel_address or ray.node_ip}
        if not cfg.key_file:
            changes["key_file"] = ephemeral_key_file(sup.run_dir)
        sup.cfg = cfg = msgspec.structs.replace(cfg, **changes)
    sup.keys = CurveKeys.from_file(cfg.key_file, sup.log) if cfg.key_file else None
    if cfg.runs_api_servers:
        count = cfg.api_server_count if cfg.lb_mode == "external" else 1
        # external LB: one port per local rank (port + i); otherwise one shared port
        sup.listen_socks = [bind_listen_socket(cfg.host, cfg.port + i if cfg.port else 0) for i in range(count)]
        sup.port = sup.listen_socks[0].getsockname()[1]
    sup.node_address = cfg.node_address or node_address_towards(cfg.data_parallel_address)
    check_rpc_ports(cfg, sup.node_address)
    sup.addr = Addresses.for_node(cfg, sup.run_dir, sup.node_address)
    # The control socket is node-local (ipc://): no CURVE.
    sup.ctl = make_socket(sup.zctx, zmq.PULL, bind=sup.addr.supervisor)
    sup.coord_link = make_socket(
        sup.zctx, zmq.DEALER, sup.keys, connect=sup.addr.coordinator_engines,
        identity=f"supervisor-{cfg.data_parallel_start_rank}".encode(),
    )
    sup.coord_codec = Codec(CoordinatorInput)
    start_relays(sup)
    # The cluster view's source: the load table every API server reads (cluster.py).
    sup.table_sub = make_socket(
        sup.zctx, zmq.SUB, sup.keys, connect=table_address(cfg, sup.addr), subscribe=b"", reconnect_ms=(100, 2000)
    )
    for child in plan_children(cfg, sup.addr, sup.listen_socks, sup.max_model_len, sup.heartbeat_interval_s, ray):
        sup.children[child.name] = child
    if any(c.kind == "api" for c in sup.children.values()) and cfg.api_server_launch == "prefork":
        if become_subreaper():
            sup.launcher = Launcher(os.getpid(), ["dpserve.daemons.api.server", "uvloop"], sup.log, cfg.log_level)
        else:
            sup.log.warning("cannot become a child subreaper; API servers start with exec")


def write_ports_file(path: str | None, port: int, supervisor_port: int) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_enc({"port": port, "supervisor_port": supervisor_port, "pid": os.getpid()}))
        os.replace(tmp, path)


def start_relays(sup: Supervisor) -> None:
    """The node's load relay, when it runs ranks of its own (not Ray's actors), and its
    table relay, when it runs enough API servers (supervisor/relays.py)."""
    cfg = sup.cfg
    if cfg.size_local and not cfg.uses_ray:
        stale_after_s = cfg.probe_interval_s * cfg.probe_failure_threshold
        sup.load_relay = LoadRelay(
            cfg.data_parallel_start_rank, sup.addr.node_loads, sup.addr.coordinator_engines, sup.keys,
            load_beat_s(sup.heartbeat_interval_s, stale_after_s), stale_after_s, sup.log,
        )
        sup.load_relay.start()
    if uses_table_relay(cfg):
        sup.table_relay = TableRelay(sup.addr.coordinator_table, sup.addr.node_table, sup.keys)
        sup.table_relay.start()
