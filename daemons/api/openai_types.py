"""OpenAI request and response shapes as msgspec Structs, and the API's error.

A request body is decoded and validated once, straight into a typed Struct
(request_checks.py); range checks that msgspec can express live in the type
annotations here, so the 400 message names the field. Every number that reaches
an engine is bounded here (an engine must never see a value its sampler cannot
hold). Fields that OpenAI's spec marks nullable accept null as "default".
Responses follow OpenAI's published schema (`logprobs: null` and `refusal: null`
present, no `null` where an object or array is expected). Nothing here touches
sockets or engines.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

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
Priority = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # vLLM's int64 bounds
NumChoices = Annotated[int, Meta(ge=1, le=128)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs bound
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
# vLLM's -1: the whole vocabulary; bounded by --max-logprobs (request_checks.logprobs_bound)
AllLogprobs = Annotated[int, Meta(ge=-1, le=INT32_MAX)]
MAX_LOGIT_BIAS = 1024  # entries, as the engine (engine/core.py)
LogitBias = Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS)]
MAX_ALLOWED_TOKEN_IDS = 1 << 20
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
    # UNSET when not sent: vLLM refuses options without a stream unless they are {} (is_empty).
    include_usage: bool | None | msgspec.UnsetType = msgspec.UNSET
    continuous_usage_stats: bool | None | msgspec.UnsetType = msgspec.UNSET  # vLLM's: usage on every chunk (with include_usage)

    def __post_init__(self) -> None:
        if self.include_usage is None:
            self.include_usage = False
        if self.continuous_usage_stats is None:
            self.continuous_usage_stats = False

    @property
    def is_empty(self) -> bool:
        return self.include_usage is msgspec.UNSET and self.continuous_usage_stats is msgspec.UNSET


class StructuredOutputs(Struct, forbid_unknown_fields=False):
    """vLLM's structured_outputs: one of json, regex, choice, grammar (the guided_* aliases)."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(Struct, kw_only=True):
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
    prompt_logprobs: AllLogprobs | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    priority: Priority = 0  # vLLM's: lower first under --scheduling-policy priority; nonzero under fcfs: 400 (serving.sampling)
    # Known but not implemented: accepted only at their default (see UNSUPPORTED).
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    bad_words: list[str] | None = None
    # vLLM's extras, implemented
    allowed_token_ids: Annotated[list[int], Meta(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: right keeps the first ids
    # vLLM's: these ids' logprobs at each generated position in place of the top ones (request_checks)
    logprob_token_ids: Annotated[list[int], Meta(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = False
        if self.ignore_eos is None:
            self.ignore_eos = False
        if self.min_tokens is None:
            self.min_tokens = 0


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: CompletionMaxTokens | None = None
    echo: bool | None = None
    logprobs: AllLogprobs | None = None
    suffix: str | None = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # history of tool calling and reasoning, for the template (daemons/api/tools/choice.history_fields)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    add_generation_prompt: bool | None = True
    logprobs: bool | None = None
    top_logprobs: AllLogprobs | None = None
    echo: bool | None = None  # vLLM's: a final assistant message's text starts the answer
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = None  # vLLM's: false leaves reasoning_content out
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.add_generation_prompt is None:
            self.add_generation_prompt = True


class BatchChatCompletionRequest(ChatCompletionRequest, kw_only=True):
    """vLLM's /v1/chat/completions/batch: one conversation per choice (no stream, no tools, n 1)."""

    messages: Annotated[list[Annotated[list[ChatMessage], Meta(min_length=1)]], Meta(min_length=1, max_length=MAX_CHOICES)]


# ------------------------------------------------------------------ responses


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served from the engine's prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Always present, as OpenAI sends it (0 when nothing was cached).
    prompt_tokens_details: PromptTokensDetails | None = None


Choice = TypeVar("Choice")


class _Envelope(Struct, Generic[Choice], omit_defaults=True, tag_field="object"):
    """What every completion, chat completion and chunk says around its choices."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None  # set only with logprobs (many_choices.py)
    finish_reason: str | None
    # vLLM's, always sent (null unless asked for): the openai client reads them
    token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Envelope[CompletionChoice], tag="text_completion"):
    pass


class AssistantMessage(Struct):
    content: str
    refusal: None = None
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None  # set only with logprobs (many_choices.py)
    finish_reason: str
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(_Envelope[ChatChoice], tag="chat.completion", kw_only=True):
    # vLLM's, always sent (null unless asked for); required, so omit_defaults keeps them
    prompt_logprobs: list | None
    prompt_token_ids: list[int] | None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: dict[str, Any] | None  # set only with logprobs (many_choices.py)
    finish_reason: str | None


class ChatCompletionChunk(_Envelope[ChatChunkChoice], tag="chat.completion.chunk"):
    pass


class ModelCard(Struct, tag_field="object", tag="model"):
    id: str
    created: int
    owned_by: str = "dpserve"
    max_model_len: int = 0
    root: str = ""  # vLLM's: the model's path
    parent: str | None = None
    permission: list[dict[str, Any]] = []


# ------------------------------------------------------------------ vLLM's utility endpoints


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (exactly one)."""

    model: str | None = None
    # absent, not null: exactly one of them is sent (a null one is a 400, as the document says)
    prompt: str | msgspec.UnsetType = msgspec.UNSET
    messages: list[ChatMessage] | msgspec.UnsetType = msgspec.UNSET
    add_special_tokens: bool | None = None  # vLLM: true for a prompt, false for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # vLLM's: rendered by the chat template, as a chat completion's


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0, le=2**63 - 1)]]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


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
