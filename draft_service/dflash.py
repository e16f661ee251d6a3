"""DFlash block-diffusion drafter (z-lab/dflash layout).

One forward drafts a whole block. The block is `[last committed token, MASK x (B-1)]`
embedded with the target's embedding; every draft layer is a Qwen3-style decoder layer
whose queries come only from the block, while keys/values come from the concatenation of
the projected target features of the committed context ("KV injection") and the block
itself, through the same k/v projections, k-norm and RoPE at absolute positions. Attention
inside the block is bidirectional. Logits come from the target's lm_head at the B-1 mask
positions.

Checkpoint: `config.json` (`architectures: ["DFlashDraftModel"]`, `block_size`,
`dflash_config: {mask_token_id, target_layer_ids}`, `num_target_layers`, Qwen3 fields) and
`model.safetensors` with `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`.
`embed_tokens` and `lm_head` are read from the target checkpoint.

A draft with a reduced vocabulary (`draft_vocab_size` in config.json, the map `d2t` in
model.safetensors; `vocab.py`) scores only the kept rows of the target's lm_head, and `logits`
puts those scores back in the target's vocabulary, -inf elsewhere: every id it proposes and every
q it sends is a target id / a distribution over the target's vocabulary, zero outside the kept set.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from splitspec.engine.kv_pool import BlockTable, KVPool
from splitspec.models.config import ConfigError, ModelConfig, TransformerShape
from splitspec.models.fused import fused, transposed
from splitspec.models.dense import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

from . import vocab

log = structlog.get_logger(__name__)

BLOCK_SIZE_MEANINGS = ("verify_width", "draft_count")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread taps: round(1 + i * (L - 4) / (n - 1)) (z-lab's build_target_layer_ids).
    A target too shallow for that spread (it would tap one layer twice, or run backwards: 4
    layers and 2 taps gave [1, 1]) gets n distinct layers spread over all of 0..L-1 instead."""
    n, L = num_draft_layers, num_target_layers
    if n == 1:
        return [L // 2]
    ids = [min(max(int(round(1 + i * (L - 4) / (n - 1))), 0), L - 1) for i in range(n)]
    if len(set(ids)) < n or ids != sorted(ids):
        ids = [int(round(i * (L - 1) / (n - 1))) for i in range(n)] if n <= L else ids
    return ids


@dataclass(frozen=True)
class DFlashConfig(TransformerShape):
    vocab_size: int
    block_size: int                    # verify width B: the last token plus B - 1 masks
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 4096
    layer_types: tuple[str, ...] = ()          # per layer; empty = every layer "full_attention"
    sliding_window: int | None = None
    is_causal: bool | None = None              # explicit; None = causal iff the layer is sliding
    input_embedding_scale: float = 1.0         # block embeddings (anchor and masks) are scaled by it
    aux_hidden_stream: str = ""                # Attention-Residuals targets: "prefix" / "attn_res" taps
    draft_vocab_size: int | None = None        # rows of the head: kept tokens (vocab.py); None = all

    ARCHITECTURE = "DFlashDraftModel"

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def layer_causal(self, i: int) -> bool:
        """Causal among the block's own rows. The public loaders take an explicit `is_causal`
        first and otherwise make a layer causal iff it is a sliding one (z-lab, vLLM)."""
        return self.is_causal if self.is_causal is not None else self.layer_type(i) == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else None

    @property
    def common_window(self) -> int | None:
        """The window when every layer slides (then no query sees a key W or more positions
        away, so a Propose reads only the last W - 1 context positions, whatever the prompt's
        length); None when any layer attends to the whole context."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 and None not in windows else None

    @property
    def target_feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def rope_config(self) -> ModelConfig:
        """A Qwen3 ModelConfig view, so the target's RoPE code serves the draft too."""
        return ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=self.vocab_size,
                           hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=dict(self.rope_scaling) or {"rope_type": "default"},
                           max_position_embeddings=self.max_position_embeddings, qk_norm=True)

    @classmethod
    def from_dict(cls, raw: dict, *, block_size_means: str = "verify_width") -> "DFlashConfig":
        return cls(**cls.fields_from_dict(raw, block_size_means))

    @classmethod
    def fields_from_dict(cls, raw: dict, block_size_means: str) -> dict:
        archs = raw.get("architectures") or []
        if cls.ARCHITECTURE not in archs:
            raise ConfigError(f"draft config.json: architectures={archs!r}; expected ['{cls.ARCHITECTURE}']")
        dcfg = raw.get("dflash_config") or {}
        for key in ("mask_token_id", "target_layer_ids"):
            if key not in dcfg:
                raise ConfigError(f"draft config.json: dflash_config.{key} is missing")
        if "block_size" not in raw and "block_size" not in dcfg:
            raise ConfigError("draft config.json: block_size is missing (top level or dflash_config)")
        if block_size_means not in BLOCK_SIZE_MEANINGS:
            raise ConfigError(f"block size meaning {block_size_means!r}; expected one of {BLOCK_SIZE_MEANINGS}")
        # Checkpoints disagree on whether block_size counts the drafted tokens (7) or the
        # verify width including the last committed token (8); the caller says which.
        stored = int(dcfg["block_size"] if "block_size" in dcfg else raw["block_size"])
        block = stored if block_size_means == "verify_width" else stored + 1
        if block < 2:
            raise ConfigError(f"draft config.json: block_size={stored} leaves no token to draft")
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        if dcfg.get("attention_mode", "gqa") != "gqa":
            raise ConfigError(f"draft config.json: dflash_config.attention_mode="
                              f"{dcfg['attention_mode']!r} is not supported; only 'gqa' drafts load here")
        layers = int(raw["num_hidden_layers"])
        types = tuple(raw.get("layer_types") or ())
        if types and (len(types) != layers or set(types) - {"full_attention", "sliding_attention"}):
            raise ConfigError(f"draft config.json: layer_types={list(types)!r}; expected {layers} entries, "
                              f"each 'full_attention' or 'sliding_attention'")
        window = raw.get("sliding_window")
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise ConfigError(f"draft config.json: sliding layers need a positive sliding_window, got {window!r}")
        causal = raw.get("is_causal", dcfg.get("causal"))
        stream = dcfg.get("aux_hidden_stream", raw.get("aux_hidden_stream", ""))
        if stream not in ("", "prefix", "attn_res"):
            raise ConfigError(f"draft config.json: aux_hidden_stream={stream!r}; expected 'prefix' or 'attn_res'")
        kept = raw.get(vocab.SIZE_FIELD)
        if kept is not None and not (isinstance(kept, int) and 0 < kept <= raw["vocab_size"]):
            raise ConfigError(f"draft config.json: {vocab.SIZE_FIELD}={kept!r}; expected an integer in "
                              f"1..vocab_size ({raw['vocab_size']})")
        return dict(hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
                    num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=raw.get("num_key_value_heads") or heads,
                    head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                    vocab_size=raw["vocab_size"], block_size=block,
                    mask_token_id=int(dcfg["mask_token_id"]),
                    target_layer_ids=tuple(int(i) for i in dcfg["target_layer_ids"]),
                    num_target_layers=int(raw.get("num_target_layers", max(dcfg["target_layer_ids"]) + 1)),
                    rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                    rope_scaling=rope, max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                    layer_types=types, sliding_window=int(window) if window else None,
                    is_causal=None if causal is None else bool(causal),
                    input_embedding_scale=float(raw.get("input_embedding_scale") or 1.0),
                    aux_hidden_stream=stream, draft_vocab_size=kept)

    def to_dict(self) -> dict:
        """z-lab export format; block_size is written as the verify width."""
        out = {
            "architectures": [self.ARCHITECTURE], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
        }
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        if self.sliding_window:
            out["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.input_embedding_scale != 1.0:
            out["input_embedding_scale"] = self.input_embedding_scale
        if self.aux_hidden_stream:
            out["dflash_config"]["aux_hidden_stream"] = self.aux_hidden_stream
        if self.draft_vocab_size is not None:
            out[vocab.SIZE_FIELD] = self.draft_vocab_size
        return out

    @property
    def head_size(self) -> int:
        """Rows of the head: the kept tokens, or the whole vocabulary."""
        return self.draft_vocab_size or self.vocab_size


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [B, n_kv, T, D] of x [B, T, H]: k_proj, k_norm, RoPE; v_proj."""
        B, T, _ = x.shape
        if not torch.is_grad_enabled():
            # Serving: k and v from one matmul over the fused matrix's k/v columns (fused.py).
            weight, _ = fused(self, ("q_proj", "k_proj", "v_proj"))
            return self._split_kv((x @ weight[:, self.n_heads * self.head_dim:]).view(B, T, -1, self.head_dim), cos, sin)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def _split_kv(self, kv: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """kv [B, T, 2 * n_kv, D] (k heads, then v heads) -> K/V [B, n_kv, T, D], k normed and rotated."""
        k = self.k_norm(kv[:, :, :self.n_kv]).transpose(1, 2)
        return apply_rope(k, cos, sin), kv[:, :, self.n_kv:].transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        """x: block hidden [B, T, H]; ctx_k/ctx_v: injected context K/V [B, n_kv, C, D]."""
        B, T, _ = x.shape
        if torch.is_grad_enabled():
            q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
            k, v = self.kv(x, cos, sin)
        else:
            # Serving: q, k and v from one matmul, q and k normed and rotated together.
            weight, _ = fused(self, ("q_proj", "k_proj", "v_proj"))
            qkv = (x @ weight).view(B, T, -1, self.head_dim)
            q = self.q_norm(qkv[:, :, :self.n_heads]).transpose(1, 2)
            k, v = self._split_kv(qkv[:, :, self.n_heads:], cos, sin)
        q = apply_rope(q, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        # Grouped-query attention in the kernel (enable_gqa): repeat_kv would copy every row's whole
        # context K/V n_heads / n_kv times per layer, the largest copy of a batched Propose.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        if not torch.is_grad_enabled():
            transposed(self.o_proj)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def mlp(module: MLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP: gate and up fused into one matmul when serving (no gradient), as the target does."""
    return module(x) if torch.is_grad_enabled() else module.forward_fused(x)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, attend):
        """attend(self_attn, normed x) runs the attention (cached context, training layouts)."""
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + mlp(self.mlp, self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """Draft layers + feature fusion. The target's embedding and lm_head are attached with
    `attach_target` and are not part of this module's state dict (they stay frozen). A reduced
    vocabulary's map is the buffer `d2t` (saved with the draft); its head is the kept rows of the
    target's lm_head."""

    layer_class = DraftLayer

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.target_feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._inv_freq: torch.Tensor | None = None
        self._target: dict[str, torch.Tensor] = {}
        if cfg.draft_vocab_size is not None:
            self.register_buffer(vocab.D2T, torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        for name, w in (("embed_tokens", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != (V, H):
                raise ConfigError(f"target {name} has shape {tuple(w.shape)}; the draft expects ({V}, {H})")
        self._target = {"embed": embed_weight.detach(), "lm_head": lm_head_weight.detach()}
        self._attach_head()

    def _attach_head(self) -> None:
        """The head's weight: the target's lm_head, or its kept rows (a copy, gathered once)."""
        w = self._target["lm_head"]
        ids = self.head_ids()
        head = w if ids is None else w.index_select(0, ids.to(w.device))
        self._target["head"] = head
        self._target.pop("head_t", None)
        if head.device.type == "cpu":
            # [H, V] contiguous: this CPU's BLAS scores 1-8 rows against it ~1.3x faster than
            # against the [V, H] layout (fused.py); on CUDA the layouts cost the same.
            self._target["head_t"] = head.t().contiguous()

    def head_ids(self) -> torch.Tensor | None:
        """Target id of each head row (draft id), or None when the head is the whole vocabulary."""
        d2t = getattr(self, vocab.D2T, None)
        return None if d2t is None else vocab.target_ids_of(d2t)

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Keep only `target_ids` (ascending) in the head; a draft that had the whole vocabulary
        gets the d2t buffer. The target, when attached, is re-read for the new rows."""
        ids = target_ids.long()
        vocab.check_d2t(vocab.d2t_of(ids), self.cfg.vocab_size, None, "the kept set")
        self.cfg = replace(self.cfg, draft_vocab_size=int(ids.shape[0]))
        p = next(self.parameters())
        if hasattr(self, vocab.D2T):
            delattr(self, vocab.D2T)
        self.register_buffer(vocab.D2T, vocab.d2t_of(ids).to(p.device))
        if self._target:
            self._attach_head()

    def rope(self, positions: torch.Tensor, dtype):
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.cfg.rope_config()).to(positions.device)
        return rope_cos_sin(self._inv_freq, positions, dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self._target["embed"])
        return x if self.cfg.input_embedding_scale == 1.0 else x * self.cfg.input_embedding_scale

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over draft hidden states h [..., H]: [..., head_size], column d scoring draft
        id d (target id d for a full-vocabulary draft). Training and the selector work here."""
        t = self._target.get("head_t")
        return F.linear(h, self._target["head"]) if t is None else h @ t

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] over the target's vocabulary: the head's scores at their target ids,
        -inf at every token outside the kept set, so an argmax, a top-k or a softmax over them
        (and the q it gives) are already in target ids."""
        return self.to_target(self.draft_logits(h))

    def to_target(self, z: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary scores [..., head_size] laid out over the target's vocabulary."""
        ids = self.head_ids()
        if ids is None:
            return z
        out = z.new_full((*z.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(-1, ids.to(z.device), z)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., len(ids) * H_t] -> context hidden [.., H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer injected K/V for context tokens fused [B, C, H] at positions [B, C] / [C]."""
        cos, sin = self.rope(positions, fused.dtype)
        return [layer.self_attn.kv(fused, cos, sin) for layer in self.layers]

    def block_forward(self, block_ids: torch.Tensor, positions: torch.Tensor,
                      ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask=None) -> torch.Tensor:
        """Final normed hidden [B, T, H] of the block tokens attending to context + block.
        mask: one bool mask for every layer, or a list of one per layer."""
        x = self.embed(block_ids)
        cos, sin = self.rope(positions, x.dtype)
        masks = mask if isinstance(mask, list) else [mask] * len(self.layers)
        for layer, (ck, cv), m in zip(self.layers, ctx_kv, masks):
            x = layer(x, lambda attn, u, ck=ck, cv=cv, m=m: attn(u, cos, sin, ck, cv, m))
        return self.norm(x)


class DraftCache:
    """Injected context K/V of one sequence, in blocks of a draft KV pool (its own, or one
    shared by every session of the draft service). Only committed tokens whose target features
    exist are appended; the block's own K/V is never stored.

    `offset` is the absolute position of the block table's first slot: positions before it are
    never stored (a windowed draft opened with only the prompt's tail, DraftOpen.prompt_hidden_start),
    and `drop_before` moves it on as whole blocks fall out of the window. `length` stays the
    absolute number of context positions; `slots` takes absolute positions."""

    def __init__(self, model: DFlashDraft, max_len: int, pool: KVPool | None = None, block_size: int = 16,
                 offset: int = 0):
        self.pool = pool or new_pool(model, -(-max_len // block_size) + 1, block_size)
        self.table = BlockTable(self.pool)
        self.max_len = max_len
        self.offset = offset

    @property
    def length(self) -> int:
        return self.offset + self.table.length

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Pool slot ids of absolute context positions [start, end) (all at or past `offset`)."""
        if start < self.offset:
            raise ValueError(f"context position {start} is before this cache's offset {self.offset}")
        return self.table.slots(start - self.offset, end - self.offset)

    def drop_before(self, position: int) -> None:
        """Give back the blocks that hold only positions before `position` (never read again)."""
        n = (position - self.offset) // self.pool.block_size
        n = min(n, len(self.table.blocks))
        if n <= 0:
            return
        self.pool.release(self.table.blocks[:n])
        del self.table.blocks[:n]
        self.offset += n * self.pool.block_size
        self.table.length -= n * self.pool.block_size

    def append(self, model: DFlashDraft, features: torch.Tensor) -> None:
        """features: [n, len(target_layer_ids) * H_t] for the next n context positions."""
        append_context(model, [(self, features)])

    def free(self) -> None:
        self.table.free()


def new_pool(model: DFlashDraft, num_blocks: int, block_size: int = 16) -> KVPool:
    cfg, p = model.cfg, next(model.parameters())
    return KVPool(num_layers=len(model.layers), num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                  num_blocks=num_blocks, block_size=block_size, dtype=p.dtype, device=p.device)


def append_context(model: DFlashDraft, items: list[tuple[DraftCache, torch.Tensor]]) -> None:
    """Append each cache's new features, all in one fused projection. Every cache must have
    room (`ensure_room`); on success each cache's length grows by its rows."""
    items = [(c, f) for c, f in items if f is not None and f.shape[0]]
    if not items:
        return
    for cache, feats in items:
        ensure_room(cache, feats.shape[0])
    p = next(model.parameters())
    feats = torch.cat([f for _, f in items]).to(p.device, p.dtype)
    positions = torch.cat([torch.arange(c.length, c.length + f.shape[0]) for c, f in items]).to(p.device)
    slots = torch.cat([c.slots(c.length, c.length + f.shape[0]) for c, f in items])
    fused = model.fuse(feats)[None]
    pool = items[0][0].pool
    for i, (k, v) in enumerate(model.context_kv(fused, positions)):
        pool.k[i].index_copy_(0, slots, k[0].transpose(0, 1).to(pool.k.dtype))
        pool.v[i].index_copy_(0, slots, v[0].transpose(0, 1).to(pool.v.dtype))
    for cache, f in items:
        cache.table.length += f.shape[0]


def ensure_room(cache: DraftCache, n: int) -> None:
    if cache.length + n > cache.max_len:
        raise ValueError(f"draft context would reach {cache.length + n} tokens; max is {cache.max_len}")
    cache.table.ensure(cache.length - cache.offset + n)


def layer_masks(cfg: DFlashConfig, lengths: torch.Tensor, positions: torch.Tensor, C: int,
                starts: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per-layer bool masks [R, 1, B, C + B] (True = may attend) for blocks whose queries sit at
    positions [R, B], over each row's cached context keys at starts .. lengths - 1 (starts: 0 by
    default) laid out from key 0, then the block: bidirectional or causal among the block, and,
    for sliding layers, a symmetric window (|q - k| < W) as the public loaders apply it to
    non-causal drafts."""
    R, B = positions.shape
    dev = positions.device
    starts = torch.zeros_like(lengths) if starts is None else starts
    ctx_pos = starts[:, None] + torch.arange(C, device=dev)[None]                    # [R, C]
    ctx_ok = (ctx_pos < lengths[:, None])[:, None, :].expand(R, B, C)
    dist = None                                                                      # q - k, if a layer slides
    out, made = [], {}
    for i in range(cfg.num_hidden_layers):
        kind = (cfg.layer_causal(i), cfg.layer_window(i))
        if kind not in made:
            causal, window = kind
            blk = torch.ones(B, B, dtype=torch.bool, device=dev)
            blk = (blk.tril() if causal else blk)[None].expand(R, B, B)
            m = torch.cat([ctx_ok, blk], dim=2)
            if window:
                if dist is None:
                    keys = torch.cat([ctx_pos, positions], dim=1)                    # [R, C + B]
                    dist = positions[:, :, None] - keys[:, None, :]
                m = m & (dist < window) & (-dist < window)
            made[kind] = m[:, None]
        out.append(made[kind])
    return out


def draft_blocks(model: DFlashDraft, caches: list[DraftCache], last_tokens: list[int],
                 positions: list[int]) -> torch.Tensor:
    """Logits [R, B - 1, V] for the mask slots of each row's block [last_token, MASK...] at its
    position, every row attending to its own cached context: one batched forward."""
    return model.logits(block_hidden(model, caches, last_tokens, positions)).float()


def block_hidden(model: DFlashDraft, caches: list[DraftCache], last_tokens: list[int],
                 positions: list[int]) -> torch.Tensor:
    """Final normed draft hidden states [R, B - 1, H] of the mask slots (see draft_blocks)."""
    cfg = model.cfg
    p = next(model.parameters())
    R, B = len(caches), cfg.block_size
    ids = torch.full((R, B), cfg.mask_token_id, dtype=torch.long, device=p.device)
    ids[:, 0] = torch.tensor(last_tokens, device=p.device)     # slot 0 is the real last token, never MASK
    pos = torch.tensor(positions, device=p.device)[:, None] + torch.arange(B, device=p.device)
    # With every layer sliding, keys before position - W + 1 are masked for every query of the
    # block: reading only the window keeps a Propose's cost flat in the prompt's length.
    W = cfg.common_window
    starts = [max(0, q - W + 1) if W else 0 for q in positions]
    # Nothing before a cache's offset was stored (a windowed draft is sent only the window).
    starts = [min(max(s, c.offset), c.length) for s, c in zip(starts, caches)]
    C = max(c.length - s for c, s in zip(caches, starts))
    index = torch.zeros(R, C, dtype=torch.long, device=p.device)    # padding reads the zero block
    for r, (c, s) in enumerate(zip(caches, starts)):
        index[r, :c.length - s] = c.slots(s, c.length)
    lengths = torch.tensor([c.length for c in caches], device=p.device)
    mask = layer_masks(cfg, lengths, pos, C, torch.tensor(starts, device=p.device))
    pool = caches[0].pool
    flat, shape = index.view(-1), (R, C, pool.k.shape[2], pool.k.shape[3])
    ctx = [tuple(t[i].index_select(0, flat).view(shape).transpose(1, 2) for t in (pool.k, pool.v))
           for i in range(len(model.layers))]
    # Contiguous, so the lm_head that follows runs as one [R * (B - 1), H] x [H, V] matmul: over
    # the strided slice torch falls back to a bmm against R expanded copies of the whole head
    # (8 MB each on the default pair), which made 8 sessions' Propose cost ~8 single ones.
    return model.block_forward(ids, pos, ctx, mask)[:, 1:].contiguous()


def draft_block(model: DFlashDraft, cache: DraftCache, last_token: int, position: int) -> torch.Tensor:
    """Logits [B - 1, V] for the mask slots of block [last_token, MASK...] at `position`."""
    return draft_blocks(model, [cache], [last_token], [position])[0]


def save_draft(model: DFlashDraft, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def new_draft(target_cfg: ModelConfig, *, num_layers: int = 1, block_size: int = 8, mask_token_id: int,
              target_layer_ids=None, intermediate_size: int | None = None, seed: int = 0,
              draft_vocab: torch.Tensor | None = None) -> DFlashDraft:
    """A randomly initialised draft sized for `target_cfg` (for training or tests); with
    `draft_vocab` (kept target ids, ascending), its head scores only those."""
    ids = tuple(target_layer_ids or default_target_layer_ids(target_cfg.num_hidden_layers, max(num_layers, 1)))
    cfg = DFlashConfig(hidden_size=target_cfg.hidden_size,
                       intermediate_size=intermediate_size or target_cfg.intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=target_cfg.num_attention_heads,
                       num_key_value_heads=target_cfg.num_key_value_heads, head_dim=target_cfg.head_dim,
                       vocab_size=target_cfg.vocab_size, block_size=block_size, mask_token_id=mask_token_id,
                       target_layer_ids=ids, num_target_layers=target_cfg.num_hidden_layers,
                       rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
                       max_position_embeddings=target_cfg.max_position_embeddings)
    torch.manual_seed(seed)
    model = DFlashDraft(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    if draft_vocab is not None:
        model.set_vocab(draft_vocab)
    return model
