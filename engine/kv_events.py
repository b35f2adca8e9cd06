"""KV-cache events: what a rank's prefix cache gains and loses, as the routers' keys.

Owns the event messages (KeysStored / KeysRemoved / AllBlocksCleared, in a
per-rank numbered KVEventBatch, and the KVSnapshot a consumer asks for with
KVSnapshotRequest after a gap) and KVEventLog, which a block manager
(engine/kv_cache.py, engine/testing/sim_cache.py, and vLLM's events through
engine/backends/vllm/kv_events.py) tells of every block it caches and evicts,
in vLLM's terms (block hash, parent hash, token ids). It never sends anything:
whoever owns the rank's sockets takes one batch per step (`take_batch`) and
carries it over the rank's authenticated channels.

What goes out is routing blocks, not engine blocks: the key of every
ROUTING_BLOCK-token prefix block the cache now holds or no longer holds,
keyed as the API servers key a prompt (daemons/api/prefix_index.py). The
rank files its blocks once; each API server files a few ints per 64 tokens
instead of decoding every block's token ids and hashing them again (issue 29:
the plain path's API CPU).
"""

from __future__ import annotations

import math

import msgspec

BlockHash = bytes | int  # the native engine's blake2b digests; vLLM's ExternalBlockHash is bytes or int
ROUTING_BLOCK = 64  # tokens per routing block (coarser than the engine's KV blocks: cheaper, same affinity)


def block_key(parent: int, tokens: tuple) -> int:
    """The key of a routing block of `tokens` after the block keyed `parent` (0 at the root).
    hash() of a tuple of ints is not salted (only str and bytes are), so keys agree across
    processes; a 64-bit collision only costs a cache miss. prefix_index.chain_keys (and its C
    twin) compute the same keys for a whole prompt."""
    return hash((parent, hash(tokens)))


class BlockStored(msgspec.Struct, tag="stored", array_like=True):
    """vLLM's event (vllm/distributed/kv_events.py), as translated from its publisher: blocks
    that became findable, in chain order from parent_block_hash; token_ids holds block_size ids
    per block. It never crosses a dpserve channel: a KVEventLog files it."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    block_hashes: list[BlockHash]


class KeysStored(msgspec.Struct, tag="keys_stored", array_like=True):
    """Routing blocks the rank's cache now serves: each key's whole prefix with it."""

    keys: list[int]
    block: int  # tokens per routing block (a multiple of the engine's block size)


class KeysRemoved(msgspec.Struct, tag="keys_removed", array_like=True):
    keys: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True):
    pass


KVEvent = KeysStored | KeysRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, tag="kv_events", array_like=True):
    """One step's events of one rank. `seq` counts batches from 1 within an incarnation:
    a consumer that sees seq != last + 1, or a new incarnation, asks for a snapshot."""

    rank: int
    incarnation: str
    seq: int
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, tag="kv_snapshot", array_like=True):
    """Every routing key the rank's cache serves after batch `seq`: it replaces what a consumer knew of the rank."""

    rank: int
    incarnation: str
    seq: int
    keys: list[int]
    block: int


class KVSnapshotRequest(msgspec.Struct, tag="kv_snapshot_req", array_like=True):
    rank: int


