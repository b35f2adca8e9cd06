"""API-server text in: tokenizer loading, chat templates, encoding (detokenizer.py: text out).

Owns everything between request text and token ids. It must never import torch or
transformers (directly or through a dependency): API servers start in well under a second.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# How many input bytes can shrink into one byte of normalized text, per normalizer
# (None: no bound, e.g. Strip or StripAccents delete input). Canonical composition
# takes at most 3 bytes to 1 (Hangul L+V+T jamo, 9 bytes, -> one 3-byte syllable);
# compatibility mappings take 4 (U+1D400, 4 bytes, -> "A"); lowercasing 3 (the
# Kelvin sign, 3 bytes, -> "k"). Prepend and growing Replaces only add bytes.
_NORMALIZER_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1}
# Pre-tokenizers that keep every byte of their input (others drop whitespace or delimiters).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}


def _normalizer_shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        return 1 if pattern is not None and len(content.encode()) >= len(pattern.encode()) else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_bytes(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_bytes(p) for p in spec.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def max_bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """An upper bound on the bytes of input text that one token can stand for, or None.

    Why it holds: a BPE model splits the (normalized, pre-tokenized) text into
    vocabulary entries whose concatenation is that text, so every byte is covered
    by exactly one token, and no entry is longer than the longest string in the
    vocabulary or among the added tokens (byte-level vocabularies spell one byte
    per character; other vocabularies are measured in UTF-8, which only
    overstates). An unknown character becomes one unknown token (at most 4 bytes)
    unless fuse_unk merges runs of them, and a normalizer can shrink the input by
    at most its factor above. Any other model, normalizer or pre-tokenizer: None.
    """
    model = tokenizer.model
    if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk):
        return None
    norm = tokenizer.normalizer
    shrink = _normalizer_shrink(json.loads(norm.__getstate__()) if norm is not None else None)
    pre = tokenizer.pre_tokenizer
    pre_spec = json.loads(pre.__getstate__()) if pre is not None else None
    if shrink is None or not _keeps_bytes(pre_spec):
        return None
    byte_level = '"ByteLevel"' in json.dumps(pre_spec)
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
    added = tokenizer.get_added_tokens_decoder().values()
    longest = max([longest, 4, *(len(t.content.encode()) for t in added)])
    return longest * shrink


def byte_fallback_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the <0xXX> tokens when the decoder has ByteFallback, else none."""
    decoder = tokenizer.decoder
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
        return frozenset()
    return frozenset(i for t, i in tokenizer.get_vocab().items() if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))


