"""KV-cache events: what a rank's prefix cache gains and loses, as vLLM's KV-event publisher names them.

Owns the event messages (BlockStored / BlockRemoved / AllBlocksCleared, in a
per-rank numbered KVEventBatch, and the KVSnapshot a consumer asks for with
KVSnapshotRequest after a gap) and KVEventLog, the recorder a block manager
(engine/kv_cache.py, engine/testing/sim_cache.py) writes into as it caches and
evicts blocks. It never sends anything: whoever owns the rank's sockets takes
one batch per step (`take_batch`) and carries it over the rank's
authenticated channels. Names and fields follow vLLM's
vllm/distributed/kv_events.py, so that `--engine vllm`'s events translate one
to one (engine/backends/vllm/kv_events.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

BlockHash = bytes | int  # the native engine's blake2b digests; vLLM's ExternalBlockHash is bytes or int


class BlockStored(msgspec.Struct, tag="stored", array_like=True):
    """Blocks that became findable in the prefix cache, in chain order: block_hashes[0]'s
    parent is parent_block_hash (None: the prompt's first block), each later one's the
    one before it; token_ids holds block_size ids per block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag="kv_events", array_like=True):
    """One step's events of one rank. `seq` counts batches from 1 within an incarnation:
    a consumer that sees seq != last + 1, or a new incarnation, asks for a snapshot."""

    rank: int
    incarnation: str
    seq: int
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, tag="kv_snapshot", array_like=True):
    """Everything the rank's cache holds after batch `seq` (every block's chain from its
    root, parents first): it replaces what a consumer knew of the rank."""

    rank: int
    incarnation: str
    seq: int
    blocks: list[BlockStored]


class KVSnapshotRequest(msgspec.Struct, tag="kv_snapshot_req", array_like=True):
    rank: int


class KVEventLog:
    """The events a block manager recorded since the last batch was taken.

    Consecutive stores that continue one chain merge into one BlockStored (one
    sequence's new blocks in a step), as vLLM batches them. Nothing is kept
    once taken: a consumer that missed a batch asks for a snapshot.
    """

    __slots__ = ("block_size", "pending", "seq", "_last")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[KVEvent] = []
        self.seq = 0  # the last batch taken
        self._last: BlockHash | None = None  # the last hash of the trailing BlockStored

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Iterable[int]) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockStored) and parent is not None and parent == self._last:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self.pending.append(BlockStored([block_hash], parent, list(token_ids), self.block_size))
        self._last = block_hash

    def removed(self, block_hash: BlockHash) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved([block_hash]))
        self._last = None

    def cleared(self) -> None:
        self.pending = [AllBlocksCleared()]
        self._last = None

    def take_batch(self, rank: int, incarnation: str) -> KVEventBatch | None:
        """The step's events as the next numbered batch, or None when there were none."""
        if not self.pending:
            return None
        self.seq += 1
        events, self.pending, self._last = self.pending, [], None
        return KVEventBatch(rank, incarnation, self.seq, events)


def chain_snapshot(parents: dict[BlockHash, BlockHash | None], tokens: dict[BlockHash, list[int]], block_size: int) -> list[BlockStored]:
    """Cached blocks (hash -> parent hash, hash -> token ids) as BlockStored events, each
    block after its parent; a block whose parent is not cached goes out as a root of its
    own (a consumer files it under its parent's key if it knows it, else drops it)."""
    children: dict[BlockHash | None, list[BlockHash]] = {}
    for h, p in parents.items():
        children.setdefault(p if p in parents else None, []).append(h)
    out: list[BlockStored] = []
    stack = [(h, parents[h]) for h in reversed(children.get(None, []))]
    while stack:
        h, p = stack.pop()
        out.append(BlockStored([h], p, list(tokens[h]), block_size))
        stack.extend((c, h) for c in reversed(children.get(h, [])))
    return out


class KVPublisher:
    """A rank's side of the events: the API servers that subscribed (by asking for a
    snapshot) and, after every step, the step's batch to each of them.

    Direct subscription: every batch goes to each subscribed API server over the
    rank's own authenticated channel to it (RankIO's), inside the step's outputs
    message to it when there is one (in order with them, one message a step);
    nothing goes through the coordinator. A rank whose engine keeps no
    event log (prefix caching off, simulated ranks) ignores requests, and its API
    servers keep routing cache-aware on what they sent (the approximate index).
    """

    def __init__(self, rank: int, incarnation: str) -> None:
        self.rank, self.incarnation = rank, incarnation
        self.subscribers: set[int] = set()  # API-server indices (RankIO's) that asked

    def take(self, engine) -> KVEventBatch | None:
        """The step's batch for the subscribers (numbered), or None: nothing happened, or no one asked.
        The owner sends it with each subscriber's outputs (EngineOutputs.kv), or alone (send_rest)."""
        log = getattr(engine, "kv_events", None)
        if log is None or not log.pending:
            return None
        batch = log.take_batch(self.rank, self.incarnation)
        return batch if self.subscribers else None  # (no one asked yet: a subscriber starts from a snapshot)

    def after_step(self, io, engine) -> None:
        """The step's batch to every subscriber, alone (a step without outputs, or before a snapshot)."""
        batch = self.take(engine)
        if batch is not None:
            for index in self.subscribers:
                io.send_to(index, batch)

    def on_request(self, io, index: int, engine) -> None:
        """An API server asked for a snapshot: the pending batch goes out first (to the others),
        then the snapshot numbered after it, and the asker is subscribed from then on."""
        log = getattr(engine, "kv_events", None)
        if log is None:
            return
        self.after_step(io, engine)
        # the native engine's block manager, or an engine's own kv_snapshot() (vLLM's mirror)
        blocks = engine.kv_snapshot() if hasattr(engine, "kv_snapshot") else engine.blocks.kv_snapshot()
        io.send_to(index, KVSnapshot(io.rank, io.incarnation, log.seq, blocks))
        self.subscribers.add(index)
