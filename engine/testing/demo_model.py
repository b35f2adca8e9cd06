"""A tiny random Llama with a real BPE tokenizer (byte-level or Metaspace), built offline.

Owns the demo model's recipe and its on-disk cache; it must never download
anything, and the same version string must always produce the same bytes
(nodes of one deployment each build it and must agree on every token id).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

from dpserve.engine.testing.demo_chat import PLAIN_TEMPLATE, TOOL_TOKENS, chat_template

VERSION = "demo-model-v1"
SEED = 1234

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)  # ids 0..3, in this order

VOCAB_SIZE = 2048  # the trained tokenizer's size (and the tiny model's vocabulary)
MAX_POSITIONS = 2048

# Model shapes. "tiny" (1 M parameters) is the default: a forward costs
# nothing, so fast tests and `make demo` stay fast. "small" has the shape of
# a real 135M-class Llama chat model (SmolLM-135M's), so engine costs show:
# its tokenizer is the same trained BPE, padded with invented words up to the
# model's vocabulary so that every id the model can produce decodes to text.
SIZES: dict[str, dict] = {
    "tiny": {
        "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
    },
    "small": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

CHAT_TEMPLATE = PLAIN_TEMPLATE  # the plain demo model's (demo_chat.py holds both)

# The corpus is generated here rather than read from the stdlib, whose
# docstrings change between Python releases and would change the tokenizer.
_WORDS = """
the of and to in is that it for as with was on be by at this are from or have an
they which one you were her all she there would their we him been has when who
will more no if out so said what up its about into than them can only other new
some could time these two may then do first any my now such like our over man me
even most made after also did many before must through back years where much your
way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never
day same another know while last might us great old year off come since against go
came right used take three model token request server engine batch cache prompt
answer question system user assistant reply stream socket process signal node rank
queue worker thread memory device tensor layer attention value key query sample
greedy seed length stop error health ready start restart drain timeout deadline
hello world python code function return class import print list dict string number
water light music river mountain forest city street house garden window table chair
book paper letter story history science energy power market price money family friend
child mother father morning evening night winter summer spring autumn small large
quick slow bright dark happy quiet simple clear open close read write send receive
"""
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "z", "br", "ch", "cl", "dr", "gr", "pl", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck")


def _corpus(rng: random.Random) -> list[str]:
    """Deterministic training text: English words, invented words, digits, code, chat."""
    words = _WORDS.split()
    invented = [
        "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(rng.randint(1, 3)))
        for _ in range(1500)
    ]
    lexicon = words * 6 + invented  # real words are frequent, invented ones rare
    lines = []
    for _ in range(6000):
        sentence = " ".join(rng.choice(lexicon) for _ in range(rng.randint(4, 14)))
        sentence = sentence[0].upper() + sentence[1:] + rng.choice((".", ".", "?", "!", ","))
        lines.append(sentence)
    for i in range(400):
        lines.append(f"{i} + {i * 7 % 101} = {i + i * 7 % 101}; x{i} = [{i % 10}, {i * 3}]")
        lines.append(f"def f{i}(x):\n    return x * {i} if x > {i % 13} else None\n")
    for role in ("system", "user", "assistant"):
        lines.append(f"{IM_START}{role}\n{' '.join(rng.choice(words) for _ in range(8))}")
    return lines


# Tokenizer families: "bytelevel" (GPT-2/Llama-3 style: every byte is a symbol)
# and "metaspace" (SentencePiece style, as Llama-2, Mistral and Gemma convert:
# spaces become U+2581, the decoder drops the space before the text's first
# token, and characters outside the vocabulary fall back to <0xXX> byte tokens).
TOKENIZERS = ("bytelevel", "metaspace")
_METASPACE = "\u2581"


def _template_processor(bos_id: int):
    from tokenizers import processors

    # BOS comes from the post-processor so that plain Tokenizer.encode() agrees
    # with add_bos_token=true in tokenizer_config.json.
    return processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )


def _build_tokenizer(kind: str = "bytelevel", chat: str = "plain"):
    """The trained tokenizer; with the "tools" chat template, its tags are added
    tokens right after the special ones (ordinary text to decoders and grammars)."""
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown demo tokenizer {kind!r} (one of {', '.join(TOKENIZERS)})")
    chat_template(chat)  # checks the name
    extra = TOOL_TOKENS if chat == "tools" else ()
    tok = _build_metaspace_tokenizer(extra) if kind == "metaspace" else _build_bytelevel_tokenizer(extra)
    return _unmark_special(tok, extra) if extra else tok


def _unmark_special(tok, contents: tuple[str, ...]):
    """The trainer adds `contents` as special tokens: make them plain added tokens
    (kept by skip_special_tokens, matched in any text, never normalized)."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        if added["content"] in contents:
            added["special"] = False
            added["normalized"] = False
    return Tokenizer.from_str(json.dumps(data))


def _build_bytelevel_tokenizer(extra: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        _template_processor(tok.token_to_id(BOS)),
    ])
    return tok


