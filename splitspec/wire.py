"""Conversions between protobuf messages and the engine's plain types, with the
validation every service applies to what arrives on the wire."""
from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch

from splitspec.limits import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from splitspec.v1 import common_pb2

from splitspec.engine.sample import COUPLED_BY_DEFAULT, SamplingParams
from splitspec.engine.tree import Tree

_TO_PB = {torch.float32: common_pb2.DTYPE_F32, torch.float16: common_pb2.DTYPE_F16,
          torch.bfloat16: common_pb2.DTYPE_BF16}
_FROM_PB = {v: k for k, v in _TO_PB.items()}
_NAMES = {common_pb2.DTYPE_F32: "f32", common_pb2.DTYPE_F16: "f16", common_pb2.DTYPE_BF16: "bf16"}
_SIZES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


class WireError(ValueError):
    """A message field is malformed; maps to INVALID_ARGUMENT."""


def dtype_to_pb(dtype: torch.dtype) -> int:
    return _TO_PB[dtype]


def dtype_from_pb(value: int, field: str = "tensor dtype") -> torch.dtype:
    if value not in _FROM_PB:
        raise WireError(f"{field} = {value} is not one of DTYPE_F32, DTYPE_F16, DTYPE_BF16")
    return _FROM_PB[value]


def dtype_name(value: int) -> str:
    """f32 / f16 / bf16 for a DType value (its number if it is none of them)."""
    return _NAMES.get(value, str(value))


# Tensors decoded from the wire are views over the message's bytes (no copy): torch warns, once
# per process, that such a buffer is not writable. Nothing writes them (the draft casts and
# concatenates hidden states into its own cache; the target asks for a copy of draft_probs), so
# that one warning is spent here, silenced, instead of on the first request.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0\0\0", dtype=torch.float32)

_LITTLE = sys.byteorder == "little"


