"""API-server text out: streaming detokenization and stop strings.

Owns everything between output token ids and the text a client sees: the text is
decode(prompt + output) minus decode(prompt), streamed or whole, cut before the first
stop string. Like tokenizer.py it must never import torch or transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from dpserve.daemons.api.tokenizer import TextTokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context (vLLM keeps 4 to 24): enough for decoders
# that strip or merge leading spaces to see the output's first token as a continuation.
_PROMPT_CONTEXT_TOKENS = 8
_MAX_PROMPT_CONTEXT_TOKENS = 24
# Text is held back only while a UTF-8 sequence may still complete (at most 3 more
# bytes). Past this many held tokens the tail is invalid bytes or text-less tokens.
_MAX_HELD_TOKENS = 16
# Consumed ids are dropped once this many pile up, so per-request memory is bounded.
_TRIM_IDS_AT = 256


def prompt_context(tokenizer: TextTokenizer, prompt_ids: Sequence[int] | None,
                   skip_special_tokens: bool = True) -> list[int]:
    """The prompt's last few ids, as decoding context for its output.

    The expected text of an output is decode(prompt + output) minus decode(prompt),
    as vLLM and transformers give it: decoders that treat a text's first token
    specially (Metaspace drops its leading space: 'world' for ' world') must see the
    output as a continuation. A short tail gives the same text as the whole prompt
    because these decoders look at one token at a time, apart from the first. As in
    vLLM, the tail is the shortest of at least _PROMPT_CONTEXT_TOKENS ids that decodes
    without U+FFFD (it does not start inside a character or a byte-fallback run).
    Failing that, it is cut back past a character the prompt leaves open (a prompt
    given as raw ids may end inside one), so the output's bytes never merge with the
    prompt's. (Where output bytes turn a byte-fallback run that began in the prompt
    invalid, the whole prompt would be needed to match; such text is garbage anyway.)
    """
    return _prompt_context(tokenizer.backend, prompt_ids, skip_special_tokens)[0]


def _prompt_context(backend: Tokenizer, prompt_ids: Sequence[int] | None,
                    skip_special_tokens: bool) -> tuple[list[int], str]:
    """prompt_context and its decoded text."""
    prompt = list(prompt_ids or ())

    def decode(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    for size in range(min(len(prompt), _PROMPT_CONTEXT_TOKENS), min(len(prompt), _MAX_PROMPT_CONTEXT_TOKENS) + 1):
        text = decode(prompt[-size:])
        if _REPLACEMENT_CHAR not in text:
            return prompt[-size:], text
    context = prompt[-_PROMPT_CONTEXT_TOKENS:]
    text = decode(context)
    while context and text.endswith(_REPLACEMENT_CHAR):
        del context[-1]
        text = decode(context)
    return context, text


def decode_continuation(tokenizer: TextTokenizer, prompt_ids: Sequence[int] | None, ids: Sequence[int],
                        skip_special_tokens: bool = True) -> str:
    """decode(prompt + ids) minus decode(prompt), through prompt_context: a whole answer's
    text in one go, the same text IncrementalDetokenizer gives piece by piece."""
    backend = tokenizer.backend
    context, head = _prompt_context(backend, prompt_ids, skip_special_tokens)
    if not context:
        return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return backend.decode([*context, *ids], skip_special_tokens=skip_special_tokens)[len(head):]


class IncrementalDetokenizer:
    """Turns one request's output ids into text as they arrive.

    The text equals decode_continuation(prompt_context(prompt), output ids). The
    common case runs in `tokenizers`' own DecodeStream (Rust; vLLM's fast incremental
    detokenizer), primed with the prompt context. Invariants: `_tail` is a run of ids
    that starts and ends at clean boundaries (nothing open) and whose text has been
    returned; `_held` are the ids fed since, whose text has not. DecodeStream holds a
    tail that does not yet decode to valid text for as long as it lasts, re-decoding
    it on every step; once more than _MAX_HELD_TOKENS are held (invalid bytes, or
    tokens without text such as skipped specials) or it raises, the request moves for
    good to _WindowDetokenizer, which releases such tails and keeps the window short.
    A ByteFallback decoder turns a run of <0xXX> tokens that is invalid UTF-8 into
    U+FFFD as a whole, so text decoded from a run's first bytes is final only once
    the run ends: ids ending in a byte token wait (`_unstepped`) for the next token.
    Only a run longer than _MAX_HELD_TOKENS that turns invalid after its release can
    differ from a full decode (vLLM's stream has the same limit for any run).
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._tail = _prompt_context(self._backend, prompt_ids, skip_special_tokens)[0]
        self._held: list[int] = []
        self._unstepped: list[int] = []  # the end of _held that DecodeStream has not seen
        self._byte_ids = tokenizer.byte_fallback_ids
        self._stream: DecodeStream | None = DecodeStream(ids=self._tail, skip_special_tokens=skip_special_tokens)
        self._window: _WindowDetokenizer | None = None

    def step(self, new_ids: Iterable[int]) -> str:
        """Append ids; return the text that became final (possibly "")."""
        if self._window is not None:
            return self._window.step(new_ids)
        new_ids = list(new_ids)
        if not new_ids:
            return ""
        self._held += new_ids
        if self._byte_ids and new_ids[-1] in self._byte_ids and len(self._held) <= _MAX_HELD_TOKENS:
            self._unstepped += new_ids  # a byte run may go on: its text is not final yet
            return ""
        if self._unstepped:
            new_ids, self._unstepped = self._unstepped + new_ids, []
        try:
            text = self._stream.step(self._backend, new_ids if len(new_ids) > 1 else new_ids[0])
        except Exception:  # e.g. "invalid prefix" from the Rust side: the window copes
            text = None
        else:
            if text is not None:
                self._tail, self._held = self._held, []
                return text
            if len(self._held) <= _MAX_HELD_TOKENS:
                return ""
        self._window = _WindowDetokenizer(self._backend, self._skip_special_tokens, self._tail)
        self._stream = None
        return self._window.step(self._held)

    def flush(self) -> str:
        """Return everything still held; an unfinished UTF-8 sequence becomes U+FFFD, as in
        a full decode. Call once, at the end of the request."""
        if self._window is not None:
            return self._window.flush()
        held, self._held, self._unstepped = self._held, [], []
        if not held:
            return ""
        head = self._decode(self._tail)
        return self._decode(self._tail + held)[len(head):]

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)


