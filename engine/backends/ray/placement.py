"""Ray as the distributed backend, part 1: the cluster check and the placement group.

`dpserve serve --data-parallel-backend ray` runs each DP rank as a Ray actor
(ray_rank.py) in one bundle of a placement group. The supervisor never imports
Ray (its import and handshake cost a second of the node's start):

- `preflight`, in the supervisor before any child starts: a supported Ray is
  installed (package metadata), and the cluster's address answers a TCP
  connect within --ray-connect-timeout-s. Either failing is exit 2.
- the placement child (`RayPlacement`, kind "placement"; this module's entry
  point): connects (bounded by the same timeout), checks that the cluster's
  nodes can hold one bundle per rank under the placement strategy (exit 2
  naming what is missing, which ends the node's start with exit 2), reserves
  the placement group, says ready once every bundle is placed and heartbeats
  while it holds it. The group lives as long as this driver: Ray removes a
  job's placement groups when the job ends, and with them every actor placed
  in them, so a dead supervisor (PDEATHSIG) leaves nothing on the cluster.

Ray stays off the request path: requests go API server -> rank over the same
authenticated ZeroMQ channels as a native worker node's ranks.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading
import time

import msgspec
from dpserve.engine.common.procutil import EXIT_CONFIG, EXIT_OK, EXIT_STARTUP, SupervisorLink, start_child

RAY_REQUIREMENT = "ray>=2.60,<3"
INSTALL_HINT = "pip install 'dpserve[ray]'"
NAMESPACE = "dpserve"
# CLI name -> Ray's strategy. spread/pack are preferences; strict-* are requirements.
STRATEGIES = {"spread": "SPREAD", "strict-spread": "STRICT_SPREAD", "pack": "PACK", "strict-pack": "STRICT_PACK"}
# Ray's address file for `--ray-address auto` (what `ray start --head` writes)
RAY_CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"


class RayPlacement(msgspec.Struct, kw_only=True):
    name: str  # the child's name for the supervisor
    address: str
    group_name: str
    ranks: int
    cpus_per_rank: float
    gpus_per_rank: float  # < 0: auto (tensor_parallel_size when the cluster has GPUs, else 0)
    tensor_parallel_size: int
    strategy: str
    connect_timeout_s: float
    placement_timeout_s: float
    supervisor_address: str
    heartbeat_interval_s: float
    parent_pid: int
    log_level: str = "info"


class RayError(Exception):
    """A reason the Ray backend cannot start, for the operator (exit 2)."""


def ray_version_problem() -> str:
    """'' when a supported Ray is installed; otherwise what to do (package metadata only)."""
    from importlib import metadata

    try:
        version = metadata.version("ray")
    except metadata.PackageNotFoundError:
        return f"--data-parallel-backend ray needs Ray on this node: {INSTALL_HINT}"
    major, minor = (int(x) if x.isdigit() else 0 for x in (version.split(".") + ["0"])[:2])
    if (major, minor) < (2, 60) or major >= 3:
        return f"Ray {version} is installed; dpserve's Ray backend supports {RAY_REQUIREMENT}: {INSTALL_HINT}"
    return ""


def resolve_address(address: str) -> str:
    """host:port of the cluster's GCS: as given, or for 'auto' RAY_ADDRESS, then
    the address `ray start --head` left on this node."""
    if address.startswith("ray://"):
        # Ray Client proxies a remote driver; the ranks' proxies must be drivers on the cluster itself
        raise RayError(f"--ray-address {address}: Ray Client (ray://) is not supported; give the cluster's GCS address HOST:PORT (`ray start --head --port`)")
    if address and address != "auto":
        return address
    env = os.environ.get("RAY_ADDRESS", "")
    if env and env != "auto":
        return env
    try:
        with open(RAY_CURRENT_CLUSTER, encoding="utf-8") as f:
            found = f.read().strip()
    except OSError:
        found = ""
    if not found:
        raise RayError("no Ray cluster found: give --ray-address HOST:PORT (or RAY_ADDRESS), or start one with `ray start --head`")
    return found


def check_reachable(address: str, timeout_s: float) -> None:
    """A plain TCP connect to the GCS first: ray.init on a dead address retries for a long time."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RayError(f"--ray-address {address!r} is not HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RayError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} (is `ray start --head` running there?)") from None


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    spec = {"CPU": float(cpus)}
    if gpus > 0:
        spec["GPU"] = float(gpus)
    return spec


def _fits(capacity: dict[str, float], need: dict[str, float]) -> int:
    """How many bundles of `need` a node of `capacity` holds."""
    return min((math.floor(capacity.get(k, 0.0) / v + 1e-9) if v > 0 else sys.maxsize) for k, v in need.items())


def _fmt(spec: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in spec.items())


def placement_problem(nodes: list[dict[str, float]], need: dict[str, float], count: int, strategy: str) -> str:
    """Why `count` bundles of `need` cannot be placed on nodes of these total
    resources under `strategy` (a CLI name), or '' when they can."""
    per_node = [_fits(node, need) for node in nodes]
    what = f"{count} rank bundles of {{{_fmt(need)}}}"
    have = "; ".join(f"node {i}: {_fmt({k: node.get(k, 0.0) for k in need})}" for i, node in enumerate(nodes)) or "no alive nodes"
    if strategy == "strict-spread":
        able = sum(1 for n in per_node if n >= 1)
        if able < count:
            return f"--ray-placement strict-spread needs {count} nodes that each hold one of {what}; {able} can ({have})"
        return ""
    if strategy == "strict-pack":
        if max(per_node, default=0) < count:
            return f"--ray-placement strict-pack needs one node that holds all {what} ({have})"
        return ""
    if sum(per_node) < count:
        short = [k for k, v in need.items() if sum(node.get(k, 0.0) for node in nodes) < v * count]
        missing = ", ".join(f"{k}: needs {need[k] * count:g}, the cluster has {sum(node.get(k, 0.0) for node in nodes):g}" for k in short)
        return f"the Ray cluster cannot hold {what}" + (f" ({missing})" if missing else f" (no node fits enough of them: {have})")
    return ""