def tensor_to_pb(t: torch.Tensor, dtype: torch.dtype | None = None,
                 out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """Encode t (cast to `dtype` first, when given) as raw little-endian bytes. With `out` (a
    Tensor field of the message being built, e.g. `resp.hidden`), fill it in place: building a
    Tensor and CopyFrom-ing it into the parent would copy the bytes once more."""
    t = t.detach().to("cpu", dtype or t.dtype).contiguous()
    if t.dtype not in _TO_PB:
        raise WireError(f"tensor dtype {t.dtype} cannot go on the wire (f32, f16 or bf16)")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t   # numpy has no bfloat16
    arr = raw.numpy()
    if not _LITTLE:
        arr = arr.byteswap()
    msg = common_pb2.Tensor() if out is None else out
    msg.data = arr.tobytes()            # the one copy out of the tensor; the message copies it once more
    msg.dtype = _TO_PB[t.dtype]
    msg.shape[:] = t.shape
    return msg


def tensor_from_pb(msg: common_pb2.Tensor, *, field: str = "tensor",
                   shape: tuple[int | None, ...] | None = None,
                   allowed=(torch.float32, torch.float16, torch.bfloat16), expected: str = "",
                   writable: bool = False) -> torch.Tensor:
    """Decode a Tensor, checking dtype, byte count and (optionally) shape; None in `shape`
    matches any size. A dtype outside `allowed` is refused naming both; `expected` says why
    those (e.g. "this draft takes f32 hidden states"). The result is a view over the message's
    bytes, not a copy; pass writable=True for a tensor the caller may change in place."""
    dtype = _FROM_PB.get(msg.dtype)
    if dtype is None or dtype not in allowed:
        names = ", ".join(_NAMES[_TO_PB[d]] for d in allowed)
        why = f" ({expected})" if expected else ""
        raise WireError(f"{field}.dtype is {_NAMES.get(msg.dtype, msg.dtype)}, expected "
                        f"{'one of ' if len(allowed) > 1 else ''}{names}{why}")
    dims = tuple(msg.shape)
    if any(d < 0 for d in dims):
        raise WireError(f"{field}.shape {list(dims)} has a negative dimension")
    if shape is not None:
        if len(dims) != len(shape) or any(e is not None and e != d for e, d in zip(shape, dims)):
            want = [("*" if e is None else e) for e in shape]
            raise WireError(f"{field}.shape is {list(dims)}, expected {want}")
    elem = _SIZES[dtype]
    count = math.prod(dims)
    data = msg.data
    if len(data) != count * elem:
        raise WireError(f"{field}.data has {len(data)} bytes; shape {list(dims)} of "
                        f"{_NAMES[msg.dtype]} needs {count * elem}")
    if count == 0:
        return torch.empty(dims, dtype=dtype)
    np_dtype = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2"}[dtype]
    if _LITTLE:
        if not writable:
            return torch.frombuffer(data, dtype=dtype).view(dims)
        # A numpy copy: a torch copy this large (a verify's draft probabilities) would enter an
        # OpenMP region on the server's thread and leave a second OpenMP team there, which slows
        # every later forward of the engine thread.
        t = torch.from_numpy(np.frombuffer(data, dtype=np_dtype).reshape(dims).copy())
        return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
    t = torch.from_numpy(np.frombuffer(data, dtype=np_dtype).reshape(dims).astype(np_dtype.replace("<", "=")))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset temperature means greedy, unset top_p means 1.0 (DESIGN §2)."""
    temperature = msg.temperature if msg.HasField("temperature") else 0.0
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    top_k = msg.top_k if msg.HasField("top_k") else 0
    seed = msg.seed if msg.HasField("seed") else None
    if math.isnan(temperature) or temperature < 0:
        raise WireError(f"sampling.temperature must be >= 0, got {temperature}")
    if math.isnan(top_p) or not 0.0 < top_p <= 1.0:
        raise WireError(f"sampling.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise WireError(f"sampling.top_k must be >= 0 (0 disables it), got {top_k}")
    # Counted before they are copied: the sampler applies every entry at every step.
    for name, limit in (("logit_bias", MAX_LOGIT_BIAS), ("stop_token_ids", MAX_STOP_TOKEN_IDS)):
        if len(getattr(msg, name)) > limit:
            raise WireError(f"sampling.{name} has {len(getattr(msg, name))} entries; at most {limit} are accepted")
    if msg.sampler not in common_pb2.Sampler.values():
        raise WireError(f"sampling.sampler = {msg.sampler} is not a Sampler value "
                        f"({', '.join(common_pb2.Sampler.keys())})")
    coupled = COUPLED_BY_DEFAULT if msg.sampler == common_pb2.SAMPLER_UNSPECIFIED else msg.sampler == common_pb2.SAMPLER_COUPLED
    params = SamplingParams(
        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=seed, coupled=coupled,
        presence_penalty=float(msg.presence_penalty), frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
        min_tokens=int(msg.min_tokens), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)
    try:
        return params.validate()
    except ValueError as exc:
        raise WireError(f"sampling.{exc}") from None


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
    if p.seed is not None:
        msg.seed = p.seed
    msg.sampler = common_pb2.SAMPLER_COUPLED if p.coupled else common_pb2.SAMPLER_STREAM
    return msg


def tree_from_pb(msg: common_pb2.TokenTree, vocab_size: int, max_nodes: int | None = None) -> Tree:
    tree = Tree(tuple(msg.token_ids), tuple(msg.parents))
    try:
        return tree.validate(vocab_size, max_nodes)
    except ValueError as exc:
        raise WireError(str(exc)) from exc


def tree_to_pb(tree: Tree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(token_ids=list(tree.token_ids), parents=list(tree.parents))


def check_token_ids(ids, vocab_size: int, field: str) -> list[int]:
    ids = list(ids)
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise WireError(f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def logprob_to_pb(lp) -> common_pb2.TokenLogprob:
    """An engine `penalties.TokenLogprob` on the wire."""
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                   top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
