"""vLLM's own KV-cache events, read from its publisher and translated into dpserve's (issue 29).

With `--engine vllm` the rank asks vLLM for KV events (`kv_events_config`:
vLLM's ZMQ publisher, on an ipc endpoint private to the rank) and a
VllmKVEvents reads what the publisher sent after every step, translating
each of vLLM's BlockStored / BlockRemoved / AllBlocksCleared into the
rank's KVEventLog, block by block, as the native block manager tells it:
from there on, routing keys, batches, numbering and snapshots are the same
as the native engine's. vLLM's own
sequence numbers are checked: a frame lost between vLLM's thread and ours
marks the log cleared (the API servers then rebuild from what follows),
never a wrong index.

Only blocks a prompt's token ids alone identify are translated: a block
whose key also depends on a LoRA, multimodal input, a cache salt or prompt
embeddings (extra_keys), another KV-cache group or another medium (an
offloading tier) is skipped, and so is every block filed under it.
Nothing here imports vllm at module level.
"""

from __future__ import annotations

import os

from dpserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog

OWN_MEDIA = (None, "GPU")  # vLLM's block pool publishes its device cache as "GPU", on CPU builds too


def translate(event) -> BlockStored | BlockRemoved | AllBlocksCleared | None:
    """One of vLLM's KV events as dpserve's, or None when routing cannot use it."""
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if getattr(event, "medium", None) not in OWN_MEDIA or getattr(event, "group_idx", None) not in (None, 0):
        return None
    if kind == "BlockRemoved":
        return BlockRemoved(list(event.block_hashes))
    if kind != "BlockStored":
        return None
    extra = getattr(event, "extra_keys", None)
    if event.lora_id is not None or getattr(event, "lora_name", None) or (extra and any(extra)):
        return None
    return BlockStored(list(event.block_hashes), event.parent_block_hash, list(event.token_ids), event.block_size)


def events_config(rank: int) -> dict:
    """vLLM's kv_events_config for this rank: its ZMQ publisher on a private ipc endpoint."""
    path = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"dpserve-kv-{os.getpid()}-{rank}")
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{path}", "topic": "kv"}


class VllmKVEvents:
    """A SUB socket on vLLM's publisher, drained into a KVEventLog after each step.

    vLLM frames are (topic, seq as 8 big-endian bytes, msgpack KVEventBatch).
    The log keeps what vLLM's cache holds as its events told (vLLM has no
    snapshot of its own): a removal of a block the log never filed is no event.
    """

    def __init__(self, endpoint: str, log: KVEventLog) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch as VllmBatch

        self.log = log
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(VllmBatch)
        self.last_seq = -1
        self.num_gaps = 0

    def drain(self) -> int:
        """Every batch vLLM published since the last call, translated into the log; returns how many."""
        import zmq

        n = 0
        while True:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big")
            if self.last_seq >= 0 and seq != self.last_seq + 1:
                self.num_gaps += 1
                self.log.cleared()  # what we missed is unknown: consumers start again from empty
            self.last_seq = seq
            self.feed(self.decoder.decode(frames[2]).events)
            n += 1

    def feed(self, events) -> None:
        log = self.log
        for event in events:
            ours = translate(event)
            if isinstance(ours, BlockStored):
                parent, bs = ours.parent_block_hash, ours.block_size
                for i, h in enumerate(ours.block_hashes):
                    log.stored(h, parent, ours.token_ids[i * bs : (i + 1) * bs])
                    parent = h
            elif isinstance(ours, BlockRemoved):
                for h in ours.block_hashes:
                    log.removed(h)
            elif isinstance(ours, AllBlocksCleared):
                log.cleared()

    def close(self) -> None:
        self.sub.close(linger=0)
