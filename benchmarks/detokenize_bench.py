"""Micro-benchmark of the API server's per-token text cost, before and after the
detokenizer moved to tokenizers' DecodeStream primed with the prompt (issue 13).

Usage: .venv/bin/python benchmarks/detokenize_bench.py [bytelevel|metaspace ...]
For each demo tokenizer family (byte-level BPE, and Metaspace with byte fallback,
written by engine/demo_model.py without torch) it prints microseconds per output token:
  before  the hand-written window detokenizer started without the prompt (what the API
          server ran until now; the same code is today's fallback, _WindowDetokenizer),
          and a whole answer decoded alone;
  after   IncrementalDetokenizer primed with the prompt's tail (DecodeStream), and a
          whole answer decoded as the prompt's continuation (decode_continuation).
Best of 5 rounds; nothing is asserted.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.api.detokenizer import IncrementalDetokenizer, _WindowDetokenizer, decode_continuation  # noqa: E402
from dpserve.daemons.api.tokenizer import TextTokenizer  # noqa: E402
from dpserve.engine.testing.demo_model import TOKENIZERS, write_tokenizer  # noqa: E402

from benchmarks.common import begin, parser  # noqa: E402

PROMPT = "Write a short answer about the river and the mountain, then say hello to the world."
ANSWER = (
    "The river runs past the mountain and the forest, and the city wakes in the morning light. "
    "Hello world! def f(x): return x * 2  # 日本語 façade café 🙂 "
) * 6


def per_token_us(fn, tokens: int, calls: int = 30) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: the round least disturbed by the rest of the machine
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best / tokens * 1e6


def bench(kind: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tok = TextTokenizer.from_dir(write_tokenizer(tmp, kind))
    prompt = tok.encode(PROMPT)
    output = tok.encode(" " + ANSWER, add_special_tokens=False)[:256]
    backend = tok.backend
    n = len(output)

    def before_stream(chunk: int) -> None:
        detok = _WindowDetokenizer(backend, True, [])
        for i in range(0, n, chunk):
            detok.step(output[i:i + chunk])
        detok.flush()

    def after_stream(chunk: int) -> None:
        detok = IncrementalDetokenizer(tok, prompt)
        for i in range(0, n, chunk):
            detok.step(output[i:i + chunk])
        detok.flush()

    rows = [
        ("stream, 1 token/step", lambda: before_stream(1), lambda: after_stream(1)),
        ("stream, 8 tokens/step", lambda: before_stream(8), lambda: after_stream(8)),
        ("whole answer", lambda: tok.decode(output),
         lambda: decode_continuation(tok, prompt, output)),
    ]
    print(f"{kind}: vocab {tok.vocab_size}, {n}-token answer after a {len(prompt)}-token prompt")
    for label, before, after in rows:
        b, a = per_token_us(before, n), per_token_us(after, n)
        print(f"  {label:24s} before {b:6.2f} us/token   after {a:6.2f} us/token   ({b / a:4.1f}x)")


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("kinds", nargs="*", metavar="KIND", help=f"tokenizer families to measure: {', '.join(TOKENIZERS)} (default: all)")
    args, _ = begin(p, argv)
    if unknown := [k for k in args.kinds if k not in TOKENIZERS]:
        p.error(f"unknown tokenizer family {', '.join(unknown)} (one of {', '.join(TOKENIZERS)})")
    for kind in args.kinds or TOKENIZERS:
        bench(kind)


if __name__ == "__main__":
    main()
