from splitspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_SOURCE_UNSPECIFIED: _ClassVar[TokenSource]
    TOKEN_SOURCE_TARGET: _ClassVar[TokenSource]
    TOKEN_SOURCE_DFLASH: _ClassVar[TokenSource]
    TOKEN_SOURCE_NGRAM: _ClassVar[TokenSource]
TOKEN_SOURCE_UNSPECIFIED: TokenSource
TOKEN_SOURCE_TARGET: TokenSource
TOKEN_SOURCE_DFLASH: TokenSource
TOKEN_SOURCE_NGRAM: TokenSource

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "speculative", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    speculative: _common_pb2.SpeculativeParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "prompt_logprobs", "sources", "text_lengths", "progress")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TEXT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    sources: _containers.RepeatedScalarFieldContainer[TokenSource]
    text_lengths: _containers.RepeatedScalarFieldContainer[int]
    progress: SpeculativeProgress
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[TokenSource, str]]] = ..., text_lengths: _Optional[_Iterable[int]] = ..., progress: _Optional[_Union[SpeculativeProgress, _Mapping]] = ...) -> None: ...

class SpeculativeProgress(_message.Message):
    __slots__ = ("verify_steps", "committed", "draft_ms", "verify_ms", "wire_ms")
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    WIRE_MS_FIELD_NUMBER: _ClassVar[int]
    verify_steps: int
    committed: int
    draft_ms: float
    verify_ms: float
    wire_ms: float
    def __init__(self, verify_steps: _Optional[int] = ..., committed: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., wire_ms: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SpeculativeStats(_message.Message):
    __slots__ = ("method", "verify_steps", "accept_length", "accepted_per_position", "draft_tokens", "draft_ms", "verify_ms", "wire_ms", "hidden_state_bytes", "draft_fallbacks", "target_failovers", "time_to_first_token_ms", "queue_ms", "steps_by_method", "steps", "decode_runs", "decode_extensions")
    class StepsByMethodEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    METHOD_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    WIRE_MS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_METHOD_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_RUNS_FIELD_NUMBER: _ClassVar[int]
    DECODE_EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    method: str
    verify_steps: int
    accept_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: int
    draft_ms: float
    verify_ms: float
    wire_ms: float
    hidden_state_bytes: int
    draft_fallbacks: int
    target_failovers: int
    time_to_first_token_ms: float
    queue_ms: float
    steps_by_method: _containers.ScalarMap[str, int]
    steps: _containers.RepeatedCompositeFieldContainer[SpeculativeStep]
    decode_runs: int
    decode_extensions: int
    def __init__(self, method: _Optional[str] = ..., verify_steps: _Optional[int] = ..., accept_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., wire_ms: _Optional[float] = ..., hidden_state_bytes: _Optional[int] = ..., draft_fallbacks: _Optional[int] = ..., target_failovers: _Optional[int] = ..., time_to_first_token_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., steps_by_method: _Optional[_Mapping[str, int]] = ..., steps: _Optional[_Iterable[_Union[SpeculativeStep, _Mapping]]] = ..., decode_runs: _Optional[int] = ..., decode_extensions: _Optional[int] = ...) -> None: ...

class SpeculativeStep(_message.Message):
    __slots__ = ("method", "k", "accepted", "depth")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    method: str
    k: int
    accepted: int
    depth: int
    def __init__(self, method: _Optional[str] = ..., k: _Optional[int] = ..., accepted: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("finish_reason", "usage", "stats", "seed")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    stats: SpeculativeStats
    seed: int
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculativeStats, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    complete: Complete
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_context", "eos_token_ids", "draft_model_id", "speculative_method", "num_draft_tokens", "max_new_tokens_cap", "chat_template")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_CAP_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_model_id: str
    speculative_method: str
    num_draft_tokens: int
    max_new_tokens_cap: int
    chat_template: bool
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., draft_model_id: _Optional[str] = ..., speculative_method: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., max_new_tokens_cap: _Optional[int] = ..., chat_template: _Optional[bool] = ...) -> None: ...
