"""An API server's idle-rank pings (EngineClient.probe_idle) are bounded a round:
every rank each heartbeat in a small cluster, PROBE_PER_ROUND ranks a round, round
robin, in a big one (issue 30: at 1,024 ranks a ping a rank a second was ~1/3 of an
API server's CPU after its imports). Real sockets are made but nothing is sent: the
send is recorded."""

from __future__ import annotations

import pytest
import zmq.asyncio
from dpserve.daemons.api.engine_client import PROBE_PER_ROUND, EngineClient
from dpserve.daemons.api.router import Router
from dpserve.engine.common.protocol import LoadTable, RankLoad


@pytest.fixture
def make_client(tmp_path):
    made = []

    def make(size: int) -> tuple[EngineClient, list[int]]:
        ctx = zmq.asyncio.Context()
        client = EngineClient(ctx, Router(size), f"ipc://{tmp_path}/engines-{size}", f"ipc://{tmp_path}/table", log=None)
        made.append((ctx, client))
        sent: list[int] = []
        router = client.router
        router.update_table(LoadTable(1, size, [RankLoad(r, f"i{r}", True) for r in range(size)]))
        for r in range(size):
            router.engine_hello(r, f"i{r}")  # every rank routable here
        client._send_now = lambda rank, data: sent.append(rank)
        return client, sent

    yield make
    for ctx, client in made:
        client.engines.close(0)
        client.table.close(0)
        ctx.term()


def test_a_small_cluster_pings_every_idle_rank_each_round(make_client):
    client, sent = make_client(8)
    client.router.inflight[3] = 1  # busy: its next send tells
    for _ in range(2):
        sent.clear()
        client.probe_idle()
        assert sent == [0, 1, 2, 4, 5, 6, 7]


def test_a_big_cluster_pings_a_bounded_slice_a_round_and_every_rank_in_turn(make_client):
    size = 2 * PROBE_PER_ROUND + 88
    client, sent = make_client(size)
    rounds = []
    for _ in range(4):
        sent.clear()
        client.probe_idle()
        rounds.append(list(sent))
    assert all(len(r) == PROBE_PER_ROUND for r in rounds)
    assert rounds[0] == list(range(PROBE_PER_ROUND)) and rounds[1][0] == PROBE_PER_ROUND
    assert sorted(set(rounds[0] + rounds[1] + rounds[2])) == list(range(size))  # all within ceil(size / per round)
    assert rounds[2][-1] == PROBE_PER_ROUND * 3 - size - 1 and rounds[3][0] == PROBE_PER_ROUND * 3 - size
