"""Micro-benchmark of the API server's text hot paths: prompt encode, streaming detokenization.

Usage: .venv/bin/python benchmarks/tokenizer_bench.py [MODEL_DIR]
Without MODEL_DIR a byte-level BPE tokenizer (4k vocab) is trained into a temp dir first.
Prints microseconds per call / per token; nothing here imports torch or transformers.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.api.detokenizer import IncrementalDetokenizer, StopChecker  # noqa: E402
from dpserve.daemons.api.tokenizer import TextTokenizer  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from benchmarks.common import begin, parser  # noqa: E402

SHORT_PROMPT = "Write a haiku about the ocean at night, then translate it into French."
STREAM_TEXT = (
    "Sure! Here is a haiku about the ocean at night:\n\nDark waves fold and breathe,\n"
    "the moon spills silver on foam — 月が海を照らす 🌊🌙\n\nEn français : Les vagues sombres "
    "respirent, la lune verse son argent sur l'écume. Naïve café façade; Привет мир. "
) * 8
WORDS = (STREAM_TEXT + " the of and to in is that it for as with was on be by at this are from "
         "server request token engine batch prompt stream cache 日本語 東京 😀🚀").split()


def build_tokenizer_dir(root: Path) -> Path:
    bos = "<|begin_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [bos, "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    # Pseudo-words from syllables give the trainer enough distinct pairs to fill the vocab.
    syllables = [a + b for a in "bcdfgklmnprstvz" for b in "aeiou"] + ["日", "本", "語", "🙂"]
    words = WORDS + ["".join(rng.choices(syllables, k=rng.randrange(1, 4))) for _ in range(3000)]
    tok.train_from_iterator((" ".join(rng.choices(words, k=20)) for _ in range(5000)), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    return root


def per_call_us(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5 rounds: the least disturbed by the rest of the machine
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR", help="a model folder with tokenizer.json (default: train one)")
    args, _ = begin(p, argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else build_tokenizer_dir(Path(tmp))
        tok = TextTokenizer.from_dir(model_dir)
    stream = tok.encode(STREAM_TEXT, add_special_tokens=False)[:256]
    assert len(stream) == 256, len(stream)
    print(f"tokenizer: {model_dir} (vocab {tok.vocab_size})")
    print(f"prompt encode ({len(tok.encode(SHORT_PROMPT))} tokens): "
          f"{per_call_us(lambda: tok.encode(SHORT_PROMPT), 20000):.2f} us/call")

    def detokenize(chunk: int) -> None:
        detok = IncrementalDetokenizer(tok, stream[:5])
        for i in range(0, len(stream), chunk):
            detok.step(stream[i:i + chunk])
        detok.flush()

    def detokenize_with_stops() -> None:
        detok, stops = IncrementalDetokenizer(tok), StopChecker(["</answer>", "\n\nUser:"])
        for token_id in stream:
            stops.feed(detok.step((token_id,)))
        stops.feed(detok.flush())
        stops.flush()

    def naive_full_decode() -> None:  # what the window avoids: decode everything per token
        for i in range(1, len(stream) + 1):
            tok.decode(stream[:i])

    for label, fn in (("detokenize, 1 token/step", lambda: detokenize(1)),
                      ("detokenize, 8 tokens/step", lambda: detokenize(8)),
                      ("detokenize + 2 stop strings, 1 token/step", detokenize_with_stops),
                      ("baseline: full decode per token", naive_full_decode)):
        print(f"{label} over a 256-token stream: {per_call_us(fn, 50) / 256:.2f} us/token")


if __name__ == "__main__":
    main()
