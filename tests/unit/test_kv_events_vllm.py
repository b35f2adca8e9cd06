"""`--engine vllm`'s KV events: vLLM's own publisher's batches translated into dpserve's (issue 29).

The first tests need no vLLM (objects with vLLM's field names); the slow one runs
vLLM's real ZmqEventPublisher in the vLLM venv and reads it through VllmKVEvents.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field

import pytest
from dpserve.daemons.api.kv_index import KVIndex
from dpserve.daemons.api.prefix_index import chain_keys
from dpserve.engine.backends.vllm.kv_events import VllmKVEvents, translate
from dpserve.engine.kv_events import BlockRemoved, BlockStored, KeysRemoved, KVEventLog, KVSnapshot

from tests.support import vllm_venv


@dataclass
class BlockStoredV:  # vLLM's field names (vllm/distributed/kv_events.py)
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object = None
    medium: object = "GPU"
    lora_name: object = None
    extra_keys: object = None
    group_idx: object = None


@dataclass
class BlockRemovedV:
    block_hashes: list
    medium: object = "GPU"
    group_idx: object = None


BlockStoredV.__name__ = "BlockStored"
BlockRemovedV.__name__ = "BlockRemoved"


@dataclass
class Feeder:
    log: KVEventLog = field(default_factory=lambda: KVEventLog(16))

    feed = VllmKVEvents.feed


def test_translate_keeps_token_blocks_and_skips_the_rest():
    ids = list(range(1, 33))
    stored = translate(BlockStoredV([11, 12], None, ids, 16))
    assert stored == BlockStored([11, 12], None, ids, 16)
    assert translate(BlockRemovedV([12])) == BlockRemoved([12])
    assert translate(BlockStoredV([13], 12, ids[:16], 16, lora_name="adapter")) is None
    assert translate(BlockStoredV([13], 12, ids[:16], 16, extra_keys=[("mm", "img", 0)])) is None
    assert translate(BlockStoredV([13], 12, ids[:16], 16, medium="CPU")) is None  # an offloading tier
    assert translate(BlockStoredV([13], 12, ids[:16], 16, group_idx=1)) is None
    assert translate(BlockStoredV([13], 12, ids[:16], 16, extra_keys=[None])) is not None


def test_vllm_events_feed_the_index_and_a_snapshot():
    feeder = Feeder()
    prompt = list(range(100, 228))  # 128 tokens: 8 vLLM blocks, 2 routing blocks
    hashes = [1000 + i for i in range(8)]
    feeder.feed([BlockStoredV(hashes[:4], None, prompt[:64], 16), BlockStoredV(hashes[4:], hashes[3], prompt[64:], 16)])
    index = KVIndex(2)
    assert not index.apply(feeder.log.take_batch(1, "v"))
    assert index.match(chain_keys(prompt)) == {1: 2}
    feeder.feed([BlockRemovedV(hashes[6:][::-1]), BlockRemovedV([999])])  # an unknown hash is no event
    batch = feeder.log.take_batch(1, "v")
    assert batch.events == [KeysRemoved(chain_keys(prompt)[1:])]  # the second routing block lost its tail
    index.apply(batch)
    assert index.match(chain_keys(prompt)) == {1: 1}
    fresh = KVIndex(2)
    fresh.apply_snapshot(KVSnapshot(1, "v", feeder.log.seq, feeder.log.snapshot(), feeder.log.block))
    assert fresh.match(chain_keys(prompt)) == {1: 1}


SCRIPT = r"""
import json, sys, time

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from dpserve.engine.backends.vllm.kv_events import VllmKVEvents, events_config
from dpserve.engine.kv_events import KVEventLog
cfg = events_config(3)
pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=cfg["endpoint"], topic=cfg["topic"])
log = KVEventLog(16)
sub = VllmKVEvents(cfg["endpoint"], log)
ids = list(range(1, 65))
hashes = [bytes([c]) * 16 for c in b"abcd"]
got, deadline = 0, time.monotonic() + 20
while got < 2 and time.monotonic() < deadline:  # a SUB misses what was sent before it joined: publish until seen
    pub.publish(KVEventBatch(ts=time.time(), events=[
        BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=ids, block_size=16,
                    lora_id=None, medium="GPU", lora_name=None)]))
    pub.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[hashes[1]], medium="GPU")]))
    time.sleep(0.2)
    log.cleared(); log.pending.clear(); sub.last_seq = -1
    got = sub.drain()
batch = log.take_batch(0, "x")
print(json.dumps({"got": got, "events": [type(e).__name__ for e in batch.events],
                  "stored": batch.events[0].keys, "removed": batch.events[1].keys, "held": log.snapshot()}))
sub.close(); pub.shutdown()
"""


@pytest.mark.slow
def test_vllms_own_publisher_is_read_and_translated():
    python = os.path.join(vllm_venv(), "bin", "python")
    out = subprocess.run([python, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["events"] == ["KeysStored", "KeysRemoved"]  # routing keys, as the API servers key prompts
    key = chain_keys(list(range(1, 65)))
    assert got["stored"] == key and got["removed"] == key and got["held"] == []  # the second block's loss drops it