def connect(address: str, log_to_driver: bool, on_stop=None):
    """ray.init against an existing cluster, quietly; returns the ray module.

    Ray's core installs its own SIGTERM handler (a stack dump, then death); a
    child that must stop cleanly gets `on_stop` back as its handler afterwards."""
    import logging

    import ray

    ray.init(address=address, namespace=NAMESPACE, log_to_driver=log_to_driver, logging_level=logging.WARNING, configure_logging=True)
    if on_stop is not None:
        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
    return ray


def preflight(address: str, connect_timeout_s: float) -> str:
    """The supervisor's check before any child starts, without importing Ray:
    returns the cluster's HOST:PORT, or raises RayError (exit 2)."""
    problem = ray_version_problem()
    if problem:
        raise RayError(problem)
    resolved = resolve_address(address)
    check_reachable(resolved, connect_timeout_s)
    return resolved


def resources_problem(ray, cfg: RayPlacement) -> tuple[dict[str, float], str]:
    """The bundle to reserve (GPUs resolved) and why the cluster's alive nodes cannot hold them ('' if they can)."""
    totals = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    gpus = cfg.gpus_per_rank
    if gpus < 0:
        gpus = float(cfg.tensor_parallel_size) if any(t.get("GPU", 0) > 0 for t in totals) else 0.0
    need = bundle(cfg.cpus_per_rank, gpus)
    return need, placement_problem(totals, need, cfg.ranks, cfg.strategy)


def connect_bounded(address: str, timeout_s: float, log, on_stop=None, log_to_driver: bool = False, code: int = EXIT_CONFIG):
    """connect(), or exit with `code` if Ray's handshake has not finished in
    time: a cluster that accepts TCP but never answers must not hang a start."""

    def give_up() -> None:
        log.error("the Ray cluster did not complete the connection in time", address=address, timeout_s=timeout_s)
        os._exit(code)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        return connect(address, log_to_driver=log_to_driver, on_stop=on_stop)
    finally:
        timer.cancel()


def hold_placement(cfg: RayPlacement, log) -> int:
    """The placement child: reserve, say ready, hold until SIGTERM."""
    import zmq

    stop = []

    def on_stop(*_) -> None:
        stop.append(1)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    link = SupervisorLink(zmq.Context.instance(), cfg.supervisor_address, cfg.name)
    link.heartbeat()
    ray = connect_bounded(cfg.address, cfg.connect_timeout_s, log, on_stop=on_stop)
    from ray.util.placement_group import get_placement_group, placement_group, placement_group_table, remove_placement_group

    need, problem = resources_problem(ray, cfg)
    if problem:
        log.error("the Ray cluster cannot hold the ranks", problem=problem)
        ray.shutdown()
        return EXIT_CONFIG

    try:  # a previous holder of this node that was killed: its group goes with its job, but maybe not yet
        remove_placement_group(get_placement_group(cfg.group_name))
        log.info("removed the previous placement group of this node", group=cfg.group_name)
    except ValueError:
        pass
    pg = placement_group([dict(need) for _ in range(cfg.ranks)], strategy=STRATEGIES[cfg.strategy], name=cfg.group_name)
    started = time.monotonic()
    try:
        while not pg.wait(timeout_seconds=min(cfg.heartbeat_interval_s, 1.0)):
            link.heartbeat()
            if stop:
                return EXIT_OK
            if time.monotonic() - started > cfg.placement_timeout_s:
                free = ray.available_resources()
                log.error(
                    "the placement group could not be placed in time: the cluster's free resources do not hold it (held by other jobs?)",
                    group=cfg.group_name,
                    bundles=f"{cfg.ranks} x {{{_fmt(need)}}}",
                    strategy=cfg.strategy,
                    waited_s=cfg.placement_timeout_s,
                    free={k: free.get(k, 0.0) for k in need},
                )
                return EXIT_CONFIG
        nodes = placement_group_table(pg).get("bundles_to_node_id", {})
        log.info("placement group ready", group=cfg.group_name, bundles=cfg.ranks, strategy=cfg.strategy,
                 nodes=len(set(nodes.values())), seconds=round(time.monotonic() - started, 2))
        link.ready(cfg.group_name)
        while not stop:
            link.heartbeat()
            time.sleep(min(cfg.heartbeat_interval_s, 0.5))
        return EXIT_OK
    finally:
        try:
            remove_placement_group(pg)
        except Exception as exc:  # the cluster may be gone; Ray drops the group with this job anyway
            log.warning("could not remove the placement group", group=cfg.group_name, error=str(exc))
        ray.shutdown()
        link.close()


def main() -> None:
    cfg = start_child(RayPlacement, "dpserve-raypg")
    from dpserve.engine.common.logs import setup_logging

    log = setup_logging(cfg.name, cfg.log_level).bind(component=cfg.name)  # bound: Ray calls back on threads of its own
    try:
        code = hold_placement(cfg, log)
    except Exception as exc:
        log.error("cannot hold the placement group", error=f"{type(exc).__name__}: {exc}")
        code = EXIT_STARTUP
    os._exit(code)


if __name__ == "__main__":
    main()
