"""GGUF weights kept packed on a CPU: 4-bit projections multiplied in place, no float model.

A decode of a small model is bound by the bytes it streams: SmolLM2-135M dequantized to bf16
is 270 MB a token, its Q4_1 file 98 MB. torch ships a weight-only int4 matmul for CPUs
(`torch._weight_int4pack_mm_for_cpu`, AVX512 and AVX2 paths, bf16 activations) whose weight is
`w = (q - 8) * scale + zero` per group of 32 inputs, and ggml's 4-bit blocks are that formula:

* Q4_0 (block of 32: f16 `d`, 16 bytes of nibbles): `w = (q - 8) * d`, so scale `d`, zero 0;
* Q4_1 (f16 `d`, f16 `m`, nibbles): `w = q * d + m = (q - 8) * d + (m + 8 d)`.

The nibbles go to the kernel unchanged; only the scales are rounded, from f16 to the kernel's
bf16 (docs/real-model.md states what that costs in NLL and top-1 agreement). The kernel walks
each output over its inputs in one fixed order with no split of K, so a row's bits do not depend
on how many rows share the call or on the thread count: the batch-invariant guarantee holds on
this path too (tests/test_gguf_packed.py proves it per host kind).

The tied embedding (Q8_0 in SmolLM2's file) stays as its Q8_0 bytes and is dequantized a row at
a time on lookup, which gives the same numbers as the dequantized table; the head it ties to is
requantized to int4 groups of 32 or to int8 per output channel (`--gguf-head`), the one place
where this path changes numbers beyond the scale rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

GROUP = 32              # ggml's block length along the input dimension
Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
Q8_0_BLOCK_BYTES = 34   # f16 d + 32 int8
HEAD_FORMATS = ("int8", "int4")
FLOAT_TYPES = ("F32", "F16", "BF16")    # a head stored as floats keeps them: requantizing would only lose bits


def kernel_available() -> bool:
    """The int4 kernel has vectorised paths for AVX2 and AVX512 only; elsewhere it falls back to
    a scalar loop slower than the dequantized model."""
    return (hasattr(torch, "_weight_int4pack_mm_for_cpu")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def is_packed(model: nn.Module) -> bool:
    """Whether any of the model's matmuls runs on the packed kernels."""
    return any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())


def rows_invariant(model: nn.Module) -> bool:
    """Whether every matmul of the model's forward runs on a packed kernel, whose rows come out
    the same at any row count (so a lone row needs no second copy to match a verify's rows,
    runner.py); set at load, False for any model with a dense projection or head."""
    return model.__dict__.get("_rows_invariant", False)


def packable(qtype: str, out_features: int, in_features: int) -> str | None:
    """Why a tensor cannot go to the int4 kernel as it is stored, or None when it can."""
    if qtype not in Q4_BLOCK_BYTES:
        return f"{qtype} has no exact int4 form"
    if out_features % 16 or in_features % GROUP:
        return f"shape [{out_features}, {in_features}] is not a multiple of [16, {GROUP}]"
    return None


