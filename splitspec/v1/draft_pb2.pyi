from splitspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("open", "propose", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: DraftOpen
    propose: DraftPropose
    close: DraftClose
    def __init__(self, open: _Optional[_Union[DraftOpen, _Mapping]] = ..., propose: _Optional[_Union[DraftPropose, _Mapping]] = ..., close: _Optional[_Union[DraftClose, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("opened", "proposal", "closed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    opened: DraftOpened
    proposal: Proposal
    closed: DraftClosed
    def __init__(self, opened: _Optional[_Union[DraftOpened, _Mapping]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., closed: _Optional[_Union[DraftClosed, _Mapping]] = ...) -> None: ...

class DraftOpen(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "prompt_hidden", "speculative", "sampling", "target_tokenizer_hash", "prompt_hidden_start", "generated_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HIDDEN_START_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_hidden: _common_pb2.Tensor
    speculative: _common_pb2.SpeculativeParams
    sampling: _common_pb2.SamplingParams
    target_tokenizer_hash: str
    prompt_hidden_start: int
    generated_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeParams, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target_tokenizer_hash: _Optional[str] = ..., prompt_hidden_start: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class DraftOpened(_message.Message):
    __slots__ = ("session_id", "method", "num_draft_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    method: str
    num_draft_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., method: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class DraftPropose(_message.Message):
    __slots__ = ("base_len", "new_token_ids", "new_hidden")
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    base_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_hidden: _common_pb2.Tensor
    def __init__(self, base_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("base_len", "tree", "draft_probs", "draft_ms", "queue_ms", "batch_size")
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    base_len: int
    tree: _common_pb2.TokenTree
    draft_probs: _common_pb2.Tensor
    draft_ms: float
    queue_ms: float
    batch_size: int
    def __init__(self, base_len: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class DraftClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftClosed(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model_id", "method", "block_size", "mask_token_id", "target_layer_ids", "target_hidden_size", "target_vocab_size", "target_num_layers", "target_tokenizer_hash", "active_sessions", "max_sessions", "dtype", "kv_block_size", "kv_blocks_used", "kv_blocks_free", "forward_passes", "batched_steps", "busy_ms", "architecture", "target_hidden_stream", "max_topk", "max_draft_nodes", "hidden_dtype", "context_window")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_STREAM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOPK_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_NODES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    method: str
    block_size: int
    mask_token_id: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    target_hidden_size: int
    target_vocab_size: int
    target_num_layers: int
    target_tokenizer_hash: str
    active_sessions: int
    max_sessions: int
    dtype: str
    kv_block_size: int
    kv_blocks_used: int
    kv_blocks_free: int
    forward_passes: int
    batched_steps: int
    busy_ms: float
    architecture: str
    target_hidden_stream: str
    max_topk: int
    max_draft_nodes: int
    hidden_dtype: _common_pb2.DType
    context_window: int
    def __init__(self, model_id: _Optional[str] = ..., method: _Optional[str] = ..., block_size: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., target_hidden_size: _Optional[int] = ..., target_vocab_size: _Optional[int] = ..., target_num_layers: _Optional[int] = ..., target_tokenizer_hash: _Optional[str] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., forward_passes: _Optional[int] = ..., batched_steps: _Optional[int] = ..., busy_ms: _Optional[float] = ..., architecture: _Optional[str] = ..., target_hidden_stream: _Optional[str] = ..., max_topk: _Optional[int] = ..., max_draft_nodes: _Optional[int] = ..., hidden_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., context_window: _Optional[int] = ...) -> None: ...
