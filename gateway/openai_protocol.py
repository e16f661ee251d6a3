"""The OpenAI protocol as this gateway accepts it: the request bodies of /v1/completions and
/v1/chat/completions declared as pydantic models. FastAPI validates every body against them and
publishes them at /openapi.json (gateway/http_api.py); gateway/openai_mapping.py turns a valid
body into GenerateRequests.

Every integer is bounded to the protobuf field it fills (int32, uint64) and every float must be
finite and fit a proto float, so no value can overflow on its way to the proto (which raised, a
500) or reach the sampler as infinity. Ranges with a meaning (penalties, top_p, n, logprobs)
are the ones vLLM documents. Fields the server does not know are kept (extra="allow") so the
routes can log and ignore them, as vLLM does. Structured-output fields (response_format, tools,
structured_outputs, guided_*) stay free-form here: gateway/structured.py checks them and names
the exact spot it refuses.

`strict` is on: a string is not a number and "yes" is not a boolean."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from splitspec.limits import (MAX_CACHE_SALT, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                              MAX_STOP_TOKEN_IDS)

INT32_MAX = 2 ** 31 - 1
UINT64_MAX = 2 ** 64 - 1
FLOAT32_MAX = 3.4028234663852886e38   # larger finite doubles become infinity in a proto float
# The smallest normal float32: "> 0" fields start here (5e-324 is 0 in a proto float).
FLOAT32_TINY = 1.1754943508222875e-38
MAX_N = 128                # choices per prompt
MAX_CHOICES = 256          # prompts x n in one request



def _whole(value):
    """JSON Schema's integer includes 2.0: a whole float is taken as the integer it is (strict
    mode still refuses "2", true and 2.5)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def whole(low: int, high: int):
    """An integer in [low, high] (the constraints sit on the int, so the schema states them)."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_whole)]


TokenId = whole(0, INT32_MAX)
Count = whole(0, INT32_MAX)
ProtoFloat = Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
Penalty = Annotated[float, Field(allow_inf_nan=False, ge=-2, le=2)]
Bias = Annotated[float, Field(allow_inf_nan=False, ge=-100, le=100)]
Logprobs = whole(0, MAX_LOGPROBS)


class FieldError(ValueError):
    """A refusal that knows the exact field it is about (`param`, e.g. "prompt[1]"), where
    pydantic's location would name a union branch instead."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    # splitspec's extension: each chunk also carries a "splitspec" object with every token's text
    # and who proposed it, and the speculation's running totals (gateway/openai_stream.py)
    token_sources: bool | None = None


class Speculative(BaseModel):
    """The `speculative` extension object, like gRPC's SpeculativeParams; the gateway checks the
    values' meaning (method names, minimum widths) as it does for gRPC."""
    model_config = ConfigDict(strict=True, extra="forbid")
    method: str | None = None
    num_steps: whole(0, INT32_MAX) | None = None
    topk: whole(0, INT32_MAX) | None = None
    num_draft_tokens: whole(0, INT32_MAX) | None = None
    draft_sampling: str | None = None


class _Sampling(_Body):
    """What completions and chat share."""
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(allow_inf_nan=False, ge=0, le=FLOAT32_MAX)] | None = None
    top_p: Annotated[float, Field(allow_inf_nan=False, ge=FLOAT32_TINY, le=1)] | None = None
    top_k: whole(-1, INT32_MAX) | None = None        # vLLM: -1 = off
    seed: whole(0, UINT64_MAX) | None = None
    max_tokens: Count | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    speculative: Speculative | None = None
    n: whole(1, MAX_N) | None = None
    best_of: whole(1, MAX_N) | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(allow_inf_nan=False, ge=FLOAT32_TINY, le=FLOAT32_MAX)] | None = None
    logit_bias: dict[str, Bias] | None = Field(None, description="token id (a decimal string) -> bias in [-100, 100]")
    min_tokens: Count | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT)] | None = Field(
        None, description="prefix-cache namespace: a tenant id or a hash of one (absent or \"\": the shared cache)")
    # Structured outputs and tools: checked by gateway/structured.py, which names the spot it refuses.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    # The lists below are counted before pydantic looks at an entry: a million stop strings or
    # bias entries cost seconds to validate alone, on the event loop that serves every request.
    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value, handler):
        stops = [value] if isinstance(value, str) else value
        if isinstance(stops, list):
            _at_most(stops, MAX_STOP_STRINGS, "stop", "stop strings")
            for i, stop in enumerate(stops):
                if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
                    param = "stop" if isinstance(value, str) else f"stop[{i}]"
                    raise FieldError(f"{param} has {len(stop)} characters; at most {MAX_STOP_CHARS} are accepted",
                                     param)
        return handler(value)

    @field_validator("stop_token_ids", mode="wrap")
    @classmethod
    def _stop_token_ids(cls, value, handler):
        _at_most(value, MAX_STOP_TOKEN_IDS, "stop_token_ids", "token ids")
        return handler(value)

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _logit_bias(cls, value, handler):
        _at_most(value, MAX_LOGIT_BIAS, "logit_bias", "entries")
        return handler(value)


def _at_most(value, limit: int, param: str, what: str) -> None:
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise FieldError(f"{param} has {len(value)} {what}; at most {limit} are accepted", param)


Text = Annotated[str, Field(min_length=1)]
PromptItem = Union[Text, Annotated[list[TokenId], Field(min_length=1)]]


class CompletionRequest(_Sampling):
    prompt: Union[Text, Annotated[list[TokenId], Field(min_length=1)], Annotated[list[PromptItem], Field(min_length=1)]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: Logprobs | Literal[False] | None = Field(None, description="alternatives per token (0-20); false: none")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value, handler, info: ValidationInfo):
        check_batch_size(value)
        try:
            return handler(value)
        except ValueError:
            check_prompt(value)      # raises naming the element; else the union's own error stands
            raise


def check_batch_size(prompt) -> None:
    """A batch of more prompts than a request may have choices is refused before any of them is
    validated or tokenized. A long list of numbers is one prompt's token ids, not a batch."""
    if isinstance(prompt, list) and len(prompt) > MAX_CHOICES and not set(map(type, prompt)) <= {int, float}:
        raise FieldError(f"prompt holds {len(prompt)} prompts; at most {MAX_CHOICES} are accepted (one choice each, "
                         f"and a request has at most {MAX_CHOICES} choices)", "prompt")


def check_prompt(prompt) -> None:
    """A completions prompt: text, token ids, or a list of either (a batch)."""
    if (isinstance(prompt, str) and prompt) or _token_ids(prompt):
        return
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        for i, p in enumerate(prompt):
            if not ((isinstance(p, str) and p) or _token_ids(p)):
                raise FieldError(f"prompt[{i}] must be a non-empty string or a non-empty list of token ids in "
                                 f"[0, {INT32_MAX}]", f"prompt[{i}]")
        return
    raise FieldError(f"prompt must be a non-empty string, a non-empty list of token ids in [0, {INT32_MAX}], or a "
                     f"list of those", "prompt")


def _token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in x)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str = ""


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    echo: Any = None             # a completions field: refused on chat, naming it
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: Any = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every refusal and failure, as OpenAI answers them."""
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# Fields whose location inside (a dict's key, a free-form value) is not a field of its own:
# a refusal names the field itself.
OPAQUE_FIELDS = frozenset({"logit_bias", "chat_template_kwargs"})
