"""dpserve.daemons.api.tokenizer against real tokenizers: a byte-level BPE trained here and both demo-model families (byte-level, Metaspace)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dpserve.daemons.api.detokenizer import IncrementalDetokenizer, StopChecker, _WindowDetokenizer, decode_continuation
from dpserve.daemons.api.tokenizer import TextTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SAMPLES = [
    "héllo wörld 日本語 emoji 🙂🚀",
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade naïve café.",
    "東京は日本の首都です。今日はいい天気ですね 🌸🍣",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم",
    "def main():\n    return [x ** 2 for x in range(10)]  # 🚀 squares\n",
    "Rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 漢字 👩‍👩‍👧 🇯🇵 ∑∫√ 😀😃😄😁",  # mostly unseen: split into bytes
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = " ".join(SAMPLES[:5]).split()
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(300)]
    return lines + SAMPLES[:5] * 20


def _gpt2_byte_chars() -> dict[int, str]:
    """The ByteLevel alphabet: the character that stands for each raw byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def make_model_dir(root: Path, tokenizer_json: Path, files: dict | None = None, **config) -> Path:
    """A model dir with our tokenizer.json; `config` overrides tokenizer_config.json keys
    (None deletes one); `files` adds other files (dicts are written as JSON)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_json, root / "tokenizer.json")
    tokenizer_config = {"bos_token": BOS, "eos_token": {"content": EOS, "special": True},
                        "add_bos_token": True, "chat_template": CHATML, **config}
    tokenizer_config = {k: v for k, v in tokenizer_config.items() if v is not None}
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in (files or {}).items():
        (root / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return root


@pytest.fixture(scope="session")
def tok(tmp_path_factory, tokenizer_json) -> TextTokenizer:
    return TextTokenizer.from_dir(make_model_dir(tmp_path_factory.mktemp("model"), tokenizer_json))


@pytest.fixture(scope="session")
def byte_id(tok) -> dict[int, int]:
    """Raw byte -> the id of the single-byte token, for building broken UTF-8 on purpose."""
    return {b: tok.backend.token_to_id(c) for b, c in _gpt2_byte_chars().items()}


def _detok_all(tok, ids, chunk_sizes, skip=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, pos = [], 0
    for size in chunk_sizes:
        pieces.append(detok.step(ids[pos:pos + size]))
        pos += size
    pieces.append(detok.step(ids[pos:]))
    return pieces, detok.flush()


# --- encode / decode -------------------------------------------------------------------

def test_round_trip_and_single_bos(tok):
    bos = tok.bos_token_id
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids[0] == bos and bos not in ids[1:]
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
    assert tok.decode(tok.encode("a"), skip_special_tokens=False) == BOS + "a"


def test_metadata(tok, tokenizer_json):
    assert tok.vocab_size == Tokenizer.from_file(str(tokenizer_json)).get_vocab_size() > 256
    assert tok.eos_token_ids == {tok.backend.token_to_id(EOS)}
    assert tok.model_name.startswith("model") and tok.adds_bos


def test_eos_ids_from_all_configs_and_dict_tokens(tmp_path, tokenizer_json):
    vocab = Tokenizer.from_file(str(tokenizer_json))
    im_end, im_start = vocab.token_to_id(IM_END), vocab.token_to_id(IM_START)
    model_dir = make_model_dir(
        tmp_path / "m", tokenizer_json, bos_token={"content": BOS, "lstrip": False},
        files={"generation_config.json": {"eos_token_id": [im_end]},
               "config.json": {"eos_token_id": im_start}})
    tok = TextTokenizer.from_dir(model_dir, model_name="served-name")
    assert tok.eos_token_ids == {vocab.token_to_id(EOS), im_end, im_start}
    assert tok.bos_token_id == vocab.token_to_id(BOS) and tok.model_name == "served-name"


def test_add_bos_token_false_overrides_post_processor(tmp_path, tokenizer_json):
    tok = TextTokenizer.from_dir(make_model_dir(tmp_path / "m", tokenizer_json, add_bos_token=False))
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert not tok.adds_bos
    assert tok.encode_chat_prompt("hi")[:1] != [tok.bos_token_id]


# --- incremental detokenization ----------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_full_decode_random_ids(tok, skip):
    rng = random.Random(42)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        full = tok.decode(ids, skip_special_tokens=skip)
        for chunks in ([1] * len(ids), [rng.randrange(1, 8) for _ in ids]):
            pieces, rest = _detok_all(tok, ids, chunks, skip)
            assert "".join(pieces) + rest == full


def test_valid_text_split_mid_character_never_emits_replacement_char(tok):
    ids = tok.encode(" ".join(SAMPLES), add_special_tokens=False)
    # The rare sample really is split inside characters: some tokens decode to U+FFFD alone.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    rng = random.Random(7)
    for chunks in ([1] * len(ids), [rng.randrange(1, 5) for _ in ids]):
        pieces, rest = _detok_all(tok, ids, chunks)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) + rest == " ".join(SAMPLES) and rest == ""


def test_output_text_continues_the_prompt(tok, byte_id):
    """What the API server does: the detokenizer starts on the prompt, and the text is
    decode(prompt + output) minus decode(prompt), streamed and whole alike."""
    prompt = tok.encode("Привет, мир! 日本")
    output = tok.encode("語 emoji 🙂🚀 done", add_special_tokens=False)
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)):]
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.step([i]) for i in output) + detok.flush() == expected
    assert decode_continuation(tok, prompt, output) == expected
    # A prompt given as raw ids may end inside a character; the output must not absorb it.
    raw_prompt = [byte_id[0xE6], byte_id[0x97]]
    output = [byte_id[0xA5]] + tok.encode("abc", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, raw_prompt)
    assert detok.step(output) + detok.flush() == tok.decode(output) == "\ufffdabc"
    assert decode_continuation(tok, raw_prompt, output) == "\ufffdabc"


def test_incremental_equals_full_decode_for_mostly_broken_utf8(tok, byte_id):
    pool = [byte_id[b] for b in range(0x80, 0xF5)] * 3 + list(range(tok.vocab_size))
    rng = random.Random(11)
    for _ in range(200):
        ids = rng.choices(pool, k=rng.randrange(1, 200))
        pieces, rest = _detok_all(tok, ids, [rng.randrange(1, 3) for _ in ids])
        assert "".join(pieces) + rest == tok.decode(ids)


@pytest.mark.parametrize("layout", [["E6", "97", "sp", "sp", "sp", "A5"], ["E6", "sp", "97", "sp", "A5"]])
def test_forced_release_never_splits_an_open_character(tok, byte_id, layout):
    im_start = tok.backend.token_to_id(IM_START)
    # Held long enough to force a release while "日" (E6 97 A5) is open, split by
    # skipped special tokens: a release inside the character would lose it.
    ids = [byte_id[0x80]] * 15 + [im_start if x == "sp" else byte_id[int(x, 16)] for x in layout]
    pieces, rest = _detok_all(tok, ids, [1] * len(ids))
    assert "".join(pieces) + rest == tok.decode(ids) == "\ufffd" * 15 + "日"
    assert "".join(pieces[:17]) == "\ufffd" * 15


def _recording_decoder(monkeypatch) -> list[int]:
    """Make the window fallback record the length of every window it decodes."""
    sizes, real_decode = [], _WindowDetokenizer._decode

    def decode(self, window):
        sizes.append(len(window))
        return real_decode(self, window)

    monkeypatch.setattr(_WindowDetokenizer, "_decode", decode)
    return sizes


def test_invalid_bytes_are_released_mid_stream_and_window_stays_short(tok, byte_id, monkeypatch):
    orphan = byte_id[0x80]  # a UTF-8 continuation byte with no lead byte: never valid
    ids = [orphan] * 100 + tok.encode("日本語 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    sizes = _recording_decoder(monkeypatch)
    pieces = [detok.step([i]) for i in ids]
    assert detok._window is not None  # DecodeStream alone would hold them all to the end
    assert "\ufffd" * 50 in "".join(pieces[:100])  # not all held until the end
    assert "".join(pieces) + detok.flush() == tok.decode(ids)
    assert max(sizes) <= 32


def test_skipped_special_tokens_do_not_grow_the_window(tok, monkeypatch):
    im_start = tok.backend.token_to_id(IM_START)
    ids = tok.encode("hello", add_special_tokens=False) + [im_start] * 100 + tok.encode(" wörld")
    detok = IncrementalDetokenizer(tok)
    sizes = _recording_decoder(monkeypatch)
    assert "".join(detok.step([i]) for i in ids) + detok.flush() == "hello wörld"
    assert max(sizes) <= 32


def test_long_stream_decodes_a_bounded_window(tok, monkeypatch):
    ids = tok.encode(" ".join(SAMPLES) * 30, add_special_tokens=False)
    assert len(ids) > 1000
    sizes = _recording_decoder(monkeypatch)
    window = _WindowDetokenizer(tok.backend, True, [])
    text = window.step(ids)
    assert len(window._ids) <= 300  # consumed ids are dropped: memory is bounded too
    assert text + window.flush() == tok.decode(ids)
    assert max(sizes) <= 16
    detok = IncrementalDetokenizer(tok)  # valid text: DecodeStream never falls back
    assert "".join(detok.step([i]) for i in ids) + detok.flush() == tok.decode(ids)
    assert detok._window is None and len(detok._held) == 0


# --- stop strings ------------------------------------------------------------------------

def _run_stops(stops, chunks):
    checker, out = StopChecker(stops), []
    for chunk in chunks:
        text, hit = checker.feed(chunk)
        out.append(text)
        if hit:
            return "".join(out), True, checker.stop_reason
    return "".join(out) + checker.flush(), False, None


def test_stop_across_chunk_boundary_is_held_then_cut():
    checker = StopChecker(["world"])
    assert checker.feed("hello wo") == ("hello ", False)  # "wo" may start "world"
    assert checker.feed("rld and more") == ("", True)
    assert checker.feed("later") == ("", True) and checker.stop_reason == "world"
    assert checker.flush() == ""


def test_stop_held_text_released_when_it_diverges_or_at_flush():
    checker = StopChecker(["world"])
    assert checker.feed("hello wor") == ("hello ", False)
    assert checker.feed("m") == ("worm", False)
    assert checker.feed("  wo") == ("  ", False)
    assert checker.flush() == "wo" and not checker.is_stopped


def test_multiple_stops_first_to_complete_wins():
    assert _run_stops(["\n\n", "END"], ["a END b\n\n"]) == ("a ", True, "END")
    assert _run_stops(["abcd", "bc"], ["xab", "cd"]) == ("xa", True, "bc")
    assert _run_stops(["abc", "b"], ["zzab"]) == ("zza", True, "b")
    assert _run_stops(["bc", "abc"], ["abc"]) == ("", True, "abc")  # same end: longer wins


def test_stop_at_very_start_and_overlapping_prefixes():
    assert _run_stops(["STOP"], ["ST", "OP rest"]) == ("", True, "STOP")
    assert _run_stops(["aab"], ["a", "a", "a", "b"]) == ("a", True, "aab")
    assert _run_stops(["abab"], ["ababa", "b"]) == ("", True, "abab")
    assert _run_stops([], ["no stops"]) == ("no stops", False, None)
    assert _run_stops([""], ["empty stop ignored"]) == ("empty stop ignored", False, None)


def test_streaming_equals_non_streaming_for_any_chunking():
    rng = random.Random(3)
    for _ in range(500):
        text = "".join(rng.choices("ab c🙂", k=rng.randrange(0, 30)))
        stops = ["".join(rng.choices("ab c🙂", k=rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        whole = _run_stops(stops, [text])
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 6))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _run_stops(stops, chunks) == whole
        assert not any(s in whole[0] for s in stops)
        assert text.startswith(whole[0])


def test_detokenizer_and_stop_checker_pipeline(tok):
    text = "The quick brown fox 🙂 jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    detok, checker, out = IncrementalDetokenizer(tok), StopChecker(["🙂 ju"]), []
    for token_id in ids:
        emitted, hit = checker.feed(detok.step([token_id]))
        out.append(emitted)
        if hit:
            break
    assert "".join(out) == "The quick brown fox "


# --- chat templates -----------------------------------------------------------------------

def test_chat_template_roles_parts_and_generation_prompt(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "🙂"}]},
        {"role": "assistant", "content": "Hi."},
    ]
    body = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo\n🙂<|im_end|>\n"
            "<|im_start|>assistant\nHi.<|im_end|>\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == body
    prompt = tok.apply_chat_template(messages)
    assert prompt == body + "<|im_start|>assistant\n"
    ids = tok.encode_chat_prompt(prompt)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.backend.token_to_id(IM_START)) == 4  # parsed as special tokens


def test_template_that_writes_bos_gets_no_second_bos(tmp_path, tokenizer_json):
    model_dir = make_model_dir(tmp_path / "m", tokenizer_json,
                               files={"chat_template.jinja": "{{ bos_token }}" + CHATML})
    tok = TextTokenizer.from_dir(model_dir)  # the .jinja file wins over tokenizer_config
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith(BOS + "<|im_start|>user")
    assert tok.encode_chat_prompt(prompt).count(tok.bos_token_id) == 1


def test_template_list_globals_and_errors(tmp_path, tokenizer_json):
    template = [{"name": "tool_use", "template": "tools"},
                {"name": "default", "template": (
                    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                    "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}")}]
    tok = TextTokenizer.from_dir(make_model_dir(tmp_path / "m", tokenizer_json, chat_template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '[{"role": "user", "content": "é"}]|4|' + EOS)
    with pytest.raises(ValueError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="text only"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_no_chat_template_is_a_clear_error(tmp_path, tokenizer_json):
    tok = TextTokenizer.from_dir(make_model_dir(tmp_path / "m", tokenizer_json, chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --- the demo model and process hygiene ------------------------------------------------------

@pytest.fixture(params=["trained-here", "engine-demo-model"])
def any_model_dir(request, tmp_path_factory, tokenizer_json) -> Path:
    if request.param == "trained-here":
        return make_model_dir(tmp_path_factory.mktemp("m"), tokenizer_json)
    return Path(request.getfixturevalue("demo_model_dir"))


def test_model_dir_end_to_end(any_model_dir):
    tok = TextTokenizer.from_dir(any_model_dir)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
        ids = tok.encode(text, add_special_tokens=False)
        pieces, rest = _detok_all(tok, ids, [1] * len(ids))
        assert "".join(pieces) + rest == text and not any("\ufffd" in p for p in pieces)
    rng = random.Random(1)
    ids = [rng.randrange(tok.vocab_size) for _ in range(500)]
    pieces, rest = _detok_all(tok, ids, [rng.randrange(1, 4) for _ in ids])
    assert "".join(pieces) + rest == tok.decode(ids)
    prompt_ids = tok.encode_chat_prompt(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert prompt_ids[0] == tok.bos_token_id and prompt_ids.count(tok.bos_token_id) == 1
    assert tok.eos_token_ids


def test_import_pulls_in_neither_torch_nor_transformers():
    code = ("import sys, dpserve.daemons.api.tokenizer, dpserve.daemons.api.detokenizer; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- both tokenizer families against transformers ------------------------------------------

@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    from dpserve.engine.testing.demo_model import write_tokenizer

    return request.param, Path(write_tokenizer(str(tmp_path_factory.mktemp(request.param)), request.param))


def test_text_equals_transformers_continuation_for_both_families(family_dir):
    """Random prompts and outputs (valid text and random ids) of the demo tokenizers:
    streamed in random chunks, whole, and cut by stop strings, the text is transformers'
    decode(prompt + output) minus decode(prompt). For Metaspace that keeps the output's
    leading space, which a lone decode drops."""
    from transformers import AutoTokenizer

    name, model_dir = family_dir
    hf, tok = AutoTokenizer.from_pretrained(str(model_dir)), TextTokenizer.from_dir(model_dir)
    rng = random.Random(5)
    words = " ".join(SAMPLES).split()
    lone_decode_differs = 0
    # Byte-fallback tokens are frequent here so that invalid byte runs, which a
    # ByteFallback decoder turns into U+FFFD as a whole, come up often.
    random_ids = list(range(tok.vocab_size)) + sorted(tok.byte_fallback_ids) * 4
    for case in range(150):
        prompt = tok.encode(" ".join(rng.choices(words, k=rng.randrange(1, 6))))
        assert prompt == hf(tok.decode(prompt)).input_ids
        if case % 2:
            output = tok.encode(" " + " ".join(rng.choices(words, k=rng.randrange(1, 8))), add_special_tokens=False)
        else:
            output = rng.choices(random_ids, k=rng.randrange(1, 40))
        head, full = hf.decode(prompt, skip_special_tokens=True), hf.decode(prompt + output, skip_special_tokens=True)
        if not full.startswith(head):
            continue  # output bytes broke a byte-fallback run of the prompt (see prompt_context)
        expected = full[len(head):]
        lone_decode_differs += expected != hf.decode(output, skip_special_tokens=True)

        detok, pieces, pos = IncrementalDetokenizer(tok, prompt), [], 0
        while pos < len(output):
            size = rng.randrange(1, 4)
            pieces.append(detok.step(output[pos:pos + size]))
            pos += size
        assert "".join(pieces) + detok.flush() == expected
        assert decode_continuation(tok, prompt, output) == expected

        if len(expected) >= 4:  # a stop string spanning tokens, fed token by token
            start = rng.randrange(len(expected) - 3)
            stop = expected[start:start + 3]
            detok, checker, out = IncrementalDetokenizer(tok, prompt), StopChecker([stop]), []
            for token_id in [*output, None]:  # None: the end, where the detokenizer flushes
                text, hit = checker.feed(detok.step([token_id]) if token_id is not None else detok.flush())
                out.append(text)
                if hit:
                    break
            assert checker.is_stopped and "".join(out) == expected[:expected.find(stop)]
    assert (lone_decode_differs > 20) == (name == "metaspace")


def test_demo_model_cli_writes_the_metaspace_variant(tmp_path):
    out = tmp_path / "m"
    run = subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "demo-model", str(out), "--tokenizer", "metaspace"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    spec = json.loads((out / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["type"] == "Metaspace" and spec["model"]["byte_fallback"] is True
    tok = TextTokenizer.from_dir(out)
    assert len(tok.byte_fallback_ids) == 256 and tok.vocab_size == 2048
    refused = subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "demo-model", str(tmp_path / "s"),
                              "--size", "small", "--tokenizer", "metaspace"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "tiny size only" in refused.stderr, refused.stderr
    assert not (tmp_path / "s").exists()


# --- vLLM's request API: fill-in-the-middle, continue_final_message, token strings ---------


def test_fim_prompt_uses_the_vocabularys_fim_tokens(tokenizer_json):
    plain = Tokenizer.from_file(str(tokenizer_json))
    assert TextTokenizer(plain, {}, None).fim_prompt("def f(", "return x") is None  # no FIM tokens: the API's 400
    for prefix, suffix, middle in (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<PRE>", "<SUF>", "<MID>")):
        fim = Tokenizer.from_file(str(tokenizer_json))
        fim.add_special_tokens([prefix, suffix, middle])
        text = TextTokenizer(fim, {}, None).fim_prompt("def f(", "return x")
        assert text == f"{prefix}def f({suffix}return x{middle}"
        ids = TextTokenizer(fim, {}, None).encode(text, add_special_tokens=False)
        assert fim.token_to_id(prefix) == ids[0] and fim.token_to_id(middle) == ids[-1]  # each one token


def test_continue_final_message_ends_inside_the_last_message(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("assistant\nSure, the") and not text.endswith(IM_END)
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    assert tok.token_strs(tok.encode("hello", add_special_tokens=False)) == [
        tok.backend.id_to_token(i) for i in tok.encode("hello", add_special_tokens=False)]
