"""The request bodies: every field bounded on arrival to what the scheduler can hold (int32, float32, sizes), so no
value can overflow a worker array; bounds that depend on the served model (vocabulary, context) or the service's
limits are service.check_request's, once the body has parsed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

INT32_MAX = 2**31 - 1
MAX_PROMPTS = 4096  # prompts (or texts) in one request; ServeConfig.max_rows_per_request bounds prompts x n
MAX_PROMPT_IDS = 2**20  # token ids in one prompt (the context check refuses far fewer)
MAX_TEXT_CHARS = 2**20  # characters in one text prompt (api.py refuses texts that cannot fit the context first)
MAX_STOP_IDS = 32  # stop tokens per request: their width is a compiled shape, so it stays small
MAX_RID_CHARS = 256
MAX_NAME_CHARS = 256  # model names, user ids, weight versions
MAX_PATH_CHARS = 4096


def _utf8(text: str) -> str:
    """Refuses strings that cannot be encoded (a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid UTF-8 (contains a lone surrogate)") from None
    return text


Rid = Annotated[str, Field(max_length=MAX_RID_CHARS), AfterValidator(_utf8)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(_utf8)]
PromptText = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(_utf8)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
PromptIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]
StopIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_IDS)]
Seed = Annotated[StrictInt, Field(ge=0, lt=2**32)]
Probability = Annotated[float, Field(ge=1e-6, le=1, allow_inf_nan=False)]  # float32 keeps it above 0
Temperature = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]
NewTokens = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
TopK = Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)]  # values beyond the vocabulary mean "all of it"
Count = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
# A version is a short label: digits (what the trainer sends, and what must not go backwards) or a tag.
Version = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._+:-]+$")]
MAX_STOP_STRINGS = 16  # OpenAI allows 4; lm-evaluation-harness sends a task's `until` list, which can be longer
StopText = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_utf8)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)]


class _Request(BaseModel):
    """Requests reject unknown fields, so a misspelt option is an error instead of a silent default."""

    model_config = ConfigDict(extra="forbid")


def _only(neutral: object) -> AfterValidator:
    """Accepts an SGLang sampling parameter this service does not implement at its neutral value only."""
    def check(value: object) -> object:
        if value is not None and value != neutral:
            raise ValueError(f"not supported by this service; only {neutral!r} (off) or null")
        return value

    return AfterValidator(check)


class SamplingParamsIn(_Request):
    """SGLang's `sampling_params`: every field of SGLang's own SamplingParams is accepted by name (the ones this
    service does not implement at their neutral value only); any other name is refused, naming it."""

    max_new_tokens: NewTokens = 128
    temperature: Temperature = 1.0
    top_p: Probability = 1.0
    top_k: TopK = -1  # -1 or 0 = off
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), _only(0.0)] = 0.0  # not implemented: 0 = off
    n: Count = 1
    stop: Stop | None = None  # strings that end a completion, matched on its decoded text
    stop_token_ids: StopIds | None = None
    sampling_seed: Seed | None = None  # SGLang's name; None = a fresh random seed per request
    seed: Seed | None = None  # this service's former name, kept as an alias of sampling_seed
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True  # for the decoded `text` only
    spaces_between_special_tokens: StrictBool = True  # decoding detail of SGLang's; the text here is the tokenizer's
    no_stop_trim: Annotated[StrictBool, _only(False)] = False
    stop_regex: Annotated[StopText | list[StopText] | None, _only(None)] = None
    frequency_penalty: Annotated[float | None, _only(0.0)] = None
    presence_penalty: Annotated[float | None, _only(0.0)] = None
    repetition_penalty: Annotated[float | None, _only(1.0)] = None
    min_new_tokens: Annotated[StrictInt | None, _only(0)] = None
    json_schema: Annotated[Name | None, _only(None)] = None
    regex: Annotated[Name | None, _only(None)] = None
    ebnf: Annotated[Name | None, _only(None)] = None
    structural_tag: Annotated[Name | None, _only(None)] = None
    custom_params: Annotated[dict | None, _only(None)] = None
    stream_interval: Annotated[StrictInt | None, _only(None)] = None
    logit_bias: Annotated[dict[str, float] | None, _only(None)] = None

    @model_validator(mode="after")
    def _one_seed(self) -> SamplingParamsIn:
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            raise ValueError("sampling_seed: differs from seed (its alias); give one of them")
        return self

    @property
    def row_seed(self) -> int | None:
        """The seed asked for, by either name."""
        return self.sampling_seed if self.sampling_seed is not None else self.seed


