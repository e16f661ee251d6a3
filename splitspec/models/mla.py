"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, Kimi-Linear, K3) over the paged pool.

The pool caches, per token and MLA layer, the RMS-normed latent c (kv_lora_rank values, in
`pool.k`) and the shared rope key slice k_pe (qk_rope_head_dim values, in `pool.v`): one row
for all heads, never the expanded per-head K/V. Attention is computed in the latent space
("absorbed"): each head's q_nope is folded through the key half of kv_b_proj into a
kv_lora_rank-wide query, scores are q_abs·c + q_pe·k_pe, the output is a latent row per head
that the value half of kv_b_proj maps to v_head_dim. That is the same product as expanding
K/V, in a different order, and it never materialises K/V for the whole context on each step.

Kimi's MLA is NoPE (no rotary anywhere; the rope slice is just a shared key extension);
DeepSeek-V3 rotates q_pe and k_pe (interleaved pairs, optional YaRN). K3 adds a sigmoid
output gate g_proj before o_proj."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from splitspec.engine.attention import AttentionPlan

from splitspec.models.hybrid_config import HybridConfig
from splitspec.models.dense import RMSNorm


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_rope(cfg: HybridConfig, max_position_embeddings: int) -> tuple[torch.Tensor, float, float]:
    """(inv_freq over the rope slice, factor on cos/sin, softmax scale) for default or YaRN rope."""
    dim, rope = cfg.qk_rope_head_dim, cfg.rope
    base = float(rope.get("rope_theta", 10000.0))
    scale = cfg.qk_head_dim ** -0.5
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.get("rope_type", "default") != "yarn":
        return inv_freq, 1.0, scale
    orig = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / orig
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attn_factor = rope.get("attention_factor")
    if attn_factor is None:
        attn_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    if m_all:       # DeepSeek folds mscale_all_dim into the softmax scale as well
        scale *= yarn_mscale(factor, m_all) ** 2
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def corr(rot):   # the dimension whose wavelength makes `rot` turns over the original context
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = corr(fast), corr(slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp                    # 1: high frequency, extrapolated; 0: interpolated by `factor`
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    return inv_freq, attn_factor, scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [N, heads, D]; cos / sin [N, D/2] (one angle per pair). Interleaved checkpoints pair
    (x0, x1), (x2, x3)...; the result is laid out evens then odds, the same for q and k, so the
    dot products are those of the interleaved rotation."""
    cos, sin = cos[:, None], sin[:, None]
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def latent_attention(q: torch.Tensor, c_all: torch.Tensor, pe_all: torch.Tensor, plan: AttentionPlan,
                     scale: float) -> torch.Tensor:
    """q: [N, H, r + p] (absorbed nope part, then rope part); c_all [slots, 1, r], pe_all
    [slots, 1, p]: one layer of the pool, this batch's rows written. Returns latent outputs [N, H, r]."""
    N, H, _ = q.shape
    r = c_all.shape[-1]
    out = q.new_empty(N, H, r)
    padded = torch.cat([q, q.new_zeros(1, H, q.shape[-1])])
    for g in plan.groups:
        R, Q = g.q_index.shape
        # One shared key row per token (MQA): the H heads become extra query rows.
        qq = padded.index_select(0, g.q_index.view(-1)).view(R, Q, H, -1).transpose(1, 2).reshape(R, 1, H * Q, -1)
        flat = g.kv_index.view(-1)
        c = c_all.index_select(0, flat).view(R, 1, -1, r)
        kk = torch.cat([c, pe_all.index_select(0, flat).view(R, 1, -1, pe_all.shape[-1])], dim=-1)
        o = F.scaled_dot_product_attention(qq, kk, c, attn_mask=g.mask_for(H), scale=scale)
        o = o.view(R, H, Q, r).transpose(1, 2)
        out.index_copy_(0, g.flat, o[g.valid])
    return out


class MLAttention(nn.Module):
    def __init__(self, cfg: HybridConfig, hidden: int, mla_index: int, max_position_embeddings: int):
        super().__init__()
        self.cfg, self.mla_index = cfg, mla_index
        H, bias = cfg.num_heads, cfg.attention_bias
        self.heads = H
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)     # the reference's default eps
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        if cfg.mla_output_gate:
            self.g_proj = nn.Linear(hidden, H * cfg.v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, hidden, bias=bias)
        self.max_position_embeddings = max_position_embeddings
        self._rope = None

    def rope(self, device):
        if self._rope is None or self._rope[0].device != device:
            inv, factor, scale = mla_rope(self.cfg, self.max_position_embeddings)
            self._rope = (inv.to(device), factor, scale)
        return self._rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        cfg, H = self.cfg, self.heads
        N = x.shape[0]
        nope, pe_dim, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(N, H, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        c, k_pe = self.kv_a_proj_with_mqa(x).split([r, pe_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = k_pe[:, None]
        inv_freq, factor, scale = self.rope(x.device)
        if cfg.use_rope:
            ang = positions.float()[:, None] * inv_freq
            cos, sin = (ang.cos() * factor).to(x.dtype), (ang.sin() * factor).to(x.dtype)
            q_pe, k_pe = rotate(q_pe, cos, sin, cfg.rope_interleave), rotate(k_pe, cos, sin, cfg.rope_interleave)
        pool, slots = batch.pool, batch.plan.slot_mapping
        c_all, pe_all = pool.k[self.mla_index], pool.v[self.mla_index]
        c_all.index_copy_(0, slots, c[:, None].to(c_all.dtype))
        pe_all.index_copy_(0, slots, k_pe.to(pe_all.dtype))
        w = self.kv_b_proj.weight.view(H, nope + cfg.v_head_dim, r)
        q_abs = torch.einsum("nhd,hdr->nhr", q_nope, w[:, :nope])
        o = latent_attention(torch.cat([q_abs, q_pe], dim=-1), c_all, pe_all, batch.plan, scale)
        o = torch.einsum("nhr,hvr->nhv", o, w[:, nope:]).reshape(N, -1)
        if cfg.mla_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)
