"""Ray as the distributed backend, part 2: a DP rank as a Ray actor.

The supervisor's child for rank r (kind "engine", as a local rank would be) is
a small Ray driver, the rank's proxy. It creates the rank's actor in bundle r
of the node's placement group (ray_placement.py); the actor runs the very
EngineProcess a local rank runs, on a thread of its own, and reaches the
coordinator and the API servers over the deployment's authenticated ZeroMQ
channels. Ray carries only control: the actor's start and a status call every
STATUS_INTERVAL_S, never a request.

The proxy stands in for the actor towards the supervisor:
- ready: once the engine has registered and connected (the actor's status says so);
- heartbeats: relayed only when the engine's own loop has sent a new one, so a
  hung engine goes silent exactly as a local one does;
- death: a dead actor or a lost node (Ray's ActorDiedError) ends the proxy at
  once (exit 1): the supervisor takes the rank out of routing and restarts it
  under the same policy and backoff as a local child; the new proxy creates a
  new actor, placed where Ray re-placed the bundle;
- stop: SIGTERM asks the engine to stop (it tells its API servers), then kills
  the actor. A proxy that dies takes its actor with it: Ray ends an actor
  whose owner is gone, and the supervisor's death kills the proxy (PDEATHSIG).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import msgspec
from dpserve.engine.backends.ray.placement import NAMESPACE, connect_bounded
from dpserve.engine.common.auth import CurveKeys
from dpserve.engine.common.config import EngineProcessConfig
from dpserve.engine.common.procutil import EXIT_CONFIG, EXIT_ERROR, EXIT_OK, SupervisorLink, start_child

STATUS_INTERVAL_S = 0.25
FIND_GROUP_POLL_S = 0.1


class RayRank(msgspec.Struct, kw_only=True):
    """The proxy's config. `engine` is the actor's EngineProcessConfig (its
    key_file is empty: the proxy reads the node's key file and sends the secret)."""

    engine: EngineProcessConfig
    address: str
    group_name: str
    key_file: str
    connect_timeout_s: float
    placement_timeout_s: float
    stop_timeout_s: float
    supervisor_address: str
    parent_pid: int
    log_level: str = "info"


class _ActorLink:
    """What EngineProcess tells its supervisor, kept for the proxy to read."""

    def __init__(self) -> None:
        self.ready_detail: str | None = None
        self.heartbeats = 0
        self.load = (0, 0, 0.0)

    def ready(self, detail: str = "") -> None:
        self.ready_detail = detail

    def heartbeat(self, num_running: int = 0, num_waiting: int = 0, kv_usage: float = 0.0) -> None:
        self.load = (num_running, num_waiting, kv_usage)
        self.heartbeats += 1

    def close(self) -> None:
        pass


class RankActor:
    """One DP rank inside a Ray worker process (made remote in `_remote_class`)."""

    def __init__(self, cfg_json: bytes, secret: bytes | None, threads: int) -> None:
        # before torch is imported in this worker: its threads are the bundle's CPUs
        os.environ["OMP_NUM_THREADS"] = str(threads)
        from dpserve.engine.common.logs import setup_logging
        from dpserve.engine.rank.process import EngineProcess

        cfg = msgspec.json.decode(cfg_json, type=EngineProcessConfig)
        # bound here, not as a context variable: the engine logs from its own thread
        self.log = setup_logging(cfg.name, cfg.log_level).bind(component=cfg.name, rank=cfg.engine.rank)
        self.link = _ActorLink()
        self.proc = EngineProcess(cfg, self.log, supervisor=self.link, keys=CurveKeys(secret) if secret else None)
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._serve, name=f"dpserve-dp{cfg.engine.rank}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from dpserve.engine.rank.process import serve

        self.exit_code = serve(self.proc, self.log)

    def status(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        link = self.link
        return {
            "ready": link.ready_detail is not None,
            "heartbeats": link.heartbeats,
            "load": link.load,
            "exit_code": self.exit_code,
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_id": ctx.get_actor_id(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def stop(self, timeout_s: float) -> int | None:
        self.proc.should_stop = True
        self.thread.join(timeout_s)
        return self.exit_code


def _remote_class(ray):
    # Defined here, not with @ray.remote at import: the module must import without Ray.
    return ray.remote(RankActor)


def find_group(ray, name: str, timeout_s: float, heartbeat, should_stop):
    """The node's placement group, once the placement child has placed it (None: not in time, or stopped)."""
    from ray.util.placement_group import get_placement_group

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pg = get_placement_group(name)
        except ValueError:
            pg = None
        if pg is not None and pg.wait(timeout_seconds=FIND_GROUP_POLL_S):
            return pg
        if time.monotonic() > deadline or should_stop():
            return None
        heartbeat()
        if pg is None:
            time.sleep(FIND_GROUP_POLL_S)


class RankProxy:
    def __init__(self, cfg: RayRank, log) -> None:
        import zmq

        self.cfg = cfg
        self.log = log
        self.rank = cfg.engine.engine.rank
        self.link = SupervisorLink(zmq.Context.instance(), cfg.supervisor_address, cfg.engine.name)
        self.should_stop = False
        self.actor = None
        self.actor_lost = False  # Ray said it is dead or unreachable: nothing to ask it any more
        self.ray = None

    def _on_signal(self, signum, _frame) -> None:
        self.should_stop = True

    def start(self) -> int | None:
        """Connect, find the group, create the actor. An exit code if that failed."""
        cfg = self.cfg
        self.link.heartbeat()
        # a cluster that stopped answering: exit 1 and be retried under the restart policy
        self.ray = ray = connect_bounded(cfg.address, cfg.connect_timeout_s, self.log, on_stop=self._on_signal, log_to_driver=True, code=EXIT_ERROR)
        self.log.debug("connected to the Ray cluster", address=cfg.address)
        pg = find_group(ray, cfg.group_name, cfg.placement_timeout_s, self.link.heartbeat, lambda: self.should_stop)
        if self.should_stop:
            return EXIT_OK
        if pg is None:
            # Exit 1, not "cannot boot": after a Ray node is lost its bundle waits for
            # resources, and the restart policy's backoff keeps trying until they come.
            self.log.error("the rank's bundle is not placed (a lost Ray node not replaced yet?)", group=cfg.group_name, waited_s=cfg.placement_timeout_s)
            return EXIT_ERROR
        self.log.debug("placement group found", group=cfg.group_name)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        secret = None
        if cfg.key_file:
            with open(cfg.key_file, "rb") as f:
                secret = f.read().strip()
        spec = pg.bundle_specs[self.rank]  # what the placement child reserved (GPUs resolved there)
        # No runtime_env: an actor of the job's default environment can take a worker
        # Ray has already started, instead of waiting for one of its own.
        self.actor = _remote_class(ray).options(
            num_cpus=spec.get("CPU", 0),
            num_gpus=spec.get("GPU", 0),
            max_concurrency=4,  # status() and stop() while the engine thread runs
            max_restarts=0,  # the supervisor restarts ranks, under its own policy
            namespace=NAMESPACE,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=self.rank),
        ).remote(msgspec.json.encode(cfg.engine), secret, max(1, int(spec.get("CPU", 1))))
        return None

    def watch(self) -> int:
        """Relay the actor's readiness and heartbeats until it ends or we are stopped."""
        ray, actor, link = self.ray, self.actor, self.link
        from ray.exceptions import GetTimeoutError, RayActorError

        said_ready = placed = False
        last_beats = -1
        while not self.should_stop:
            try:
                st = ray.get(actor.status.remote(), timeout=max(STATUS_INTERVAL_S * 8, 2.0))
            except GetTimeoutError:
                continue  # busy or starting; the heartbeat relay decides liveness
            except RayActorError as exc:  # dead, or unreachable with its node (ActorUnavailableError)
                self.actor_lost = True
                self.log.error("the rank's Ray actor died", reason=str(exc).splitlines()[0][:300])
                return EXIT_ERROR
            if not placed:
                placed = True
                self.log.info("rank actor placed", ray_node=st["node_id"][:12], node_ip=st["node_ip"], actor=st["actor_id"], pid=st["pid"], host=st["host"])
            if st["heartbeats"] != last_beats:
                last_beats = st["heartbeats"]
                link.heartbeat(*st["load"])
            if st["ready"] and not said_ready:
                said_ready = True
                link.ready(f"ray node {st['node_id'][:12]} ({st['node_ip']}), actor {st['actor_id']}, pid {st['pid']}")
            if st["exit_code"] is not None:
                return st["exit_code"]
            time.sleep(STATUS_INTERVAL_S)
        return EXIT_OK

    def stop(self) -> None:
        """The engine stops itself first (its API servers hear of it); then the actor goes."""
        if self.actor is None:
            return
        ray = self.ray
        started = time.monotonic()
        code = None
        if not self.actor_lost:
            try:
                code = ray.get(self.actor.stop.remote(self.cfg.stop_timeout_s), timeout=self.cfg.stop_timeout_s + 1)
            except Exception:
                pass  # dead already, or stuck: killed below either way
        if self.should_stop:
            self.log.info("rank actor stopped", engine_exit_code=code, seconds=round(time.monotonic() - started, 2))
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass


def main() -> None:
    cfg = start_child(RayRank, lambda cfg: f"dpserve-dp{cfg.engine.engine.rank}")
    from dpserve.engine.common.logs import setup_logging

    log = setup_logging(cfg.engine.name, cfg.log_level).bind(component=cfg.engine.name, rank=cfg.engine.engine.rank, backend="ray")
    proxy = RankProxy(cfg, log)
    signal.signal(signal.SIGTERM, proxy._on_signal)
    signal.signal(signal.SIGINT, proxy._on_signal)
    code = EXIT_ERROR
    try:
        failed = proxy.start()
        code = failed if failed is not None else proxy.watch()
    except ImportError as exc:
        log.error("Ray is not importable on this node", error=str(exc))
        code = EXIT_CONFIG
    except Exception as exc:
        log.error("the Ray rank failed", error=f"{type(exc).__name__}: {exc}")
        code = EXIT_ERROR
    finally:
        proxy.stop()
        if proxy.ray is not None:
            proxy.ray.shutdown()
    os._exit(code)


if __name__ == "__main__":
    # Run as `python -m`, this file is __main__; take main() from the module by
    # its import name so the actor class pickles by reference, not by value.
    from dpserve.engine.backends.ray.rank import main as _main

    _main()