class GenerateRequest(_Request):
    """SGLang's native `/generate` body."""

    text: PromptText | Annotated[list[PromptText], Field(max_length=MAX_PROMPTS)] | None = None
    input_ids: PromptIds | Annotated[list[PromptIds], Field(max_length=MAX_PROMPTS)] | None = None
    sampling_params: SamplingParamsIn | Annotated[list[SamplingParamsIn], Field(max_length=MAX_PROMPTS)] | None = None
    return_logprob: StrictBool = False
    # SGLang's: a mixture of experts' routed experts of every token read, base64 int32 in meta_info.routed_experts
    return_routed_experts: StrictBool = False
    stream: Literal[False] = False  # streaming is not implemented
    rid: Rid | Annotated[list[Rid], Field(max_length=MAX_PROMPTS)] | None = None


class UpdateWeightsRequest(_Request):
    """SGLang's `/update_weights_from_disk` body."""

    model_path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS), AfterValidator(_utf8)]
    weight_version: Version | Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None  # None = previous + 1
    load_format: Literal["auto"] | None = None
    flush_cache: StrictBool = True  # accepted for SGLang clients; this service keeps no prefix cache
    # This service's extension: a trainer resuming from a checkpoint re-pushes an older integer version.
    allow_rollback: StrictBool = False


class TensorEntryIn(_Request):
    """One tensor of a shared-memory segment (drgrpo_jax.named_tensors): where it lies and what it holds."""

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_utf8)]
    dtype: Literal["float32", "bfloat16", "float16"]
    shape: Annotated[list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]], Field(max_length=8)]
    offset: Annotated[StrictInt, Field(ge=0, lt=2**63)]


class UpdateWeightsFromTensorRequest(_Request):
    """`/update_weights_from_tensor` (this service's own body, not SGLang's: a segment name and its index)."""

    segment: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_utf8)]
    tensors: Annotated[list[TensorEntryIn], Field(min_length=1, max_length=2**16)]
    weight_version: Version | Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None  # None = previous + 1
    allow_rollback: StrictBool = False  # a trainer resuming from a checkpoint re-pushes an older version


class StreamOptions(_Request):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with the usage and no choices."""

    include_usage: StrictBool = False


class _OpenAIRequest(_Request):
    """What both OpenAI routes take besides their own fields: OpenAI's `user`, penalties and streaming, vLLM's
    extensions."""

    user: Name | None = None
    stream: StrictBool = False  # server-sent events (openai_routes._chunks)
    stream_options: StreamOptions | None = None
    # OpenAI's penalties, which its clients send at 0: accepted at that neutral value, refused otherwise.
    presence_penalty: Annotated[float | None, _only(0.0)] = None
    frequency_penalty: Annotated[float | None, _only(0.0)] = None
    top_k: TopK = -1
    stop_token_ids: StopIds | None = None
    ignore_eos: StrictBool = False


class CompletionRequest(_OpenAIRequest):
    """OpenAI's `/v1/completions` body (plus vLLM's top_k / stop_token_ids / ignore_eos)."""

    prompt: (PromptText | Annotated[list[PromptText], Field(max_length=MAX_PROMPTS)] | PromptIds
             | Annotated[list[PromptIds], Field(max_length=MAX_PROMPTS)])
    model: Name | None = None
    max_tokens: NewTokens | None = 16
    temperature: Temperature | None = 1.0
    top_p: Probability | None = 1.0
    n: Count = 1
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    seed: Seed | None = None
    echo: StrictBool = False  # the prompt (and, with logprobs, its tokens' log-probs) before the completion
    stop: Stop | None = None  # strings that end a completion, matched on the decoded text, left out of it


class TextPart(_Request):
    """One part of a message's content list (only text parts are served)."""

    type: Literal["text"]
    text: PromptText


class ChatMessage(_Request):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: PromptText | Annotated[list[TextPart], Field(max_length=MAX_PROMPTS)] | None = None
    name: Name | None = None


class ChatCompletionRequest(_OpenAIRequest):
    """OpenAI's `/v1/chat/completions` body (plus vLLM's top_k / stop_token_ids / ignore_eos)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_PROMPTS)]
    model: Name | None = None
    max_tokens: NewTokens | None = None
    max_completion_tokens: NewTokens | None = None  # the newer name of max_tokens; wins when both are given
    temperature: Temperature | None = 1.0
    top_p: Probability | None = 1.0
    n: Count = 1
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    seed: Seed | None = None
    stop: Stop | None = None
