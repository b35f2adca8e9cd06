"""OpenAI request and response shapes as msgspec Structs, and their validation.

A request body is decoded and validated once, straight into a typed Struct;
range checks that msgspec can express live in the type annotations, so the
400 message names the field. Responses follow OpenAI's published schema
(ignoring nothing the strict clients need: `logprobs: null` present,
`refusal: null` present, no `null` where an object or array is expected).
Nothing here touches sockets or engines.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

NonNegFloat = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
TopK = Annotated[int, Meta(ge=-1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


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
    include_usage: bool = False


class _SamplingFields(Struct, kw_only=True):
    model: str | None = None
    max_tokens: PosInt | None = None
    temperature: NonNegFloat | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    n: PosInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    echo: bool = False
    logprobs: int | None = None
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
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    add_generation_prompt: bool = True


_ERR_PATH = re.compile(r"at `\$\.?([^`]*)`")


_DECODERS: dict[type, msgspec.json.Decoder] = {}


def decode_request(body: bytes, kind: type[Struct]) -> Any:
    """Decode a JSON body into `kind`, turning every failure into a 400 ApiError."""
    # A Decoder per type: msgspec.json.decode(type=...) looks the type up on every call.
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _ERR_PATH.search(text)
        param = match.group(1) if match else None
        raise ApiError(400, f"Invalid request: {text}", param=param or None) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"Malformed JSON body: {exc}") from None


def check_unsupported(req: _SamplingFields) -> None:
    """Reject parameters we would otherwise silently ignore."""
    if req.n != 1:
        raise ApiError(400, "Only n=1 is supported.", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported by this server.", param=name)
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported.", param="echo")
        if req.logprobs is not None:
            raise ApiError(400, "logprobs is not supported.", param="logprobs")
        if req.suffix:
            raise ApiError(400, "suffix is not supported.", param="suffix")
    elif req.logprobs:
        raise ApiError(400, "logprobs is not supported.", param="logprobs")


def stop_strings(req: _SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    if len(stops) > 16:
        raise ApiError(400, "At most 16 stop sequences are allowed.", param="stop")
    return [s for s in stops if s]


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
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ApiError(
                        400,
                        f"Content part type {part.type!r} is not supported; only text.",
                        param=f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        item = {"role": "system" if msg.role == "developer" else msg.role, "content": content or ""}
        if msg.name:
            item["name"] = msg.name
        out.append(item)
    return out


# ------------------------------------------------------------------ responses


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: None
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
    logprobs: None
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
    logprobs: None
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