class KVEventLog:
    """The routing blocks a block manager's cache serves, and what changed since the last batch.

    Engine blocks come in (`stored`, `removed`, `cleared`); a routing block is
    held while the engine block that ends it and every block before it are
    cached. Prefix-closed: removing a block removes every block filed under
    it (a prompt's lookup stops at its first missing block). A block whose
    parent is not filed is unreachable from a prompt's root and not filed.

    nodes: engine hash -> (base, partial, ends, parent): the key of the last
    routing block completed at or before it (0 at the root), the tokens since
    (none when `ends`: this block completes the routing block keyed `base`),
    and its parent's hash. Consecutive changes of one kind merge into one
    event; nothing is kept once taken: a consumer that missed a batch asks
    for a snapshot.
    """

    __slots__ = ("block_size", "block", "pending", "seq", "nodes", "children")

    def __init__(self, block_size: int, routing_block: int = ROUTING_BLOCK) -> None:
        self.block_size = block_size
        self.block = math.lcm(routing_block, block_size)  # vLLM's CPU blocks may be larger than 64
        self.pending: list[KVEvent] = []
        self.seq = 0  # the last batch taken
        self.nodes: dict[BlockHash, tuple[int, tuple, bool, BlockHash | None]] = {}
        self.children: dict[BlockHash, set[BlockHash]] = {}

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids) -> None:
        if len(token_ids) != self.block_size:
            return  # not one of this cache's blocks (malformed): never filed, never a wrong key
        nodes = self.nodes
        node = nodes.get(block_hash)
        if node is not None:
            if node[3] == parent:
                return  # filed already (a hash chain names its prefix: same block, same subtree)
            self.removed(block_hash)  # under another parent: what was filed under it went with it
        if parent is None:
            base, partial = 0, ()
        else:
            pnode = nodes.get(parent)
            if pnode is None:
                return  # its parent is not filed (evicted, or never seen)
            base, partial = pnode[0], pnode[1]
            kids = self.children.get(parent)
            if kids is None:
                self.children[parent] = {block_hash}
            else:
                kids.add(block_hash)
        partial += tuple(token_ids)
        if len(partial) < self.block:
            nodes[block_hash] = (base, partial, False, parent)
            return
        key = block_key(base, partial)  # (exactly self.block tokens: it is a multiple of block_size)
        nodes[block_hash] = (key, (), True, parent)
        last = self.pending[-1] if self.pending else None
        if type(last) is KeysStored:
            last.keys.append(key)
        else:
            self.pending.append(KeysStored([key], self.block))

    def removed(self, block_hash: BlockHash) -> None:
        node = self.nodes.pop(block_hash, None)
        if node is None:
            return
        children = self.children
        kids = children.get(node[3])
        if kids is not None:
            kids.discard(block_hash)
            if not kids:
                del children[node[3]]
        gone = [node[0]] if node[2] else []
        if block_hash in children:  # (eviction goes tail first: a block seldom has children left)
            self._drop_under(block_hash, gone)
        if gone:
            last = self.pending[-1] if self.pending else None
            if type(last) is KeysRemoved:
                last.keys.extend(gone)
            else:
                self.pending.append(KeysRemoved(gone))

    def _drop_under(self, block_hash: BlockHash, gone: list[int]) -> None:
        """Unfile everything filed under the block, adding the routing keys that go to `gone`."""
        nodes, children = self.nodes, self.children
        stack = list(children.pop(block_hash))
        while stack:
            h = stack.pop()
            kids = children.pop(h, None)
            if kids:
                stack.extend(kids)
            node = nodes.pop(h, None)
            if node is not None and node[2]:
                gone.append(node[0])

    def cleared(self) -> None:
        self.nodes.clear()
        self.children.clear()
        self.pending = [AllBlocksCleared()]

    def snapshot(self) -> list[int]:
        """Every routing key held now (a KVSnapshot's body)."""
        return [node[0] for node in self.nodes.values() if node[2]]

    def take_batch(self, rank: int, incarnation: str) -> KVEventBatch | None:
        """The step's events as the next numbered batch, or None when there were none."""
        if not self.pending:
            return None
        self.seq += 1
        events, self.pending = self.pending, []
        return KVEventBatch(rank, incarnation, self.seq, events)


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
        The owner sends it with each subscriber's outputs (EngineOutputs.kv), or alone (after_step)."""
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
        sync = getattr(engine, "kv_sync", None)  # vLLM's: what its publisher sent so far, into the log
        if sync is not None:
            sync()
        self.after_step(io, engine)
        io.send_to(index, KVSnapshot(io.rank, io.incarnation, log.seq, log.snapshot(), log.block))
        self.subscribers.add(index)
