"""What a node runs: its children and their configs, derived from one ServeConfig.

Pure planning (no process is started here), plus the few facts about the host
the plan needs: the model's identity, this node's address, the bound API port.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket

import msgspec
from dpserve.daemons.config import Addresses, ApiServerConfig, CoordinatorConfig, ServeConfig
from dpserve.daemons.supervisor.children import Child
from dpserve.engine.backends.ray.placement import RayError, RayPlacement, preflight
from dpserve.engine.backends.ray.rank import RayRank
from dpserve.engine.common.config import EngineConfig, EngineProcessConfig
from dpserve.engine.common.procutil import EXIT_CONFIG
from dpserve.engine.common.protocol import config_fingerprint

_enc = msgspec.json.Encoder().encode
# A rank proxy relays its actor's log lines (which carry dpserve's own priority
# and component) as they are: no Ray "(RankActor pid=..)" prefix, colours or dedup.
_RAY_DRIVER_ENV = {"OMP_NUM_THREADS": "1", "RAY_DISABLE_WORKER_LOG_PREFIX": "1", "RAY_COLOR_PREFIX": "0", "RAY_DEDUP_LOGS": "0"}


class StartupError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class RayPlan(msgspec.Struct, kw_only=True):
    """The Ray backend's facts for the plan: the cluster, this node's address, the group."""

    address: str  # the cluster's HOST:PORT
    node_ip: str  # this node's address on the route to the cluster (the ranks reach it there)
    group_name: str


def check_ray_cluster(cfg: ServeConfig) -> RayPlan:
    """Before any child starts: Ray installed, the cluster's address answering
    (engine/ray_placement.py's preflight; bounded by --ray-connect-timeout-s).
    Whether its nodes can hold the ranks is the placement child's first check."""
    try:
        address = preflight(cfg.ray_address, cfg.ray_connect_timeout_s)
    except RayError as exc:
        raise StartupError(EXIT_CONFIG, str(exc)) from None
    fingerprint = model_identity(cfg.model)[:8]
    return RayPlan(
        address=address,
        node_ip=node_address_towards(address.rpartition(":")[0].strip("[]")),
        group_name=f"dpserve-{fingerprint}-{socket.gethostname()}-{os.getpid()}",
    )


def ephemeral_key_file(run_dir: str) -> str:
    """Ray backend without --data-parallel-key-file: a fresh secret for this run
    (the ranks get it from the proxy; nothing else needs it), readable by us only."""
    path = os.path.join(run_dir, "ray-ranks.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def model_identity(model_dir: str) -> str:
    """What nodes must agree on about the model: its config.json, not its path."""
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def node_address_towards(head: str) -> str:
    """This node's address on the route to the head (no packet is sent)."""
    if head.startswith("127.") or head in ("localhost", "::1"):
        return head
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((head, 9))
        return probe.getsockname()[0]
    except OSError:
        return head
    finally:
        probe.close()


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind the API port once for every API server. No SO_REUSEPORT: a second
    instance on the same port fails here instead of silently splitting traffic."""
    try:
        sock = socket.create_server((host, port), backlog=4096, reuse_port=False)
    except OSError as exc:
        raise StartupError(EXIT_CONFIG, f"cannot bind {host}:{port}: {exc.strerror or exc} (is another server running on this port?)") from None
    sock.set_inheritable(True)
    return sock


def _port_in_use(host: str, port: int) -> str:
    """Why (host, port) cannot be listened on, or ''. SO_REUSEADDR as ZeroMQ sets
    it, so a port held only by closed connections (TIME_WAIT) counts as free."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def check_rpc_ports(cfg: ServeConfig, node_address: str) -> None:
    """Multi-node: the TCP ports this node's children will bind, checked before any
    starts, so a second head on a used rpc port or two nodes' API servers on one
    address is exit 2 naming the flag, not a child's traceback and exit 3."""
    if not cfg.uses_tcp:
        return
    wanted: list[tuple[str, int, str]] = []
    if cfg.runs_coordinator:
        rpc = cfg.data_parallel_rpc_port
        wanted += [(cfg.data_parallel_address, rpc, "--data-parallel-rpc-port"), (cfg.data_parallel_address, rpc + 1, "--data-parallel-rpc-port (+1)")]
    if cfg.runs_api_servers:
        base = cfg.api_rpc_port_base
        flag = "--data-parallel-api-rpc-port-base" + ("" if cfg.data_parallel_api_rpc_port_base else " (default: rpc-port+2)")
        if cfg.runs_coordinator and base <= cfg.data_parallel_rpc_port + 1 < base + cfg.api_server_count + 1:
            raise StartupError(EXIT_CONFIG, f"{flag} {base} overlaps the coordinator's ports {cfg.data_parallel_rpc_port}-{cfg.data_parallel_rpc_port + 1}")
        wanted += [(node_address, base + i, flag) for i in range(cfg.api_server_count)]
    for host, port, flag in wanted:
        why = _port_in_use(host, port)
        if why:
            raise StartupError(EXIT_CONFIG, f"cannot listen on {host}:{port}: {why} (another dpserve node on this address? choose another {flag})")


def plan_children(
    cfg: ServeConfig,
    addr: Addresses,
    listen_socks: list[socket.socket],
    max_model_len: int,
    heartbeat_interval_s: float,
    ray: RayPlan | None = None,
) -> list[Child]:
    """Every child this node runs, with its typed config: the coordinator (head
    only), one engine per local rank (the Ray backend: a proxy per rank and the
    placement child), and the API servers (unless headless)."""
    children: list[Child] = []
    fingerprint = config_fingerprint(model_identity(cfg.model), cfg.dtype, max_model_len, cfg.data_parallel_size, cfg.engine)
    me = os.getpid()
    key_file = os.path.abspath(cfg.key_file) if cfg.key_file else ""
    if cfg.runs_coordinator:
        coord = CoordinatorConfig(
            name="coordinator",
            lb_mode=cfg.lb_mode,
            key_file=key_file,
            engines_address=addr.coordinator_engines,
            table_address=addr.coordinator_table,
            supervisor_address=addr.supervisor,
            data_parallel_size=cfg.data_parallel_size,
            fingerprint=fingerprint,
            heartbeat_interval_s=heartbeat_interval_s,
            stale_after_s=cfg.probe_interval_s * cfg.probe_failure_threshold,
            parent_pid=me,
            log_level=cfg.log_level,
        )
        children.append(Child("coordinator", "coordinator", -1, "dpserve.daemons.coordinator.server", _enc(coord), extra_env={"OMP_NUM_THREADS": "1"}))
    # CPU ranks share the node's cores; oversubscribed torch threads stall each
    # other by orders of magnitude (a 4 ms step became 300-800 ms in tests).
    # The API servers need cores too: reserve one per API server, up to half the node.
    ncpu = len(os.sched_getaffinity(0))
    api_count = cfg.api_server_count if cfg.runs_api_servers else 0
    engine_threads = max(1, (ncpu - min(api_count, ncpu // 2)) // cfg.size_local)
    for rank in cfg.local_ranks:
        name = f"engine-dp{rank}"
        ecfg = EngineProcessConfig(
            name=name,
            engine=EngineConfig(
                model=cfg.model,
                rank=rank,
                dtype=cfg.dtype,
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=max_model_len,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                block_size=cfg.block_size,
                num_local_ranks=cfg.size_local,
                seed=cfg.seed,
                local_rank=rank - cfg.data_parallel_start_rank,
                engine=cfg.engine,
                tensor_parallel_size=cfg.tensor_parallel_size,
                enable_prefix_caching=cfg.enable_prefix_caching,
                engine_args=dict(cfg.engine_args),
            ),
            node_rank=cfg.data_parallel_start_rank,
            key_file=key_file,
            coordinator_address=addr.coordinator_engines,
            supervisor_address=addr.supervisor,
            fingerprint=fingerprint,
            heartbeat_interval_s=heartbeat_interval_s,
            parent_pid=me,
            log_level=cfg.log_level,
        )
        if ray is None:
            children.append(Child(name, "engine", rank, "dpserve.engine.rank.process", _enc(ecfg), extra_env={"OMP_NUM_THREADS": str(engine_threads)}))
            continue
        proxy = RayRank(
            engine=msgspec.structs.replace(ecfg, key_file=""),
            address=ray.address,
            group_name=ray.group_name,
            key_file=key_file,
            connect_timeout_s=cfg.ray_connect_timeout_s,
            placement_timeout_s=cfg.ray_placement_timeout_s + cfg.ray_connect_timeout_s,
            stop_timeout_s=max(cfg.kill_grace_s - 1.0, 0.5),
            supervisor_address=addr.supervisor,
            parent_pid=me,
            log_level=cfg.log_level,
        )
        children.append(Child(name, "engine", rank, "dpserve.engine.backends.ray.rank", _enc(proxy), extra_env=_RAY_DRIVER_ENV))
    if ray is not None:
        holder = RayPlacement(
            name="ray-placement",
            address=ray.address,
            group_name=ray.group_name,
            ranks=cfg.data_parallel_size,
            cpus_per_rank=cfg.ray_cpus_per_rank,
            gpus_per_rank=cfg.ray_gpus_per_rank,
            tensor_parallel_size=cfg.tensor_parallel_size,
            strategy=cfg.ray_placement,
            connect_timeout_s=cfg.ray_connect_timeout_s,
            placement_timeout_s=cfg.ray_placement_timeout_s,
            supervisor_address=addr.supervisor,
            heartbeat_interval_s=heartbeat_interval_s,
            parent_pid=me,
            log_level=cfg.log_level,
        )
        children.append(Child("ray-placement", "placement", -1, "dpserve.engine.backends.ray.placement", _enc(holder), extra_env={"OMP_NUM_THREADS": "1"}))
    if not cfg.runs_api_servers:
        return children
    external = cfg.lb_mode == "external"
    for i in range(cfg.api_server_count):
        name = f"api-{i}"
        sock = listen_socks[i if external else 0]
        fd = sock.fileno()
        acfg = ApiServerConfig(
            name=name,
            index=i,
            node_rank=cfg.data_parallel_start_rank,
            coordinator_address=addr.coordinator_engines,
            eligible_ranks=[cfg.data_parallel_start_rank + i] if external else cfg.eligible_ranks(),
            key_file=key_file,
            model_dir=cfg.model,
            served_model_name=cfg.served_model_name,
            api_key=cfg.api_key,
            data_parallel_size=cfg.data_parallel_size,
            max_model_len=max_model_len,
            lb_policy=cfg.lb_policy,
            max_waiting_per_rank=cfg.max_waiting_per_rank,
            max_request_body_bytes=cfg.max_request_body_bytes,
            wait_for_engine_s=cfg.wait_for_engine_s,
            request_first_token_timeout_s=cfg.request_first_token_timeout_s,
            http_idle_timeout_s=cfg.http_idle_timeout_s,
            http_body_timeout_s=cfg.http_body_timeout_s,
            http_max_connections=cfg.http_max_connections,
            shutdown_timeout_s=cfg.shutdown_timeout_s,
            listen_fd=fd,
            engine_address=addr.api_engines[i],
            table_address=addr.coordinator_table,
            supervisor_address=addr.supervisor,
            probe_path=addr.api_probes[i],
            parent_pid=me,
            log_level=cfg.log_level,
        )
        child = Child(
            name,
            "api",
            i,
            "dpserve.daemons.api.server",
            _enc(acfg),
            pass_fds=(fd,),
            port=sock.getsockname()[1],
            probe_path=addr.api_probes[i],
            extra_env={"OMP_NUM_THREADS": "1"},
        )
        children.append(child)
    return children
