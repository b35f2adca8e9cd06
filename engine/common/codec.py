"""The msgpack codec every channel uses, and the fingerprint two nodes compare.

Apart from protocol.py (the messages) so that module stays the wire format's
types alone; like it, this must never import torch, transformers or dpserve.daemons.
"""

from __future__ import annotations

import hashlib
import time

import msgspec
from dpserve.engine.common.logs import get_logger
from dpserve.engine.common.protocol import PROTOCOL_VERSION

# At most one 'undecodable message dropped' warning per channel per this many seconds.
UNDECODABLE_LOG_INTERVAL_S = 10.0


class Codec:
    """A msgpack encoder/decoder pair for one channel's message union.

    Readers take peers' bytes with decode_or_none(): one policy for bytes that
    are not a message of this channel (a peer of another version, a stray
    client, garbage): count them, log at most one warning per
    UNDECODABLE_LOG_INTERVAL_S per channel, and go on. A reader never crashes
    on them and never floods the journal. decode() raises, for callers that
    decode their own bytes.
    """

    __slots__ = ("_enc", "_dec", "channel", "num_undecodable", "_last_warned")

    def __init__(self, union: object, channel: str = "") -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)
        self.channel = channel or getattr(union, "__name__", str(union))
        self.num_undecodable = 0
        self._last_warned = -UNDECODABLE_LOG_INTERVAL_S

    def encode(self, msg: object) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes | memoryview):
        return self._dec.decode(data)

    def decode_or_none(self, data: bytes | memoryview, peer: str = ""):
        """The message, or None (counted, logged rate-limited) for bytes that are not one."""
        try:
            return self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.num_undecodable += 1
            now = time.monotonic()
            if now - self._last_warned >= UNDECODABLE_LOG_INTERVAL_S:
                self._last_warned = now
                get_logger().warning(
                    "undecodable message dropped", channel=self.channel, peer=peer or None,
                    error=str(exc)[:200], num_undecodable=self.num_undecodable,
                )
            return None


def config_fingerprint(model: str, dtype: str, max_model_len: int, data_parallel_size: int, engine: str = "native") -> str:
    """A short hash of everything two nodes of one deployment must agree on.

    `model` is the model's identity (its config.json content hash, not its
    path: nodes may keep the same model in different directories). `engine`:
    every rank of a deployment runs the same engine (answers must not depend
    on the rank); the native engine's fingerprints are those of old (before
    it was named "native", it was "dpserve": both hash alike).
    """
    text = f"{PROTOCOL_VERSION}|{model}|{dtype}|{max_model_len}|{data_parallel_size}"
    if engine not in ("native", "dpserve"):
        text += f"|{engine}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
