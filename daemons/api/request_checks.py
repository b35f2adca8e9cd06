"""Request checks: a JSON body decoded into its Struct, validated, and read out.

Every failure is a 400 ApiError naming the field. Parameters we know but do not
implement get a 400 when set to anything but their default (UNSUPPORTED); unknown
fields are ignored (as vLLM does) and reported to a callback. The types themselves
live in openai_types.py. Nothing here touches sockets or engines.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import msgspec
from dpserve.daemons.api.lax_decode import lax_decode, pydantic_words
from dpserve.daemons.api.openai_types import (
    MAX_CHOICES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from dpserve.daemons.api.tools.choice import history_fields
from msgspec import Struct


# Top-level twins that refuse unknown fields: decoding tries them first, so a
# request without unknown fields (nearly all) is decoded once, and one with
# them names the first for the caller's log before the tolerant decode.
class _StrictCompletionRequest(CompletionRequest, forbid_unknown_fields=True):
    pass


class _StrictChatCompletionRequest(ChatCompletionRequest, forbid_unknown_fields=True):
    pass


_STRICT: dict[type, type] = {CompletionRequest: _StrictCompletionRequest, ChatCompletionRequest: _StrictChatCompletionRequest}
_ERR_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `([^`]*)`$")
_DECODERS: dict[type, msgspec.json.Decoder] = {}


def _decoder(kind: type) -> msgspec.json.Decoder:
    # A Decoder per type: msgspec.json.decode(type=...) looks the type up on every call.
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return decoder


def _invalid(text: str) -> ApiError:
    """The 400 of a validation failure, naming its field."""
    match = _ERR_PATH.search(text)
    # A dict's value is at `$.field[...]`: name the field itself.
    param = match.group(1).replace("[...]", "") if match else None
    return ApiError(400, f"Invalid request: {text}{pydantic_words(text)}", param=param or None)



def decode_request(body: bytes, kind: type[Struct], on_unknown: Callable[[str], None] | None = None) -> Any:
    """Decode a JSON body into `kind`, turning every failure into a 400 ApiError.

    `on_unknown` hears the name of an unknown top-level field (the first one
    only); the field itself is ignored.
    """
    strict = _STRICT.get(kind) if on_unknown is not None else None
    try:
        if strict is not None:
            try:
                return _decoder(strict).decode(body)
            except msgspec.ValidationError as exc:
                unknown = _UNKNOWN_FIELD.match(str(exc))
                if unknown is None:
                    raise
                on_unknown(unknown.group(1))
        return _decoder(kind).decode(body)
    except msgspec.ValidationError as exc:
        try:
            lax = lax_decode(body, kind, exc)
        except msgspec.ValidationError as again:
            lax, exc = None, again
        if lax is not None:
            return lax
        raise _invalid(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"Malformed JSON body: {exc}") from None
    except RecursionError:
        raise ApiError(400, "Malformed JSON body: nested too deeply.") from None


# Known parameters we do not implement: name -> the values that mean "not used"
# (null always does). Anything else is a 400 naming the parameter, never a
# silent no-op. The OpenAPI document derives these fields' schemas from here.
# Tools are checked before tool_choice, so "auto" there means "no tools".
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "bad_words": ([],),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
}


# What the 400 adds for a few of them, so a user knows it is a gap, not a typo.
_UNSUPPORTED_WHY = {
    "functions": ": it is OpenAI's deprecated form of tools (use tools and tool_choice)",
    "function_call": ": it is OpenAI's deprecated form of tool_choice (use tools and tool_choice)",
    "use_beam_search": ": beam search is not implemented (sample n choices instead)",
}


def check_unsupported(req: SamplingFields) -> None:
    """Reject parameters we would otherwise silently ignore, and stream_options without a
    stream (vLLM's 400 for any options but {}, null ones included)."""
    for name, accepted in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is not None and not any(type(value) is type(a) and value == a for a in accepted):
            why = _UNSUPPORTED_WHY.get(name, "")
            raise ApiError(400, f"{name} is not supported by this server{why} (got {_short(value)}).", param=name)
    opts = req.stream_options
    if opts is not None and not req.stream and not opts.is_empty:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")


def check_logprobs(name: str, value: int | None, vocab_size: int, max_logprobs: int) -> int | None:
    """A logprobs count with vLLM's -1 (the whole vocabulary) resolved, bounded by
    --max-logprobs (-1 there: the vocabulary); vLLM's message past it."""
    if value is None:
        return None
    num = vocab_size if value == -1 else value
    bound = vocab_size if max_logprobs == -1 else max_logprobs
    if num > bound:
        raise ApiError(400, f"Requested {name} of {num}, which is greater than max allowed: {bound} (--max-logprobs).", param=name)
    return num


def chat_logprob_counts(req: ChatCompletionRequest, vocab_size: int, max_logprobs: int) -> tuple[int | None, int | None]:
    """(top_logprobs, prompt_logprobs) of a chat request, -1 resolved and bounded;
    top_logprobs is None without logprobs: true."""
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
    num_top = check_logprobs("top_logprobs", req.top_logprobs or 0, vocab_size, max_logprobs) if req.logprobs else None
    return num_top, check_logprobs("prompt_logprobs", req.prompt_logprobs, vocab_size, max_logprobs)


def logprob_token_ids(req: SamplingFields, vocab_size: int, max_logprobs: int) -> tuple[int, ...]:
    """vLLM's logprob_token_ids, checked: they need logprobs (chat: true; completions: set, and
    generated tokens), lie in the vocabulary, and number at most --max-logprobs. () when unset."""
    ids = req.logprob_token_ids
    if not ids:
        return ()
    if isinstance(req, CompletionRequest):
        if req.echo and req.max_tokens == 0:
            raise ApiError(400, "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                           "output tokens are generated.", param="logprob_token_ids")
        if req.logprobs is None:
            raise ApiError(400, "when using `logprob_token_ids`, `logprobs` must be set.", param="logprob_token_ids")
    elif not req.logprobs:
        raise ApiError(400, "when using `logprob_token_ids`, `logprobs` must be set to true.", param="logprob_token_ids")
    bound = vocab_size if max_logprobs == -1 else max_logprobs
    if len(ids) > bound:
        raise ApiError(400, f"Requested logprob_token_ids of length {len(ids)}, which is greater than max allowed: "
                       f"{bound} (--max-logprobs).", param="logprob_token_ids")
    out_of_vocab("logprob_token_ids", ids, vocab_size)
    return tuple(ids)


def chat_template_args(req: ChatCompletionRequest) -> dict[str, Any]:
    """What a chat request hands its template beyond messages: chat_template_kwargs
    (never overriding the request's own fields) and continue_final_message."""
    args = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in ("messages", "add_generation_prompt")}
    if req.continue_final_message:
        args["continue_final_message"] = True
    return args


def chat_echo_text(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: the final message's text starts the answer when that message is
    the assistant's (continue_final_message); otherwise nothing is echoed."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return None
    content = req.messages[-1].content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content)
    return content or ""


def out_of_vocab(name: str, ids, vocab_size: int) -> None:
    """vLLM's 400 naming every id outside the vocabulary (at most 20 shown)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        shown = str(bad[:20])[:-1] + (", ...]" if len(bad) > 20 else "]")
        raise ApiError(400, f"token_id(s) {shown} in {name} contain out-of-vocab token ids. Vocabulary size: {vocab_size}", param=name)


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int, side: str | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` ids (-1: the context length), the first
    with truncation_side "right"."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                       "Please, select a smaller truncation size.", param="truncate_prompt_tokens")
    if side == "right":
        return ids[:keep]
    return ids[-keep:] if keep else []


def logit_bias_pairs(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs; a 400 naming every key that is not a token id."""
    if not bias:
        return ()
    out, bad = [], []
    for key, value in bias.items():
        if key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size:
            out.append((int(key), float(value)))
        else:
            bad.append(key[:20])
    if bad:
        raise ApiError(400, f"token_id(s) {bad[:20]} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                       param="logit_bias")
    return tuple(out)


# Set to anything (even its default), these send a request down the full path
# of the serving module; a request with none of them takes the plain path, which
# pays only for this one scan.
_EXTRA_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "include_stop_str_in_output",
    "min_p", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "logprobs",
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "allowed_token_ids", "return_token_ids", "return_tokens_as_token_ids", "logprob_token_ids",
)


_EXTRA_VALUES = operator.attrgetter(*_EXTRA_FIELDS)  # one C call reads them all


def uses_extras(req: SamplingFields) -> bool:
    """True when the request needs the n / logprobs / echo / processors path."""
    if _EXTRA_VALUES(req).count(None) != len(_EXTRA_FIELDS):
        return True
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        return True
    if isinstance(req, CompletionRequest):
        return req.echo is not None or req.max_tokens == 0 or (isinstance(req.prompt, list) and len(req.prompt) > 1
                                                              and not isinstance(req.prompt[0], int))
    return req.top_logprobs is not None or req.tools is not None or req.tool_choice is not None or bool(req.echo)


def _short(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def stop_strings(req: SamplingFields) -> list[str]:
    """The non-empty stop strings (count and length are bounded by the type)."""
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    return [s for s in stops if s]


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Every prompt of a completion request (a batch is a list of strings or of
    token-id lists), each text or token ids."""
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt or type(prompt[0]) is int:
        return [completion_prompt(req)]
    if len(prompt) * (req.n or 1) > MAX_CHOICES:
        raise ApiError(400, f"At most {MAX_CHOICES} choices per request (prompts x n); got {len(prompt)} x {req.n or 1}.", param="prompt")
    out: list[str | list[int]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            out.append(item)
        else:
            raise ApiError(400, f"prompt[{i}] must be a string or a non-empty list of token ids.", param="prompt")
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request: text or token ids."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
    if prompt and all(type(t) is int for t in prompt):
        return prompt
    if not prompt:
        raise ApiError(400, "prompt must not be empty.", param="prompt")
    if prompt is not req.prompt:  # [[...]]: the one item of a batch holds something other than token ids
        raise ApiError(400, "prompt[0] must be a string or a non-empty list of token ids; a list of lists of strings "
                       "(or deeper) is not a prompt. A prompt is a string, a list of token ids, or a batch of either.",
                       param="prompt")
    raise ApiError(400, "prompt must be a string, a list of token ids, or a batch (a list of strings or of token-id lists).",
                   param="prompt")


def chat_messages(req: ChatCompletionRequest | Any) -> list[dict]:
    """Messages as plain dicts for the chat template; text parts joined. A role other
    than OpenAI's reaches the template as it is (vLLM's custom roles)."""
    if not req.messages:
        raise ApiError(400, "messages must not be empty.", param="messages")
    out = []
    for i, msg in enumerate(req.messages):
        if not msg.role or len(msg.role) > 64:
            raise ApiError(400, "A message role must be a non-empty string of at most 64 characters.", param=f"messages[{i}].role")
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise ApiError(
                        400,
                        f"Content part type {part.type!r} is not supported; only 'text'.",
                        param=f"messages[{i}].content[{j}].type",
                    )
                if part.text is None:
                    raise ApiError(
                        400,
                        f"messages[{i}].content[{j}] is a text part without 'text': it needs a string field 'text'.",
                        param=f"messages[{i}].content[{j}].text",
                    )
                texts.append(part.text)
            content = "".join(texts)
        item = {"role": "system" if msg.role == "developer" else msg.role, "content": content or ""}
        if msg.name:
            item["name"] = msg.name
        if msg.tool_calls or msg.tool_call_id is not None or msg.reasoning_content is not None or msg.reasoning is not None:
            item.update(history_fields(msg, i))
        out.append(item)
    return out



# ------------------------------------------------------------ response-size budget
#
# What one position of a response costs in JSON bytes, with a token's text at
# _TEXT bytes (escaped; the demo model's and real vocabularies' tokens average
# under it) and a logprob float at its longest repr. An estimate made before any
# work from the request alone, so that a small body cannot ask for a response a
# thousand times its size (n x prompts x tokens x logprobs, echo, prompt_logprobs).
_TEXT = 8
_FLOAT = 22
_TEXT_BYTES = _TEXT + 2  # a token's text in a content or text field
_COMPLETION_TOP = _TEXT + 3 + _FLOAT + 2  # "tok": -1.23..., in a top_logprobs dict
_COMPLETION_POSITION = (_TEXT + 4) + (_FLOAT + 2) + 12  # tokens, token_logprobs, text_offset entries
_CHAT_TOP = 50 + _TEXT + _FLOAT + 4 * _TEXT  # {"token","logprob","bytes":[...]}
_PROMPT_TOP = 50 + _TEXT + _FLOAT  # "id": {"logprob", "rank", "decoded_token"}
_STREAM_CHUNK = 160  # an SSE chunk's envelope: id, object, created, model, choice index


def response_bytes(*, chat: bool, stream: bool, num_prompt: int, num_generated: int, num_top: int | None,
                   prompt_logprobs: int | None, echo: bool) -> dict[str, int]:
    """One choice's response bytes, by the parameter that asks for them: max_tokens
    (its text), logprobs (per generated or echoed position), echo (the prompt's
    text) and prompt_logprobs (per prompt position, rendered with this many tops)."""
    per_token = _TEXT_BYTES + (_STREAM_CHUNK if stream else 0)
    cost = {"max_tokens": num_generated * per_token, "echo": num_prompt * _TEXT_BYTES if echo else 0}
    if num_top is not None:
        position = _CHAT_TOP * (num_top + 1) if chat else _COMPLETION_POSITION + _COMPLETION_TOP * (num_top + 1)
        cost["logprobs"] = (num_generated + (num_prompt if echo else 0)) * position
    if prompt_logprobs is not None:
        cost["prompt_logprobs"] = num_prompt * _PROMPT_TOP * (prompt_logprobs + 1)
    return cost


def check_response_bytes(cost: dict[str, int], num_choices: int, limit: int, chat: bool) -> None:
    """A 400 naming the parameter that costs most when the whole response could exceed limit."""
    total = sum(cost.values())
    if total <= limit:
        return
    param = max(cost, key=cost.__getitem__)
    if param == "logprobs" and chat:
        param = "top_logprobs"
    shares = ", ".join(f"{name} {size / 2**20:,.1f} MiB" for name, size in sorted(cost.items(), key=lambda kv: -kv[1]) if size)
    raise ApiError(
        400,
        f"This request's response could reach {total / 2**20:,.0f} MiB over {num_choices} choice(s) ({shares}), "
        f"over this server's limit of {limit / 2**20:,.0f} MiB (--max-response-bytes): ask for less {param} "
        "(or fewer choices, prompts or tokens).",
        param=param,
    )