def q4_groups(data: np.ndarray, qtype: str, out_features: int, in_features: int):
    """ggml Q4_0 / Q4_1 blocks of a [out, in] weight -> (nibbles int32 [out, in], scale and zero
    float32 [out, in / 32]) with w = (q - 8) * scale + zero."""
    size = Q4_BLOCK_BYTES[qtype]
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).view(out_features, in_features // GROUP, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    nibbles = blocks[..., size - 16:]
    # A block's first 16 values are the low nibbles, its last 16 the high ones.
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(out_features, in_features).to(torch.int32)
    if qtype == "Q4_0":
        return q, d, torch.zeros_like(d)
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    return q, d, m + 8 * d


def quantize_int4(w: torch.Tensor):
    """A float [out, in] weight -> (nibbles, scale, zero) in groups of 32, asymmetric (min / max of
    each group on the grid), rounded against the bf16 scale and zero the kernel will use."""
    out_features, in_features = w.shape
    g = w.float().reshape(out_features, in_features // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12).bfloat16().float()
    zero = (lo + 8 * scale).bfloat16().float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    return q.reshape(out_features, in_features).to(torch.int32), scale, zero


class Int4Linear(nn.Module):
    """y = x W^T (+ bias) with W packed for torch's CPU int4 kernel; activations go in as bf16
    (the kernel's fast paths) and come back in the caller's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1))
        # [in / 32, out, 2]: the kernel's layout of per-group scales and zeros.
        self.register_buffer("scales_zeros", torch.stack((scale.t(), zero.t()), dim=-1).bfloat16().contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def concat(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bias: torch.Tensor | None = None):
        """One matmul for several projections of the same input (q/k/v, gate/up)."""
        return cls(*(torch.cat(xs) for xs in zip(*parts)), bias)

    def dequantized(self) -> torch.Tensor:
        """The [out, in] weight the kernel multiplies by, read back through it (so rounded to
        bf16): for checks and for a head requantized from it, not for serving."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_zeros).float().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)


class Int8Linear(nn.Module):
    """y = x W^T with W int8 and one bf16 scale per output channel (torch's `_weight_int8pack_mm`)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(-1) / 127).clamp_min(1e-12).bfloat16()
        self.register_buffer("weight_int8", torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scales).to(x.dtype)


class Q8Embedding(nn.Module):
    """An embedding table kept as its GGUF Q8_0 blocks; a lookup dequantizes only the rows it
    reads (each block: f16 `d`, then 32 int8 values `q`, w = q * d)."""

    def __init__(self, data: np.ndarray, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        rows = np.ascontiguousarray(data, dtype=np.uint8).reshape(num_embeddings, -1)
        self.register_buffer("blocks", torch.from_numpy(rows.copy() if not rows.flags.writeable else rows))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [len(ids), dim], equal to the dequantized table's."""
        b = self.blocks.index_select(0, ids).view(len(ids), -1, Q8_0_BLOCK_BYTES)
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(len(ids), self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.rows(flat).to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def dequantized(self) -> torch.Tensor:
        return self.rows(torch.arange(self.num_embeddings))


def head_from(weight: torch.Tensor, fmt: str) -> nn.Module:
    """The LM head for a float [vocab, hidden] weight, requantized as `fmt` (HEAD_FORMATS)."""
    if fmt == "int4":
        return Int4Linear(*quantize_int4(weight))
    if fmt == "int8":
        return Int8Linear(weight.float())
    raise ValueError(f"head format {fmt!r} is not one of {', '.join(HEAD_FORMATS)}")


# The serving forward's projection groups (dense.py): a group whose members are all packable
# becomes one Int4Linear; a one-member group replaces its module, a larger one sets its members
# to None and lives beside them under the fused name.
LAYER_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_packed"),
                ("self_attn", ("o_proj",), "o_proj"),
                ("mlp", ("gate_proj", "up_proj"), "gate_up_packed"),
                ("mlp", ("down_proj",), "down_proj"))
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass
class PackPlan:
    """What a GGUF file's weights become: `groups` (layer, holder, members, attribute) go to the
    int4 kernel, `embed` keeps the Q8_0 table packed, `head` is how the head is held ("stored":
    its Q4 blocks as they are, its own or the tied embedding's; "requantized": from the float
    weight, as `head_format`; None: dense), `kept` names
    the tensors left dequantized and why (logged at start-up)."""
    groups: list[tuple[int, str, tuple[str, ...], str]] = field(default_factory=list)
    embed: bool = False
    head: str | None = None
    head_format: str = "int8"
    kept: dict[str, str] = field(default_factory=dict)

    def skipped(self) -> tuple[str, ...]:
        """Checkpoint names the dense loader must not read (they load here, packed)."""
        names = [f"model.layers.{i}.{holder}.{m}.{p}" for i, holder, members, _ in self.groups
                 for m in members for p in ("weight", "bias")]
        if self.embed:
            names.append(EMBED)
        if self.head:
            names.append(HEAD)
        return tuple(names)


def _qtype(weights, name: str) -> str | None:
    t = weights.tensors.get(name)
    return None if t is None else t.tensor_type.name


def make_plan(weights, cfg, head_format: str = "int8") -> PackPlan:
    """Which of the file's tensors go to the kernel; every other large tensor is named in `kept`."""
    if head_format not in HEAD_FORMATS:
        raise ValueError(f"head format {head_format!r} is not one of {', '.join(HEAD_FORMATS)}")
    plan = PackPlan(head_format=head_format)
    for i in range(cfg.num_hidden_layers):
        for holder, members, attr in LAYER_GROUPS:
            names = [f"model.layers.{i}.{holder}.{m}.weight" for m in members]
            why = {n: packable(_qtype(weights, n), *_shape(weights, n)) for n in names}
            if all(w is None for w in why.values()):
                plan.groups.append((i, holder, members, attr))
            else:
                plan.kept.update({n: w for n, w in why.items() if w is not None})
    head = HEAD if HEAD in weights.tensors else EMBED
    if packable(_qtype(weights, head), *_shape(weights, head)) is None:
        plan.head = "stored"
    elif _qtype(weights, head) in FLOAT_TYPES:
        plan.kept[head + " (head)"] = f"{_qtype(weights, head)} head: multiplied as stored, never requantized"
    elif cfg.vocab_size % 16 == 0 and cfg.hidden_size % GROUP == 0:
        plan.head = "requantized"
        plan.kept[head + " (head)"] = f"{_qtype(weights, head)} requantized to {head_format} for the head"
    else:
        plan.kept[head + " (head)"] = f"vocabulary {cfg.vocab_size} x hidden {cfg.hidden_size}: not a multiple of [16, {GROUP}]"
    # A dense head tied to the embedding reads the float table, so the table stays float too.
    plan.embed = _qtype(weights, EMBED) == "Q8_0" and (plan.head is not None or head == HEAD)
    if not plan.embed:
        plan.kept[EMBED] = f"{_qtype(weights, EMBED)} embedding: looked up in the dequantized table"
    return plan


def _shape(weights, name: str) -> tuple[int, int]:
    t = weights.tensors.get(name)
    if t is None or len(t.shape) != 2:
        return (0, 1)
    cols, rows = (int(d) for d in t.shape)     # GGUF lists dimensions innermost first
    return rows, cols


def strip(model: nn.Module, plan: PackPlan) -> None:
    """On the meta model, before it is allocated: drop the modules the plan packs, so no float
    copy of them is ever made."""
    layers = model.model.layers
    for i, holder, members, attr in plan.groups:
        owner = getattr(layers[i], holder)
        for m in members:
            setattr(owner, m, None)
    if plan.embed:
        model.model.embed_tokens = None
    if plan.head:
        model.lm_head = None


def _q4(weights, name: str, permute_heads: int | None):
    t = weights.tensors[name]
    rows, cols = _shape(weights, name)
    q, scale, zero = q4_groups(t.data, t.tensor_type.name, rows, cols)
    if permute_heads:
        # llama.cpp stores Q/K rows interleaved per head; the permutation moves whole rows, so
        # it moves a row's nibbles and its scales alike.
        order = torch.arange(rows).reshape(permute_heads, rows // permute_heads // 2, 2).transpose(1, 2).reshape(-1)
        q, scale, zero = q[order], scale[order], zero[order]
    return q, scale, zero


def attach(model: nn.Module, plan: PackPlan, weights, dtype: torch.dtype) -> None:
    """Fill the stripped model from the file: packed groups, the Q8_0 embedding and the head."""
    cfg = model.cfg
    permute = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} if weights.arch == "llama" else {}
    layers = model.model.layers
    for i, holder, members, attr in plan.groups:
        prefix = f"model.layers.{i}.{holder}."
        parts = [_q4(weights, prefix + m + ".weight", permute.get(m)) for m in members]
        biases = [prefix + m + ".bias" for m in members]
        bias = None
        if any(b in weights.tensors for b in biases):
            bias = torch.cat([weights.get_tensor(b) if b in weights.tensors else torch.zeros(p[0].shape[0])
                              for b, p in zip(biases, parts)]).to(dtype)
        setattr(getattr(layers[i], holder), attr, Int4Linear.concat(parts, bias))
    if plan.embed:
        t = weights.tensors[EMBED]
        model.model.embed_tokens = Q8Embedding(t.data, cfg.vocab_size, cfg.hidden_size, dtype)
    if plan.head == "stored":
        model.lm_head = Int4Linear(*_q4(weights, HEAD if HEAD in weights.tensors else EMBED, None))
    elif plan.head == "requantized":
        source = HEAD if HEAD in weights.tensors else EMBED
        w = model.model.embed_tokens.dequantized() if source == EMBED and plan.embed else weights.get_tensor(source)
        model.lm_head = head_from(w, plan.head_format)
    model.__dict__["_rows_invariant"] = not any(isinstance(m, nn.Linear) for m in model.modules())
