"""Cache-aware routing on a real node (issue 16): DP 2, 2 API servers on one port,
`--lb-policy cache-aware`. Each turn goes over a fresh connection, so the kernel
may hand it to either API server: turn 2 still lands on turn 1's rank, because
every API server hears every rank's KV events (issue 29). Each rank's KV cache
holds at most 4,096 tokens, so a rank can be made to evict a prefix."""

from __future__ import annotations

import http.client
import json
import random
import sys
from pathlib import Path

import pytest

from tests.server import DpServer

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.simcluster import SimCluster  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 64


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def node(demo_model_dir):
    with DpServer(demo_model_dir, "--data-parallel-size", "2", "--api-server-count", "2", "--lb-policy", "cache-aware",
                  "--kv-cache-memory-bytes", str(2 << 20)) as srv:  # the demo model: 2,048 tokens in fp32, 4,096 in bf16
        yield srv


def complete(node: DpServer | SimCluster, prompt: list[int], pinned: int | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)  # a new connection every time
    headers = {"Content-Type": "application/json", **({"X-data-parallel-rank": str(pinned)} if pinned is not None else {})}
    model = "sim" if isinstance(node, SimCluster) else "demo"
    conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}), headers)
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, body
    return int(resp.getheader("X-data-parallel-rank")), body


def test_turn_two_lands_on_turn_ones_rank_whichever_api_server_takes_it(node):
    system = ids(1, 4 * BLOCK)
    first: dict[int, int] = {}
    for conv in range(8):
        # pins spread the first turns over both ranks, as load would
        first[conv], _ = complete(node, system + ids(100 + conv, BLOCK), pinned=conv % 2)
    for conv in range(8):
        rank, _ = complete(node, system + ids(100 + conv, BLOCK) + ids(200 + conv, BLOCK))
        assert rank == first[conv], f"conversation {conv}: turn 1 on rank {first[conv]}, turn 2 on {rank}"


def test_without_a_shared_prefix_load_still_spreads(node):
    ranks = [complete(node, ids(1000 + i, 2 * BLOCK))[0] for i in range(16)]
    assert set(ranks) == {0, 1}


def test_routing_follows_an_evicted_prefix_away(node):
    """Both ranks compute four prefixes; rank 0 then evicts them (other prompts fill its
    cache). A later turn goes to rank 1, the only holder left, every time: an index of
    what was sent would credit both ranks and split the turns between them."""
    prefixes = [ids(3000 + k, 8 * BLOCK) for k in range(4)]
    for prefix in prefixes:
        for rank in (0, 1):
            complete(node, prefix + ids(3100, BLOCK), pinned=rank)
    for i in range(5):  # 5 x 1,000 distinct tokens through a cache of <= 4,096: rank 0 keeps none of the above
        complete(node, ids(4000 + i, 1000), pinned=0)
    ranks = [complete(node, prefix + ids(3100, BLOCK) + ids(3200 + k, BLOCK))[0] for k, prefix in enumerate(prefixes)]
    assert ranks == [1, 1, 1, 1]


def test_simulated_ranks_events_steer_routing_over_sockets():
    """The same eviction, on simulated ranks (`simcluster.py --kv-cache-blocks`, 64 blocks of
    16 tokens each) behind 2 API servers: their KV events and snapshots travel the real
    channels, and the later turns follow the prefixes to rank 1, whichever API server routes."""
    with SimCluster(2, num_api_servers=2, ranks_per_process=2, lb_policy="cache-aware", kv_cache_blocks=64,
                    report_interval_s=0.2) as cluster:
        cluster.wait_routable(2, timeout=60)
        prefixes = [ids(5000 + k, 2 * BLOCK) for k in range(4)]  # 4 x 12 blocks with their turn: both caches hold all
        for prefix in prefixes:
            for rank in (0, 1):
                assert complete(cluster, prefix + ids(5100, BLOCK), pinned=rank)[0] == rank
        for i in range(2):  # 2 x 57 blocks through rank 0's 64: it keeps none of the above
            complete(cluster, ids(6000 + i, 900), pinned=0)
        ranks = [complete(cluster, prefix + ids(5100, BLOCK) + ids(5200 + k, BLOCK))[0] for k, prefix in enumerate(prefixes)]
        assert ranks == [1, 1, 1, 1]
