"""Compiled grammars for a rank: llguidance matchers, built off the engine's loop.

Owns the rank's llguidance tokenizer and one compiled matcher per grammar
text. Compiling (LLMatcher construction: up to hundreds of ms, with the GIL
released) runs on one worker thread; the engine loop only asks whether a
grammar is ready and takes a deep copy (tens of µs, sharing the compiled
lexer and grammar), so n requests with one grammar compile it once. It must
never block the caller on a compile and never hold more than its bounds.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from dpserve.engine.common.grammar_limits import GRAMMAR_LIMITS

MAX_CACHED_GRAMMARS = 64
MAX_CACHED_GRAMMAR_BYTES = 16 << 20  # grammar texts held; their compiled form is of the same order


class GrammarCompiler:
    """Matchers by grammar text: submit() starts a compile (at once when cached),
    is_ready() says whether it ended, matcher() gives the request its own copy.

    Invariant: `_compiled` holds at most MAX_CACHED_GRAMMARS futures whose texts
    total at most MAX_CACHED_GRAMMAR_BYTES, least recently used first; a future
    resolves to (a matcher not in error, "") or (None, the error). A request
    keeps its own future (not the cache's entry), so eviction never loses one.
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._bytes = 0
        self.num_compiles = 0
        # The tokenizer is the worker's first job (AutoTokenizer-sized work: seconds
        # on a loaded machine), so a grammar compiles after it, never on the loop.
        self._tokenizer = self._pool.submit(self._build_tokenizer, model_dir, vocab_size, sorted(eos_token_ids))

    @staticmethod
    def _build_tokenizer(model_dir: str, vocab_size: int, eos: list[int]):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        tok.no_padding()
        tok.no_truncation()
        return llg_tokenizer(tok, vocab_size, eos)

    def submit(self, grammar: str) -> Future:
        """The grammar's compile, started now unless cached or under way."""
        with self._lock:
            fut = self._compiled.get(grammar)
            if fut is not None:
                self._compiled.move_to_end(grammar)
                return fut
            fut = self._pool.submit(self._compile, grammar)
            self._compiled[grammar] = fut
            self._bytes += len(grammar)
            while len(self._compiled) > MAX_CACHED_GRAMMARS or self._bytes > MAX_CACHED_GRAMMAR_BYTES:
                old, _ = self._compiled.popitem(last=False)
                self._bytes -= len(old)
            return fut

    def _compile(self, grammar: str) -> tuple[object | None, str]:
        """(matcher, "") or (None, why not): a value, not an exception, since a
        cached exception raised again grows its traceback every time."""
        import llguidance

        try:
            tokenizer = self._tokenizer.result()
        except Exception as e:  # no tokenizer.json, or llguidance missing: guided requests fail alone
            return None, f"structured output is not available for this model: {type(e).__name__}: {e}"
        self.num_compiles += 1
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, limits=llguidance.LLParserLimits(**GRAMMAR_LIMITS))
        except Exception as e:
            return None, f"guided_grammar cannot be compiled: {type(e).__name__}: {str(e)[:400]}"
        if matcher.is_error():
            return None, f"guided_grammar cannot be followed: {matcher.get_error()[:400]}"
        return matcher, ""

    @staticmethod
    def matcher(fut: Future):
        """A finished compile's matcher, the request's own copy; raises ValueError with why it failed."""
        template, error = fut.result(timeout=0)
        if template is None:
            raise ValueError(error)
        return template.deep_copy()

    def take_ready(self, compiling: dict[str, tuple[object, Future]], wait_s: float) -> tuple[list, list[tuple[str, str]]]:
        """Pops the entries of `compiling` (request id -> (sequence, its compile)) whose compile
        ended, waiting up to wait_s for one: (their sequences, each given its own matcher;
        (request id, error) of those whose grammar failed)."""
        if wait_s:
            wait([fut for _, fut in compiling.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        ready, failed = [], []
        for rid, (seq, fut) in list(compiling.items()):
            if not fut.done():
                continue
            del compiling[rid]
            try:
                seq.matcher = self.matcher(fut)
                replay(seq.matcher, seq.output_token_ids)
                ready.append(seq)
            except ValueError as e:
                failed.append((rid, str(e)))
        return ready, failed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def replay(matcher, token_ids: list[int]) -> None:
    """Advance a fresh matcher over the tokens a continuation already produced (on the
    rank it moved from), so the grammar resumes where it was; ValueError if they do not
    follow it (then the request fails, never samples past a broken state)."""
    for token in token_ids:
        matcher.consume_token(token)
        if matcher.is_error():
            raise ValueError(f"the grammar could not resume after a move: {matcher.get_error()[:400]}")


def llg_tokenizer(tok, vocab_size: int, eos: list[int]):
    """llguidance's tokenizer for `tok` (a tokenizers.Tokenizer), where an added token that
    the tokenizer does not mark special (Hermes' <tool_call>, a <think> tag) is text like
    any other token, as in vLLM's backends: a regex or JSON schema that spells its text can
    be followed, by that token too. llguidance 1.9 builds every added token as special
    (reachable only as `<name>` in Lark, never by text), so those are rebuilt here from the
    bytes it decodes them to; true special tokens stay special."""
    import llguidance

    base = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    plain = {t["id"] for t in json.loads(tok.to_str()).get("added_tokens") or () if not t.get("special", True)}
    if not plain:
        return base
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok, base, vocab_size, eos, plain)),
                                  n_vocab=vocab_size, eos_token=eos)


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: each token's bytes, the special ids, and an encoder."""

    def __init__(self, tok, base, vocab_size: int, eos: list[int], plain: set[int]) -> None:
        self._tok = tok
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self.tokens = [base.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if i not in plain and base.is_special_token(i)]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (TokenizerWrapper then hands it text)
            raise TypeError("text only")
        return self._tok.encode(text, add_special_tokens=False).ids
