"""The server's default sampling parameters: vLLM's --generation-config and --override-generation-config.

vLLM (0.32; `--generation-config auto`, its default) fills a request's unset temperature, top_p,
top_k, min_p, penalties and max_tokens from the model's generation_config.json, the values its
maker recommends (Llama 3: temperature 0.6, top_p 0.9), and says so in its log. `vllm` keeps the
neutral defaults (temperature 1, no truncation, no penalties); a directory reads that directory's
generation_config.json instead of the model's. The override's JSON object goes over either, with
the same field names (max_new_tokens for the answer's length, as transformers names it).

Owns reading and checking those values (the request's own bounds: a value a request could not send
is refused at start, naming its source) and the defaults' one question for routing (do requests that
set nothing need the processors path?). A request's own value always wins.
"""

from __future__ import annotations

import json
import os

import msgspec
from dpserve.daemons.api.openai_types import MaxTokens, MinP, Penalty, RepetitionPenalty, Temperature, TopK, TopP

SOURCES = ("auto", "vllm")  # or a directory holding a generation_config.json


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """What a request that sets nothing samples with (vLLM's neutral values unless a config says)."""

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0  # 0 and -1: every token
    min_p: MinP = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    max_new_tokens: MaxTokens | None = None  # chat's max_tokens when a request gives none (under the context left)

    @property
    def needs_processors(self) -> bool:
        """Whether a request that sets none of these still needs penalties or min_p applied."""
        return (self.min_p > 0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    def differences(self) -> dict[str, float | int]:
        """The values that are not vLLM's neutral ones (for the start's log line)."""
        neutral = NEUTRAL
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) != getattr(neutral, f)}


NEUTRAL = SamplingDefaults()
FIELDS = frozenset(SamplingDefaults.__struct_fields__)


def parse_override(text: str) -> dict[str, object]:
    """--override-generation-config's JSON object (empty text: none); ValueError naming the flag."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    return value


def load(model_dir: str, source: str, override: str = "") -> SamplingDefaults:
    """The defaults for `model_dir` under --generation-config `source` and the override's JSON.

    ValueError (naming the file or the flag) for a value a request could not send, a source that
    is neither auto, vllm nor a directory, or unreadable JSON."""
    values: dict[str, object] = {}
    where = "--override-generation-config"
    if source != "vllm":
        directory = model_dir if source == "auto" else source
        if source not in SOURCES and not os.path.isdir(source):
            raise ValueError(f"--generation-config {source!r}: not auto, vllm or a directory")
        path = os.path.join(directory, "generation_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            config = {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: {exc} (--generation-config vllm serves without it)") from None
        if isinstance(config, dict):
            values = {k: v for k, v in config.items() if k in FIELDS and v is not None}
            where = path
    overrides = parse_override(override)
    unknown = sorted(set(overrides) - FIELDS)
    if unknown:
        raise ValueError(f"--override-generation-config: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(FIELDS))}")
    if overrides:
        where = f"{where} with --override-generation-config" if values else "--override-generation-config"
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(values, SamplingDefaults)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{where}: {exc} (a request could not send it either)") from None
