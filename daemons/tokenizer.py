"""API-server text: tokenizer loading, chat templates, streaming detokenization, stop strings.

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
from tokenizers.decoders import DecodeStream

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
    data = json.loads(path.read_text(encoding="utf-8"))
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
        named by generation_config.json and config.json (all are stop tokens)."""
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
        return cls(Tokenizer.from_file(str(tokenizer_file)), tokenizer_config,
                   _pick_chat_template(model_dir, tokenizer_config), extra_eos,
                   model_name or model_dir.resolve().name)

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
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
        try:
            return self._chat_template.render(
                messages=rendered_messages, add_generation_prompt=add_generation_prompt,
                **self._special_tokens, **template_kwargs)
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. None + str
            raise ValueError(f"chat template error: {exc}") from exc

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
    return _prompt_context(tokenizer._tok, prompt_ids, skip_special_tokens)[0]


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
    backend = tokenizer._tok
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
        self._backend = tokenizer._tok
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