class _WindowDetokenizer:
    """The fallback of IncrementalDetokenizer: a hand-written incremental decode that
    releases text DecodeStream would hold forever.

    Invariants: all text up to `_read` has been returned; `_ids[_prefix:_read]` decodes to
    `_prefix_text`; `_read` (and so later `_prefix`) is a token boundary after which decoding
    restarts cleanly: the text there did not end in U+FFFD, so no UTF-8 sequence is open.
    Each step decodes only the window `_ids[_prefix:]`, a few tokens long, so the cost per
    token does not grow with the output. Started on (context, pending ids), the
    concatenation of step() results and flush() equals decode(context + ids) minus
    decode(context).
    """

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool, context: list[int]) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(context)
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, new_ids: Iterable[int]) -> str:
        """Append ids; return the text that became final (possibly "")."""
        pieces = []
        for token_id in new_ids:
            self._ids.append(token_id)
            piece = self._advance()
            if piece:
                pieces.append(piece)
        return "".join(pieces)

    def flush(self) -> str:
        """Return everything still held; an unfinished UTF-8 sequence becomes U+FFFD, as in
        a full decode. Call once, at the end of the request."""
        text = self._decode(self._ids[self._prefix:])
        piece = text[len(self._prefix_text):]
        self._ids, self._prefix, self._read, self._prefix_text = [], 0, 0, ""
        return piece

    def _advance(self) -> str:
        ids = self._ids
        text = self._decode(ids[self._prefix:])
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
            piece = text[len(self._prefix_text):]
            self._move_window(self._read, len(ids))
            return piece
        if len(ids) - self._read > _MAX_HELD_TOKENS:
            if text == self._prefix_text:
                del ids[self._read:]  # only tokens without text (skipped specials) are held
                return ""
            return self._force_split(text)
        return ""

    def _force_split(self, text: str) -> str:
        """Release a tail held for too long (invalid bytes, or tokens without text): return
        the text up to the latest boundary k where decoding the halves separately gives the
        same text as decoding them together. That is decisive once one byte follows k: if it
        continues a sequence open at k, the separate decode has an extra U+FFFD."""
        ids = self._ids
        # A few candidates per step bound the cost; the next step tries again.
        for k in range(len(ids) - 1, max(self._read, len(ids) - 8), -1):
            tail = self._decode(ids[k:])
            if not tail:
                continue
            head = self._decode(ids[self._prefix:k])
            if head + tail == text and head.startswith(self._prefix_text):
                piece = head[len(self._prefix_text):]
                self._move_window(k, k)
                return piece
        return ""

    def _move_window(self, prefix: int, read: int) -> None:
        self._prefix, self._read = prefix, read
        self._prefix_text = self._decode(self._ids[prefix:read])
        if prefix >= _TRIM_IDS_AT:
            del self._ids[:prefix]
            self._prefix, self._read = 0, read - prefix


class StopChecker:
    """Cuts a text stream before the first stop string to complete.

    Invariants: `_held` is the longest tail of the text fed so far that is a proper prefix
    of some stop string (so shorter than the longest stop); all text before it has been
    returned. The stop that fires is the one that completes first (ties: the longer one),
    which is what a token-by-token engine sees, and makes the result independent of how
    the text was chunked: streaming and non-streaming agree. After a hit nothing more is
    returned; the stop string itself never is.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_held = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stop_reason: str | None = None  # the stop string that fired

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        if self.stop_reason is not None:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        hit: tuple[int, int, str] | None = None  # (end, start, stop): earliest end wins
        for stop in self._stops:
            start = buf.find(stop)  # the first occurrence of a stop is also its first end
            if start >= 0 and (hit is None or (start + len(stop), start) < hit[:2]):
                hit = (start + len(stop), start, stop)
        if hit is not None:
            self.stop_reason, self._held = hit[2], ""
            return buf[:hit[1]], True
        keep = self._held_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """End of stream without a hit: release the held text."""
        held, self._held = self._held, ""
        return held

    def _held_len(self, buf: str) -> int:
        for size in range(min(len(buf), self._max_held), 0, -1):
            if buf[-size] in self._first_chars:
                tail = buf[-size:]
                if any(stop.startswith(tail) for stop in self._stops):
                    return size
        return 0
