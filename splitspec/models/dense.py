"""Llama / Qwen2 / Qwen3 decoder in plain torch.

Module and parameter names mirror Hugging Face's (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint's state dict loads without renaming. The DFlash drafter reuses
`RMSNorm`, `MLP`, `rope_inv_freq`, `rope_cos_sin` and `apply_rope` from here.

One inference path: `forward_batch` over the runner's paged pool (serving, and every tool
through `target_service.engine`). `forward` is the differentiable whole-sequence pass that
`splitspec train-target` trains with; it keeps no cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitspec.engine.attention import AttentionPlan, paged_attention
from splitspec.engine.kv_pool import KVPool

from splitspec.models.config import ModelConfig
from splitspec.models.fused import fused, transposed


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight for float32 x that needs no gradient, in the fewest
    operators this CPU runs: one vector norm and in-place work on the [..., 1] scale. On one
    row it takes a third of the time of the plain formula or `F.rms_norm` (which is not a
    fused kernel on CPU) and agrees with them to float32 rounding."""
    scale = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return x * scale if weight is None else x * scale * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not x.requires_grad:
            return rms_norm(x, self.weight, self.eps)
        # Normalise in float32 like the reference implementations; half precision
        # variance loses enough bits to change argmax decisions.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if cfg.rope_type == "llama3":
        s = cfg.rope_scaling
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin of shape [..., T, head_dim] for integer positions [..., T]."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D] or [T, D]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_table(inv_freq: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[length, 2, head_dim]: cos, and sin with the rotation's sign folded in, for positions
    0..length-1; a step gathers its rows instead of recomputing them."""
    cos, sin = rope_cos_sin(inv_freq, torch.arange(length, device=inv_freq.device), dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return torch.stack((cos, sin), dim=1).contiguous()


def rope_rows(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """apply_rope for flat tokens x [N, heads, D] with rope = rope_table rows [N, 2, 1, D]:
    x * cos + swap_halves(x) * signed_sin, where the sign makes swap_halves the rotation."""
    return torch.addcmul(x * rope[:, 0], x.roll(x.shape[-1] // 2, -1), rope[:, 1])


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@dataclass
class PagedBatch:
    """What the attention layers need to run a ragged batch over the paged pool."""
    pool: KVPool
    plan: AttentionPlan
    states: object = None   # a hybrid target's KDA rows (state_pool.StatePlan); None for attention-only models


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """forward with gate and up as one matmul (fused.py): the serving path."""
        if self.gate_proj is None:      # GGUF weights kept packed (gguf_packed.py)
            gu = self.gate_up_packed(x)
        else:
            weight, bias = fused(self, ("gate_proj", "up_proj"))
            gu = x @ weight if bias is None else torch.addmm(bias, x, weight)
        gate, up = gu.chunk(2, dim=-1)
        if isinstance(self.down_proj, nn.Linear):
            transposed(self.down_proj)
        # silu over a contiguous copy of the gate half: over the strided half (any M > 1) torch
        # takes another elementwise path whose exp rounds differently in the last bit, so a verify
        # row and a decode row of the same token would differ (batch invariance, docs/speculation.md).
        return self.down_proj(F.silu(gate.contiguous(), inplace=True).mul_(up))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin):
        """Whole causal sequences x [B, T, H] (training)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.n_heads // self.n_kv
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


    def forward_paged(self, x, rope, batch: PagedBatch):
        """x: [N, H], the flat tokens of a ragged batch; rope: their rope_table rows [N, 2, 1, D].
        q, k and v come out of one matmul, and q and k are normed and rotated together."""
        N, D, hq, hkv = x.shape[0], self.head_dim, self.n_heads, self.n_kv
        if self.q_proj is None:         # GGUF weights kept packed (gguf_packed.py)
            qkv = self.qkv_packed(x)
        else:
            weight, bias = fused(self, ("q_proj", "k_proj", "v_proj"))
            qkv = x @ weight if bias is None else torch.addmm(bias, x, weight)
        qk = qkv[:, :(hq + hkv) * D].view(N, hq + hkv, D)
        v = qkv[:, (hq + hkv) * D:].view(N, hkv, D)
        if self.q_norm is not None:
            qk = self._qk_norm(qk)
        qk = rope_rows(qk, rope)
        q, k = qk[:, :hq], qk[:, hq:]
        slots = batch.plan.slot_mapping
        kp, vp = batch.pool.k[self.layer_idx], batch.pool.v[self.layer_idx]
        kp.index_copy_(0, slots, k.to(kp.dtype))
        vp.index_copy_(0, slots, v.to(vp.dtype))
        out = paged_attention(q, kp, vp, batch.plan)
        if isinstance(self.o_proj, nn.Linear):
            transposed(self.o_proj)
        return self.o_proj(out.reshape(N, -1))

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """q_norm over the q heads and k_norm over the k heads of qk [N, hq + hkv, D], as one
        norm and two in-place scales when both are float32 (same arithmetic as the two modules)."""
        qn, kn, hq = self.q_norm, self.k_norm, self.n_heads
        if qk.dtype != torch.float32 or qn.weight.dtype != torch.float32 or qn.eps != kn.eps:
            return torch.cat((qn(qk[:, :hq]), kn(qk[:, hq:])), dim=1)
        qk = rms_norm(qk, None, qn.eps)
        qk[:, :hq] *= qn.weight
        qk[:, hq:] *= kn.weight
        return qk


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_paged(self, x, rope, batch: PagedBatch):
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), rope, batch)
        return x + self.mlp.forward_fused(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq: torch.Tensor | None = None  # built on first use: init may run on meta

    def inv_freq(self, device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = rope_inv_freq(self.cfg).to(device)
        return self._inv_freq

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None) -> torch.Tensor:
        """rope_table rows [N, 2, 1, D] for positions [N]; the table covers the model's context
        and grows if a position lies past it (max_position: the largest, when the caller knows)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        need = max(self.cfg.max_position_embeddings, max_position + 1)
        table = self.__dict__.get("_rope_table")
        if table is None or table.shape[0] < need or table.device != positions.device or table.dtype != dtype:
            table = rope_table(self.inv_freq(positions.device), need, dtype)
            self.__dict__["_rope_table"] = table
        return table.index_select(0, positions)[:, :, None]

    def tap(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The feature a draft reads for layer `layer`: transformers' `hidden_states[layer + 1]`,
        the public DFlash/EAGLE convention. That is the layer's output, except for the last
        layer, whose entry transformers stores after the final norm; a draft trained here must
        read the same numbers in vLLM, SGLang or the reference loop."""
        return self.model.norm(x) if layer == self.cfg.num_hidden_layers - 1 else x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of whole sequences input_ids [B, T] from position 0: the differentiable
        pass `train-target` trains with (plain modules, so gradients reach every weight; the
        serving path's fused weights are caches of them). Inference runs `forward_batch`."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq(x.device), torch.arange(input_ids.shape[1], device=x.device), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch, *,
                      hidden_layers=(), logits_index: torch.Tensor | None = None, max_position: int | None = None):
        """One forward over a ragged batch: input_ids / positions [N] are the new tokens of every
        row, laid out row after row as `batch.plan` describes; their K/V go into the pool.
        Returns logits [len(logits_index), V] and {layer: output [N, H]} for `hidden_layers`.
        The one inference path (fused projections, table rope)."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rope(positions, x.dtype, max_position)
        wanted = set(hidden_layers)
        hidden = {}
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_paged(x, rope, batch)
            if i in wanted:
                hidden[i] = self.tap(i, x)
        if logits_index is not None:
            x = x[logits_index]
        if isinstance(self.lm_head, nn.Linear):
            transposed(self.lm_head)    # tied: the embedding then reads rows of the same storage
        return self.lm_head(self.model.norm(x)), hidden
