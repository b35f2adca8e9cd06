"""Detection in milliseconds where the kernel (or the engine itself) already knows.

A DP=2 node whose probes and silence limit are slow on purpose (10 s x 3):
whatever takes a rank out of routing and readiness faster than that is the
announced death (the engine's RankDown to the coordinator) or the
supervisor's exit watcher, never a timeout. A pin to a lost rank fails at
once. Remote silence (simulated ranks behind the real coordinator and API
servers) is judged within the silence limit, measured from the kill.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.server import DpServer, http_get, wait_until

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import SimCluster, probe_json  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLOW_PROBE_S = 10.0  # x 3: a 30 s silence limit that nothing in these tests may wait for
LOCAL_LIMIT_S = 1.0  # "well under a second" on two cores shared with other work


@pytest.fixture(scope="module")
def node(demo_model_dir):
    srv = DpServer(
        demo_model_dir,
        "--data-parallel-size", "2",
        "--api-server-count", "1",
        "--min-ready-ranks", "2",
        "--dp-supervisor-probe-interval-s", str(SLOW_PROBE_S),
        "--dp-supervisor-probe-timeout-s", "5",
    )
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def rank_state(srv: DpServer, rank: int) -> dict:
    return next(r for r in srv.status()["cluster"]["ranks"] if r["rank"] == rank)


def engine_pid(srv: DpServer, rank: int) -> int:
    return srv.child(f"engine-dp{rank}")["pid"]


def both_ready(srv: DpServer) -> bool:
    return all(rank_state(srv, r)["state"] == "ready" for r in (0, 1)) and http_get(srv.health_url + "/readyz")[0] == 200


def watch_loss(srv: DpServer, rank: int, sig: int) -> dict:
    """Signal the rank's engine; seconds until /status says lost, /readyz says 503, and a pin gets its 503."""
    import os

    pid = engine_pid(srv, rank)
    t0 = time.monotonic()
    os.kill(pid, sig)
    wait_until(lambda: rank_state(srv, rank)["state"] == "lost", 5, 0.01, f"rank {rank} lost in /status")
    seen = {"status_s": time.monotonic() - t0}
    wait_until(lambda: http_get(srv.health_url + "/readyz")[0] == 503, 5, 0.01, "/readyz 503")
    seen["readyz_s"] = time.monotonic() - t0
    seen["reason"] = rank_state(srv, rank)["reason"]
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        t1 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="demo", prompt="x", max_tokens=2, extra_headers={"X-data-parallel-rank": str(rank)})
        seen["pin_s"] = time.monotonic() - t1
        seen["pin"] = (err.value.status_code, err.value.body.get("code"), err.value.body.get("message"))
        # the other rank still serves
        assert client.completions.create(model="demo", prompt="x", max_tokens=2).usage.completion_tokens == 2
    return seen


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_lost_local_rank_leaves_routing_and_readiness_at_once(node, sig):
    wait_until(lambda: both_ready(node), 120, 0.1, "both ranks ready")
    seen = watch_loss(node, 1, sig)
    print(f"\n{signal.Signals(sig).name}: {seen}")
    assert seen["status_s"] < LOCAL_LIMIT_S and seen["readyz_s"] < LOCAL_LIMIT_S, seen
    # SIGTERM: the engine's own word ("engine shut down"); SIGKILL: the supervisor saw the exit
    assert ("engine shut down" if sig == signal.SIGTERM else "process exited") in seen["reason"], seen
    status, code, message = seen["pin"]
    assert (status, code) == (503, "rank_unavailable") and "lost" in message, seen["pin"]
    assert seen["pin_s"] < LOCAL_LIMIT_S, seen  # not --wait-for-engine-s (60 s)
    # restarted as before, and routed again
    wait_until(lambda: both_ready(node), 120, 0.1, "rank 1 back")


def test_a_silent_remote_rank_is_dropped_within_interval_x_threshold():
    """A SIGKILLed simulated rank announces nothing: only its silence tells. Every API
    server must have dropped it within the limit (report interval 0.1 s x 10), each
    measured by its own poller so that a sweep over servers adds nothing."""
    stale = 1.0
    with SimCluster(8, num_api_servers=2, ranks_per_process=7, num_alone=1, report_interval_s=0.1, stale_after_s=stale) as c:
        c.wait_routable(8, timeout=90)
        dropped: dict[int, float] = {}
        t0 = time.monotonic()

        def poll(i: int) -> None:
            while time.monotonic() - t0 < 10:
                if len(probe_json(c.probe_path(i))["routable_ranks"]) == 7:
                    dropped[i] = time.monotonic() - t0
                    return
                time.sleep(0.01)

        threads = [threading.Thread(target=poll, args=(i,)) for i in range(2)]
        c.kill(c.sim_procs[-1], signal.SIGKILL)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"\nsilent rank dropped after {dropped} (limit {stale} s)")
        assert len(dropped) == 2 and max(dropped.values()) <= stale + 0.05, dropped  # + one poll


def test_the_coordinator_believes_a_death_only_from_that_incarnation():
    from dpserve.daemons.coordinator.registry import RankTable, silence_limit
    from dpserve.engine.common.protocol import PROTOCOL_VERSION, EngineReady, EngineRegister

    t = RankTable(2, "fp", stale_after_s=1.5)
    t.register(EngineRegister(0, "new", "fp", 1, "host", 0, PROTOCOL_VERSION), 0)
    t.ready(EngineReady(0, "new"), 0)
    assert not t.down(0, "engine shut down", "old")  # a previous incarnation's late word
    assert t.down(0, "engine shut down", "new")
    assert json.dumps(t.snapshot().ranks[0].down_reason) == '"engine shut down"'
    # silence: the scan, the publish and the delivery fit inside the limit; never below half of it
    assert 1.0 < silence_limit(1.5, 256) < 1.5 - 0.1
    assert silence_limit(0.1, 8) == 0.05