def _token_text(value: Any) -> str | None:
    """A special-token field from tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: bad JSON, bad UTF-8
        raise ValueError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _pick_chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """chat_template.jinja wins (as in transformers), then tokenizer_config.json, then
    chat_template.json. A list of named templates yields "default", else the first."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for source in (tokenizer_config, _read_json(model_dir / "chat_template.json")):
        template = source.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str) and template.strip():
            return template
    return None


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers that some
    templates carry for training) and renders the body unchanged, as transformers does."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes; transformers replaces it with plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like transformers' own, so that
    templates written for transformers render byte-for-byte the same here."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _text_content(content: Any) -> Any:
    """OpenAI content parts -> one string; text parts are joined with "\\n" (vLLM's rule)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported content part {kind!r}: this model takes text only")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


# (prefix, suffix, middle) token triples of the FIM vocabularies in use: Qwen2.5-Coder /
# StarCoder2 style, StarCoder / SantaCoder, CodeLlama, DeepSeek-Coder.
_FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<PRE>", "<SUF>", "<MID>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)


def _continue_final(text: str, messages: list[dict]) -> str:
    """The rendered chat cut right after the final message's content, so the model
    continues it (transformers' continue_final_message rule)."""
    if not messages:
        raise ValueError("continue_final_message needs at least one message")
    content = messages[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    at = text.rfind(content.strip())
    if at < 0:
        raise ValueError("continue_final_message: the final message's content is not in the rendered chat")
    return text[: at + len(content.strip())]


class TextTokenizer:
    """A Hugging Face tokenizer directory, loaded with the `tokenizers` library only.

    Immutable after construction; one instance serves every request of a process.
    BOS rule: `add_bos_token` in tokenizer_config.json, when present, overrides whether
    the tokenizer.json post-processor puts a BOS first (as transformers' Llama/Gemma
    tokenizers do). Chat prompts get exactly one BOS (see encode_chat_prompt).
    """

    def __init__(self, tokenizer: Tokenizer, tokenizer_config: dict, chat_template: str | None,
                 extra_eos_ids: Iterable[int] = (), model_name: str = "") -> None:
        tokenizer.no_truncation()  # a tokenizer.json may carry a max_length: never cut prompts
        tokenizer.no_padding()
        self._tok = tokenizer
        self.config = tokenizer_config  # tokenizer_config.json as read (/tokenizer_info)
        self.chat_template_source = chat_template
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch  # _fast: 0.20.2+
        self.model_name = model_name
        # Passed to templates as variables, as transformers passes its special_tokens_map.
        self._special_tokens = {
            f"{kind}_token": text for kind in ("bos", "eos", "unk", "pad")
            if (text := _token_text(tokenizer_config.get(f"{kind}_token"))) is not None
        }
        self.bos_token = self._special_tokens.get("bos_token")
        self.eos_token = self._special_tokens.get("eos_token")
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = set(extra_eos_ids)
        if self.eos_token and (eos_id := tokenizer.token_to_id(self.eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

        self._prepend_bos = self._strip_bos = False
        add_bos = tokenizer_config.get("add_bos_token")
        if self.bos_token_id is not None and isinstance(add_bos, bool):
            probe = tokenizer.encode("a", add_special_tokens=True).ids
            post_processor_adds = probe[:1] == [self.bos_token_id]
            self._prepend_bos = add_bos and not post_processor_adds
            self._strip_bos = post_processor_adds and not add_bos
        self.adds_bos = self.bos_token_id is not None and self.encode("a")[:1] == [self.bos_token_id]
        self.max_bytes_per_token = max_bytes_per_token(tokenizer)
        self.byte_fallback_ids = byte_fallback_ids(tokenizer)
        # Compiled once, at load: a broken template fails the start, not a request.
        self._chat_template = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path, model_name: str | None = None) -> TextTokenizer:
        """Load tokenizer.json, tokenizer_config.json, the chat template and the EOS ids
        named by generation_config.json and config.json (all are stop tokens).
        A missing tokenizer.json is FileNotFoundError, an unreadable file ValueError;
        each names the file in one line."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found (only fast tokenizers are supported)")
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            config = _read_json(model_dir / name)
            text_config = config.get("text_config")  # multimodal configs nest the LM's ids
            for value in (config.get("eos_token_id"),
                          text_config.get("eos_token_id") if isinstance(text_config, dict) else None):
                values = value if isinstance(value, list) else [value]
                extra_eos += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises bare Exception on a bad file
            raise ValueError(f"cannot load {tokenizer_file}: {exc}") from None
        return cls(backend, tokenizer_config,
                   _pick_chat_template(model_dir, tokenizer_config), extra_eos,
                   model_name or model_dir.resolve().name)

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers` Tokenizer underneath (the detokenizer steps it directly)."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special-token text in `text` is always parsed as the
        special token; `add_special_tokens` only controls the BOS/EOS the model adds."""
        ids = self._ids(text, add_special_tokens)
        if add_special_tokens:
            if self._prepend_bos:
                ids.insert(0, self.bos_token_id)
            elif self._strip_bos:
                del ids[0]  # only set when the post-processor always puts BOS first
        return ids

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch_fast, not encode: it releases the GIL while the Rust code runs
        # (encode holds it, so a long prompt on a worker thread would still stall the
        # event loop), and it skips the offsets nobody here reads. The same ids.
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (transformers' convert_ids_to_tokens)."""
        lookup = self._tok.id_to_token
        return [lookup(i) or "" for i in ids]

    def fim_prompt(self, prompt: str, suffix: str) -> str | None:
        """A fill-in-the-middle prompt for this vocabulary's FIM tokens, or None without them.

        Prefix-suffix-middle order, as the models that define these tokens were trained."""
        vocab = self._tok.token_to_id
        for begin, hole, end in _FIM_TOKENS:
            if vocab(begin) is not None and vocab(hole) is not None and vocab(end) is not None:
                return f"{begin}{prompt}{hole}{suffix}{end}"
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """Render `messages` to prompt text. Extra kwargs (tools, enable_thinking, ...) reach
        the template as variables. Raises ValueError for a model without a template, for
        non-text content and for errors the template raises (e.g. roles not alternating)."""
        if self._chat_template is None:
            raise ValueError(
                f"model {self.model_name!r} has no chat template (none in chat_template.jinja "
                "or tokenizer_config.json); use the completions API or supply a template")
        rendered_messages = [
            {**m, "content": _text_content(m["content"])} if "content" in m else dict(m)
            for m in messages
        ]
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        try:
            text = self._chat_template.render(
                messages=rendered_messages, add_generation_prompt=add_generation_prompt,
                **self._special_tokens, **template_kwargs)
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. None + str
            raise ValueError(f"chat template error: {exc}") from exc
        return _continue_final(text, rendered_messages) if continue_final_message else text

    def encode_chat_prompt(self, prompt: str) -> list[int]:
        """Ids for a rendered chat prompt, with exactly one BOS when the model uses one.

        Rule: the template owns the text, so it is encoded with add_special_tokens=False
        (no post-processor, hence never an EOS); then, if plain prompts would start with
        BOS and the template did not write one, a single BOS is prepended.
        """
        ids = self._ids(prompt, False)
        if self.adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids
