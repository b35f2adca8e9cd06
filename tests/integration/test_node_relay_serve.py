"""Real ranks report through their supervisor's load relay (issue 30): with a 1.5 s
silence limit, a node whose rank sends no report of its own to the coordinator
keeps it routable for two limits, and a finished request's count reaches the
API server's routing table through the relay (one NodeLoad), as it did directly."""

from __future__ import annotations

import time

import pytest

from tests.server import DpServer, stream_request, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROBE_S = 0.5  # x 3 failures: a 1.5 s silence limit


def test_a_rank_behind_the_load_relay_stays_routable_and_its_load_reaches_routing(demo_model_dir):
    with DpServer(
        demo_model_dir, "--data-parallel-size", "1", "--api-server-count", "1", "--max-model-len", "128",
        "--dp-supervisor-probe-interval-s", str(PROBE_S), "--dp-supervisor-probe-timeout-s", "2",
    ) as srv:
        ranks = srv.status()["cluster"]["ranks"]
        assert [r["state"] for r in ranks] == ["ready"], ranks
        before = srv.rank_finished()
        for _ in range(2):
            stream_request(srv.port, 4, {})
        # the count comes from the ranks' load rows: through the relay, to the coordinator, to the API server
        wait_until(lambda: sum(srv.rank_finished().values()) >= sum(before.values()) + 2, 10, what="finished counts")
        time.sleep(2 * PROBE_S * 3)  # two silence limits: a relay that dropped the heartbeats would lose the rank
        ranks = srv.status()["cluster"]["ranks"]
        assert [r["state"] for r in ranks] == ["ready"], ranks
        assert "no load report" not in srv.log()