def _build_metaspace_tokenizer(extra: tuple[str, ...] = ()):
    """SentencePiece-style BPE: trained to VOCAB_SIZE - 256 ids, then the 256 byte
    tokens <0x00>..<0xFF> fill the top ids (byte_fallback), as in Llama-2's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_METASPACE, prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 256,
        special_tokens=[*SPECIAL_TOKENS, *extra],
        limit_alphabet=200,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([
        decoders.ByteFallback(),
        decoders.Metaspace(replacement=_METASPACE, prepend_scheme="first"),
    ])
    tok.post_processor = _template_processor(tok.token_to_id(BOS))
    return tok


def _pad_vocabulary(tok, size: int) -> None:
    """Grow the BPE vocabulary to `size` ids with invented words (no merges make
    them, so encoding is unchanged; decoding any id gives readable text)."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    rng = random.Random(SEED + 1)
    next_id = max(vocab.values()) + 1
    while next_id < size:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
        piece = "\u0120" + word  # byte-level BPE's leading space
        if piece not in vocab:
            vocab[piece] = next_id
            next_id += 1
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(data))


def _model_config(bos_id: int, eos_ids: list[int], size: str = "tiny") -> dict:
    shape = SIZES[size]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{k: shape[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")},
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,  # transformers 4.x spelling
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},  # 5.x
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape["tie_word_embeddings"],
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0],
        "pad_token_id": None,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face's Llama state-dict layout (stable since Llama 1)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def _weights(config: dict) -> dict:
    """Float32 weights drawn from one seeded generator in sorted-name order.

    Norms are ones, everything else N(0, initializer_range). The values never
    depend on transformers' init scheme, which has changed between releases,
    and building them does not import transformers (seconds of start-up).
    """
    import torch

    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in sorted(_parameter_shapes(config).items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.empty(shape, dtype=torch.float32).normal_(
                0.0, config["initializer_range"], generator=gen)
    return tensors


def _write_files(out: str, size: str = "tiny", tokenizer: str = "bytelevel", chat: str = "plain") -> None:
    from safetensors.torch import save_file

    if tokenizer != "bytelevel" and SIZES[size]["vocab_size"] != VOCAB_SIZE:
        raise ValueError(f"the {tokenizer} demo tokenizer comes in the tiny size only")
    tok = _build_tokenizer(tokenizer, chat)
    if SIZES[size]["vocab_size"] > VOCAB_SIZE:
        tok = _pad_vocabulary(tok, SIZES[size]["vocab_size"])
    bos_id, eos_id, im_end_id = (tok.token_to_id(t) for t in (BOS, EOS, IM_END))
    eos_ids = [eos_id, im_end_id]
    config = _model_config(bos_id, eos_ids, size)

    tok.save(os.path.join(out, "tokenizer.json"))
    save_file(_weights(config), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": bos_id, "eos_token_id": eos_ids},
        "tokenizer_config.json": _tokenizer_config(config["max_position_embeddings"], chat),
    }
    _write_json_files(out, files)
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(chat_template(chat))


def _tokenizer_config(max_length: int, chat: str = "plain") -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template(chat),
    }


def _write_json_files(out: str, files: dict[str, dict]) -> None:
    for name, data in files.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")


def write_tokenizer(out: str, tokenizer: str = "bytelevel", chat: str = "plain") -> str:
    """Write only the tiny demo model's tokenizer files (what an API server reads) into
    `out` (created): for tests and benchmarks of text handling, without torch."""
    os.makedirs(out, exist_ok=True)
    _build_tokenizer(tokenizer, chat).save(os.path.join(out, "tokenizer.json"))
    _write_json_files(out, {"tokenizer_config.json": _tokenizer_config(MAX_POSITIONS, chat)})
    return out


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in REQUIRED_FILES)


def create_demo_model(path: str, size: str = "tiny", tokenizer: str = "bytelevel", chat: str = "plain") -> str:
    """Write the demo model of this size (see SIZES), tokenizer family (see
    TOKENIZERS) and chat template (demo_chat.CHAT_TEMPLATES: "tools" adds the
    tool-call and thinking tags) into `path` (created) and return `path`.

    A complete directory is left untouched. The files are written into a
    sibling temp dir that is renamed into place, so a reader (or a racing
    writer) sees either nothing or the whole model, never part of it.
    """
    path = os.path.abspath(path)
    if is_complete(path):
        return path
    if os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(f"{path} exists, is not empty and is not a complete demo model")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        _write_files(tmp, size, tokenizer, chat)
        # mkdtemp (and safetensors) create private files; the model is meant to be shared.
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        try:
            os.rename(tmp, path)  # atomic; also replaces an empty dir
        except OSError:
            if not is_complete(path):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def default_demo_model_dir() -> str:
    base = os.environ.get("DPSERVE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "dpserve")
    return os.path.join(base, VERSION)


def ensure_demo_model() -> str:
    """The demo model's directory in the user's cache, built on first use."""
    return create_demo_model(default_demo_model_dir())
