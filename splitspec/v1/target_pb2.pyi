from splitspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetRequest(_message.Message):
    __slots__ = ("open", "decode", "verify", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: TargetOpen
    decode: TargetDecode
    verify: TargetVerify
    close: TargetClose
    def __init__(self, open: _Optional[_Union[TargetOpen, _Mapping]] = ..., decode: _Optional[_Union[TargetDecode, _Mapping]] = ..., verify: _Optional[_Union[TargetVerify, _Mapping]] = ..., close: _Optional[_Union[TargetClose, _Mapping]] = ...) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("opened", "token", "verified", "closed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    opened: TargetOpened
    token: TargetToken
    verified: TargetVerified
    closed: TargetClosed
    def __init__(self, opened: _Optional[_Union[TargetOpened, _Mapping]] = ..., token: _Optional[_Union[TargetToken, _Mapping]] = ..., verified: _Optional[_Union[TargetVerified, _Mapping]] = ..., closed: _Optional[_Union[TargetClosed, _Mapping]] = ...) -> None: ...

class TargetOpen(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "hidden_layer_ids", "max_new_tokens", "hidden_dtype", "hidden_stream", "generated_tokens", "hidden_last", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STREAM_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAST_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    hidden_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    hidden_dtype: _common_pb2.DType
    hidden_stream: str
    generated_tokens: int
    hidden_last: int
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., hidden_layer_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., hidden_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., hidden_stream: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., hidden_last: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TargetOpened(_message.Message):
    __slots__ = ("session_id", "first_token_id", "hidden", "length", "forward_ms", "queue_ms", "batch_size", "batch_tokens", "first_logprob", "prompt_logprobs", "cached_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_token_id: int
    hidden: _common_pb2.Tensor
    length: int
    forward_ms: float
    queue_ms: float
    batch_size: int
    batch_tokens: int
    first_logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    cached_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., length: _Optional[int] = ..., forward_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TargetDecode(_message.Message):
    __slots__ = ("n", "return_hidden", "lookahead")
    N_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    n: int
    return_hidden: bool
    lookahead: int
    def __init__(self, n: _Optional[int] = ..., return_hidden: _Optional[bool] = ..., lookahead: _Optional[int] = ...) -> None: ...

class TargetToken(_message.Message):
    __slots__ = ("token_id", "length", "hidden", "forward_ms", "queue_ms", "batch_size", "batch_tokens", "logprob", "batch_verify_rows", "more_token_ids", "more_logprobs", "drafted", "accepted")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BATCH_VERIFY_ROWS_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MORE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    length: int
    hidden: _common_pb2.Tensor
    forward_ms: float
    queue_ms: float
    batch_size: int
    batch_tokens: int
    logprob: _common_pb2.TokenLogprob
    batch_verify_rows: int
    more_token_ids: _containers.RepeatedScalarFieldContainer[int]
    more_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    drafted: int
    accepted: int
    def __init__(self, token_id: _Optional[int] = ..., length: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., forward_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., batch_verify_rows: _Optional[int] = ..., more_token_ids: _Optional[_Iterable[int]] = ..., more_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class TargetVerify(_message.Message):
    __slots__ = ("step", "base_len", "tree", "draft_probs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    step: int
    base_len: int
    tree: _common_pb2.TokenTree
    draft_probs: _common_pb2.Tensor
    def __init__(self, step: _Optional[int] = ..., base_len: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TargetVerified(_message.Message):
    __slots__ = ("step", "committed_token_ids", "hidden", "length", "num_accepted", "forward_ms", "queue_ms", "batch_size", "batch_tokens", "logprobs", "num_forced", "batch_verify_rows")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORCED_FIELD_NUMBER: _ClassVar[int]
    BATCH_VERIFY_ROWS_FIELD_NUMBER: _ClassVar[int]
    step: int
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.Tensor
    length: int
    num_accepted: int
    forward_ms: float
    queue_ms: float
    batch_size: int
    batch_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_forced: int
    batch_verify_rows: int
    def __init__(self, step: _Optional[int] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., length: _Optional[int] = ..., num_accepted: _Optional[int] = ..., forward_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_forced: _Optional[int] = ..., batch_verify_rows: _Optional[int] = ...) -> None: ...

class TargetClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetClosed(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "hidden_size", "num_layers", "dtype", "eos_token_ids", "max_context", "tokenizer_hash", "tokenizer_json", "tokenizer_config_json", "active_sessions", "max_sessions", "kv_cache_bytes", "kv_cache_budget_bytes", "sampling_backend", "replica_id", "running_sessions", "waiting_sessions", "max_queued_requests", "kv_block_size", "kv_blocks_used", "kv_blocks_free", "forward_passes", "batched_steps", "max_num_batched_tokens", "busy_ms", "tensor_parallel_size", "parallel_layout", "max_lookahead")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_BACKEND_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    tokenizer_hash: str
    tokenizer_json: bytes
    tokenizer_config_json: str
    active_sessions: int
    max_sessions: int
    kv_cache_bytes: int
    kv_cache_budget_bytes: int
    sampling_backend: str
    replica_id: str
    running_sessions: int
    waiting_sessions: int
    max_queued_requests: int
    kv_block_size: int
    kv_blocks_used: int
    kv_blocks_free: int
    forward_passes: int
    batched_steps: int
    max_num_batched_tokens: int
    busy_ms: float
    tensor_parallel_size: int
    parallel_layout: str
    max_lookahead: int
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., tokenizer_json: _Optional[bytes] = ..., tokenizer_config_json: _Optional[str] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_budget_bytes: _Optional[int] = ..., sampling_backend: _Optional[str] = ..., replica_id: _Optional[str] = ..., running_sessions: _Optional[int] = ..., waiting_sessions: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., forward_passes: _Optional[int] = ..., batched_steps: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., busy_ms: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ..., parallel_layout: _Optional[str] = ..., max_lookahead: _Optional[int] = ...) -> None: ...
