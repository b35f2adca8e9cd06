"""OpenAI request and response shapes as msgspec Structs, and their validation.

A request body is decoded and validated once, straight into a typed Struct;
range checks that msgspec can express live in the type annotations, so the
400 message names the field. Every number that reaches an engine is bounded
here (an engine must never see a value its sampler cannot hold). Fields that
OpenAI's spec marks nullable accept null as "default". Parameters we know but
do not implement get a 400 when set to anything but their default; unknown
fields are ignored (as vLLM does) and reported to a callback. Responses follow
OpenAI's published schema (`logprobs: null` and `refusal: null` present, no
`null` where an object or array is expected). Nothing here touches sockets or
engines.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

# Limits on what a request may ask for. 2^31-1 bounds every count and token id:
# engines use them as tensor indices and sizes, where a larger int overflows.
INT32_MAX = 2**31 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024  # as the engine (engine/core.py); each is checked per token

Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=INT32_MAX)]
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
MinTokens = Annotated[int, Meta(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NumChoices = Annotated[int, Meta(ge=1, le=128)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs bound
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
MAX_LOGIT_BIAS = 1024  # entries, as the engine (engine/core.py)
LogitBias = Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS)]
MAX_CHOICES = 256  # prompts x n in one completions request
CompletionMaxTokens = Annotated[int, Meta(ge=0, le=INT32_MAX)]  # 0: only with echo (prompt scoring)
StopString = Annotated[str, Meta(max_length=MAX_STOP_LENGTH)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]


class ApiError(Exception):
    """An error that becomes an OpenAI-style error body with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


class StreamOptions(Struct, omit_defaults=True):
    include_usage: bool | None = False

    def __post_init__(self) -> None:
        if self.include_usage is None:
            self.include_usage = False


class _SamplingFields(Struct, kw_only=True):
    """Fields both endpoints share. After decoding, a nullable field that
    has a default (stream, ignore_eos, min_tokens) holds that default, never None."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = False
    min_tokens: MinTokens | None = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Sampling and output parameters beyond the plain path (a request that sets any of these).
    n: NumChoices | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    include_stop_str_in_output: bool | None = None
    min_p: MinP | None = None
    prompt_logprobs: NumLogprobs | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # Known but not implemented: accepted only at their default (see UNSUPPORTED).
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = False
        if self.ignore_eos is None:
            self.ignore_eos = False
        if self.min_tokens is None:
            self.min_tokens = 0


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: CompletionMaxTokens | None = None
    echo: bool | None = None
    logprobs: NumLogprobs | None = None
    suffix: str | None = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    add_generation_prompt: bool | None = True
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.add_generation_prompt is None:
            self.add_generation_prompt = True


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
        text = str(exc)
        match = _ERR_PATH.search(text)
        # A dict's value is at `$.field[...]`: name the field itself.
        param = match.group(1).replace("[...]", "") if match else None
        raise ApiError(400, f"Invalid request: {text}", param=param or None) from None
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
    "allowed_token_ids": (),
    "bad_words": ([],),
    "guided_grammar": (),
    "structured_outputs": (),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
}


# What the 400 adds for a few of them, so a user knows it is a gap, not a typo.
_UNSUPPORTED_WHY = {
    "tools": " yet: tool calling is not implemented",
    "tool_choice": " yet: tool calling is not implemented",
    "functions": " yet: tool calling is not implemented",
    "function_call": " yet: tool calling is not implemented",
    **dict.fromkeys(
        ("guided_grammar", "structured_outputs"),
        " yet (structured output takes response_format, guided_json, guided_regex or guided_choice)",
    ),
}


def check_unsupported(req: _SamplingFields) -> None:
    """Reject parameters we would otherwise silently ignore."""
    for name, accepted in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is not None and not any(type(value) is type(a) and value == a for a in accepted):
            why = _UNSUPPORTED_WHY.get(name, "")
            raise ApiError(400, f"{name} is not supported by this server{why} (got {_short(value)}).", param=name)


# Set to anything (even its default), these send a request down the full path
# of the serving module; a request with none of them takes the plain path, which
# pays only for this one scan.
_EXTRA_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "include_stop_str_in_output",
    "min_p", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "logprobs",
    "response_format", "guided_json", "guided_regex", "guided_choice",
)


def uses_extras(req: _SamplingFields) -> bool:
    """True when the request needs the n / logprobs / echo / processors path."""
    for name in _EXTRA_FIELDS:
        if getattr(req, name) is not None:
            return True
    if isinstance(req, CompletionRequest):
        return req.echo is not None or req.max_tokens == 0 or (isinstance(req.prompt, list) and len(req.prompt) > 1
                                                              and not isinstance(req.prompt[0], int))
    return req.top_logprobs is not None


def _short(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def stop_strings(req: _SamplingFields) -> list[str]:
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
    if all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "Batched prompts are not supported; send one prompt per request.", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids.", param="prompt")


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as plain dicts for the chat template; text parts joined."""
    if not req.messages:
        raise ApiError(400, "messages must not be empty.", param="messages")
    out = []
    for i, msg in enumerate(req.messages):
        if msg.role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"Unknown role {msg.role!r}.", param=f"messages[{i}].role")
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
        out.append(item)
    return out


# ------------------------------------------------------------------ responses


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served from the engine's prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Always present, as OpenAI sends it (0 when nothing was cached).
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None  # set only with logprobs (daemons/choices.py)
    finish_reason: str | None


class CompletionResponse(Struct, omit_defaults=True, tag_field="object", tag="text_completion"):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(Struct):
    content: str
    refusal: None = None
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None  # set only with logprobs (daemons/choices.py)
    finish_reason: str


class ChatCompletionResponse(Struct, omit_defaults=True, tag_field="object", tag="chat.completion"):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: dict[str, Any] | None  # set only with logprobs (daemons/choices.py)
    finish_reason: str | None


class ChatCompletionChunk(Struct, omit_defaults=True, tag_field="object", tag="chat.completion.chunk"):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Struct, tag_field="object", tag="model"):
    id: str
    created: int
    owned_by: str = "dpserve"
    max_model_len: int = 0
    root: str = ""


class ModelList(Struct, tag_field="object", tag="list"):
    data: list[ModelCard]


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorBody


_ENCODER = msgspec.json.Encoder()
encode = _ENCODER.encode


def error_body(err: ApiError) -> bytes:
    return encode(ErrorResponse(ErrorBody(err.message, err.type, err.param, err.code)))
