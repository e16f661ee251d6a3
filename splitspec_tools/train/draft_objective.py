"""The DFlash training objective (DESIGN §3 "Training the drafter").

For one sequence of tokens `x_0 … x_{S-1}` with the frozen target's features at every position,
pick `num_anchors` anchor positions a. Each anchor makes one block `[x_a, MASK × (B-1)]` at
positions a … a+B-1, exactly the block the drafter sees at inference when `x_a` is the last
committed token: its queries see the fused context features of positions 0 … a-1 (strictly
before the anchor) and the block itself bidirectionally, never another anchor's block. Slot k
(k ≥ 1) predicts `x_{a+k}` through the target's frozen lm_head; its cross-entropy is weighted
`exp(-(k-1)/γ)`, because a later slot only counts when every earlier one was accepted.

The label of slot k is either the data token `x_{a+k}` (hard) or, with a `teacher`, the frozen
target's own next-token distribution at position a+k-1 (soft: cross-entropy against p_target,
i.e. KL(p_target ‖ q_draft) up to a constant), or a mix of both (`distill` = weight of the soft
part). Soft labels carry the whole distribution the draft is judged against — `min(1, p/q)` at
temperature 1 and argmax agreement at temperature 0 — where one sampled token carries one bit of
it, and they are right even on raw-text positions whose data token the target would not have
produced.

All blocks of a batch run as one query set through the draft's own modules
(`DFlashDraft.fuse`, `context_kv`, `block_forward`, i.e. the same `DraftAttention`/`DraftLayer`
code inference runs), either with one dense block-sparse bool mask over
`[S context keys + nA·B block keys]` (`attention="dense"`), or with the context part and the
in-block part scored separately and soft-maxed jointly (`attention="factored"`), which skips
the `nA·B × nA·B` block-to-block product of which only the B×B diagonal tiles are live.
Both equal the cached inference forward (`DraftCache` + `draft_block`) position by position.

A draft with a reduced vocabulary (`draft_service/vocab.py`) is trained over its head's tokens
only, as SpecForge trains EAGLE-3 drafts: the soft label is the target's distribution restricted
to the kept set and renormalised, a slot whose data token (hard label) or whose target argmax
(soft label) is outside the kept set adds no loss, and it counts as a miss in the accuracies,
since the draft can never propose it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draft_service import vocab
from draft_service.dflash import DFlashDraft
from draft_service.dflash2 import DFlash2Draft
from splitspec.models.dense import apply_rope, repeat_kv

from .dflash2_objective import SelectorOut, selector_term


@dataclass
class Anchors:
    pos: torch.Tensor     # [N, nA] long: anchor positions (sorted; unused ones repeat a valid position)
    valid: torch.Tensor   # [N, nA] bool: False for padding anchors (no loss)


def sample_anchors(num_seqs: int, seq_len: int, num_anchors: int, generator: torch.Generator, *,
                   min_anchor: int = 1, lengths: torch.Tensor | None = None) -> Anchors:
    """Up to `num_anchors` distinct random anchors per sequence in [min_anchor, len-2] (an anchor
    needs at least one token after it to predict and one before it as context). Sequences with
    fewer candidates get masked padding anchors, so the count stays fixed."""
    pos = torch.zeros(num_seqs, num_anchors, dtype=torch.long)
    valid = torch.zeros(num_seqs, num_anchors, dtype=torch.bool)
    for i in range(num_seqs):
        n = int(lengths[i]) if lengths is not None else seq_len
        lo, hi = max(min_anchor, 1), n - 2
        cand = hi - lo + 1
        if cand <= 0:
            pos[i] = min(max(lo, 0), max(seq_len - 1, 0))
            continue
        k = min(num_anchors, cand)
        chosen = (torch.randperm(cand, generator=generator)[:k] + lo).sort().values
        pos[i, :k] = chosen
        pos[i, k:] = chosen[0]
        valid[i, :k] = True
    return Anchors(pos, valid)


def block_inputs(model: DFlashDraft, tokens: torch.Tensor, anchors: Anchors):
    """Block ids, positions, labels and label weights/validity for every anchor.

    tokens: [N, S]. Returns ids [N, nA*B] (`[x_a, MASK…]` per anchor), positions [N, nA*B],
    labels [N, nA, B-1] (x_{a+k}, k = 1..B-1) and valid [N, nA, B-1] (label inside the sequence
    and anchor used)."""
    cfg = model.cfg
    B = cfg.block_size
    N, S = tokens.shape
    nA = anchors.pos.shape[1]
    ids = torch.full((N, nA, B), cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors.pos)
    offs = torch.arange(B, device=tokens.device)
    positions = anchors.pos[:, :, None] + offs                      # [N, nA, B]
    label_pos = positions[:, :, 1:]
    valid = (label_pos < S) & anchors.valid[:, :, None]
    labels = tokens.gather(1, label_pos.clamp(max=S - 1).flatten(1)).view(N, nA, B - 1)
    return ids.flatten(1), positions.flatten(1), labels, valid


def block_mask(anchors: Anchors, seq_len: int, block_size: int, window: int | None = None) -> torch.Tensor:
    """Bool [N, 1, nA*B, S + nA*B] (True = may attend): block query of anchor a sees context
    keys j < a and the keys of its own block, nothing else; with a sliding `window`, only keys
    fewer than `window` positions away (|q - k| < W, as inference masks sliding layers)."""
    pos = anchors.pos
    N, nA = pos.shape
    ctx = _context_allowed(anchors, seq_len, block_size, window)
    blk = torch.arange(nA, device=pos.device).repeat_interleave(block_size)
    own = (blk[:, None] == blk[None, :]).expand(N, -1, -1)
    if window:
        off = torch.arange(block_size, device=pos.device).repeat(nA)
        own = own & ((off[:, None] - off[None, :]).abs() < window)
    return torch.cat([ctx, own], dim=-1)[:, None]


def _context_allowed(anchors: Anchors, seq_len: int, block_size: int, window: int | None) -> torch.Tensor:
    """Bool [N, nA*B, S]: context key j is visible to the query at a + k iff j < a and, with a
    window, a + k - j < W."""
    q_anchor = anchors.pos.repeat_interleave(block_size, dim=1)                # [N, T]
    j = torch.arange(seq_len, device=anchors.pos.device)[None, None, :]
    ok = j < q_anchor[..., None]
    if window:
        q = q_anchor + torch.arange(block_size, device=q_anchor.device).repeat(anchors.pos.shape[1])
        ok = ok & (q[..., None] - j < window)
    return ok


def _banded_attention(attn, x, cos, sin, ctx_k, ctx_v, anchor_pos, window: int, block_size: int):
    """`_factored_attention` for a layer whose every query slides with window W: each anchor's
    block reads only the W - 1 context keys before its anchor, gathered per anchor, instead of
    scoring all S context keys and masking most of them (S / W times less work on long
    sequences). x: [N, nA*B, H]; anchor_pos: [N, nA]."""
    N, T, _ = x.shape
    nA, B, W = T // block_size, block_size, window
    h, kv, D = attn.n_heads, attn.n_kv, attn.head_dim
    g = h // kv
    q = attn.q_norm(attn.q_proj(x).view(N, T, h, D)).transpose(1, 2)
    q = apply_rope(q, cos, sin)                                    # [N, h, T, D]
    k, v = attn.kv(x, cos, sin)                                    # [N, kv, T, D]
    scale = 1.0 / math.sqrt(D)
    # context band of anchor a: keys a - W + 1 + o, o = 0 .. W - 2; query a + k sees o >= k
    band = anchor_pos[:, :, None] - W + 1 + torch.arange(W - 1, device=x.device)     # [N, nA, W-1]
    idx = band.clamp(min=0).flatten(1)                                               # [N, nA*(W-1)]
    gather = idx[:, None, :, None].expand(N, kv, idx.shape[1], D)
    bk = ctx_k.gather(2, gather).view(N, kv, nA, W - 1, D)
    bv = ctx_v.gather(2, gather).view(N, kv, nA, W - 1, D)
    qg = q.view(N, kv, g, nA, B, D)
    s_ctx = torch.einsum("nkgabd,nkawd->nkgabw", qg, bk) * scale                   # [N, kv, g, nA, B, W-1]
    kk = torch.arange(B, device=x.device)[:, None]
    oo = torch.arange(W - 1, device=x.device)[None, :]
    ok = (oo >= kk)[None, None, :, :] & (band >= 0)[:, :, None, :]                   # [N, nA, B, W-1]
    s_ctx = s_ctx.masked_fill(~ok[:, None, None], float("-inf"))
    kb, vb = k.view(N, kv, nA, B, D), v.view(N, kv, nA, B, D)
    s_blk = torch.einsum("nkgabd,nkacd->nkgabc", qg, kb) * scale                   # [N, kv, g, nA, B, B]
    if W < B:
        near = (kk - kk.T).abs() < W
        s_blk = s_blk.masked_fill(~near, float("-inf"))
    p = torch.softmax(torch.cat([s_ctx, s_blk], -1).float(), -1).to(q.dtype)
    out = (torch.einsum("nkgabw,nkawd->nkgabd", p[..., :W - 1], bv)
           + torch.einsum("nkgabc,nkacd->nkgabd", p[..., W - 1:], vb))
    return attn.o_proj(out.reshape(N, h, T, D).transpose(1, 2).reshape(N, T, -1))


def _factored_attention(attn, x, cos, sin, ctx_k, ctx_v, ctx_allowed, block_size: int):
    """Same result as `DraftAttention.forward` with the dense block mask, computed as
    [context scores | in-block scores] with one softmax. x: [N, nA*B, H]; ctx_allowed:
    bool [N, nA*B, S]."""
    N, T, _ = x.shape
    nA, B = T // block_size, block_size
    q = attn.q_norm(attn.q_proj(x).view(N, T, attn.n_heads, attn.head_dim)).transpose(1, 2)
    q = apply_rope(q, cos, sin)                                    # [N, h, T, D]
    k, v = attn.kv(x, cos, sin)                                    # [N, kv, T, D]
    groups = attn.n_heads // attn.n_kv
    scale = 1.0 / math.sqrt(attn.head_dim)
    ck, cv = repeat_kv(ctx_k, groups), repeat_kv(ctx_v, groups)    # [N, h, S, D]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    s_ctx = torch.matmul(q, ck.transpose(-1, -2)) * scale          # [N, h, T, S]
    s_ctx = s_ctx.masked_fill(~ctx_allowed[:, None], float("-inf"))
    qb = q.view(N, attn.n_heads, nA, B, attn.head_dim)
    kb = k.view(N, attn.n_heads, nA, B, attn.head_dim)
    vb = v.view(N, attn.n_heads, nA, B, attn.head_dim)
    s_blk = torch.matmul(qb, kb.transpose(-1, -2)) * scale         # [N, h, nA, B, B]
    S = s_ctx.shape[-1]
    scores = torch.cat([s_ctx, s_blk.reshape(N, attn.n_heads, T, B)], dim=-1)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(p[..., :S], cv)
    out = out + torch.matmul(p[..., S:].reshape(N, attn.n_heads, nA, B, B), vb).reshape(N, attn.n_heads, T, -1)
    return attn.o_proj(out.transpose(1, 2).reshape(N, T, -1))


def draft_hidden(model: DFlashDraft, features: torch.Tensor, tokens: torch.Tensor, anchors: Anchors,
                 *, attention: str = "factored"):
    """Final normed draft hidden states [N, nA, B, H] of every anchored block.

    features: [N, C, len(target_layer_ids) * H_t] target features of the first C tokens of
    `tokens` [N, S] (C = S, or S - 1 when the last token was never run); anchors must be <= C."""
    cfg = model.cfg
    N = tokens.shape[0]
    C = features.shape[1]          # context length: features may stop before the last token
    B = cfg.block_size
    if int(anchors.pos.max()) > C:
        raise ValueError(f"an anchor at {int(anchors.pos.max())} needs context features up to it; "
                         f"only {C} positions have features")
    ids, positions, labels, valid = block_inputs(model, tokens, anchors)
    fused = model.fuse(features)
    ctx_kv = model.context_kv(fused, torch.arange(C, device=tokens.device))
    windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
    if attention == "dense":
        masks = {w: block_mask(anchors, C, B, w) for w in set(windows)}
        h = model.block_forward(ids, positions, ctx_kv, [masks[w] for w in windows])
    elif attention == "factored":
        # full-attention layers share one context mask; sliding ones gather their band instead
        allowed = _context_allowed(anchors, C, B, None) if None in windows else None
        x = model.embed(ids)
        cos, sin = model.rope(positions, x.dtype)
        for layer, (ck, cv), w in zip(model.layers, ctx_kv, windows):
            if w:
                run = (lambda attn, u, ck=ck, cv=cv, w=w:
                       _banded_attention(attn, u, cos, sin, ck, cv, anchors.pos, w, B))
            else:
                run = (lambda attn, u, ck=ck, cv=cv:
                       _factored_attention(attn, u, cos, sin, ck, cv, allowed, B))
            x = layer(x, run)
        h = model.norm(x)
    else:
        raise ValueError(f"attention={attention!r}; expected 'dense' or 'factored'")
    return h.view(N, -1, B, h.shape[-1]), labels, valid


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(k-1)/γ) for slots k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class Teacher:
    """The frozen target's lm_head over its last-layer tap, which is already final-normed
    (`CausalLM.tap`, transformers' `hidden_states[L]`)."""
    lm_head: torch.Tensor         # [V, H]

    @classmethod
    def of(cls, target) -> "Teacher":
        """The head of a loaded target (`splitspec.models.dense.CausalLM`)."""
        return cls(target.lm_head.weight.detach())

    @torch.no_grad()
    def probs(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return torch.softmax(F.linear(final_hidden, self.lm_head).float(), -1)

    @torch.no_grad()
    def kept_probs(self, final_hidden: torch.Tensor, head_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(p over the kept tokens [.., K]: the target's distribution restricted to them and
        renormalised; whether the target's argmax is kept [..])."""
        z = F.linear(final_hidden, self.lm_head).float()
        kept = vocab.t2d_mask(head_ids, z.shape[-1])
        return torch.softmax(z[..., head_ids], -1), kept[z.argmax(-1)]


@dataclass
class LossOut:
    loss: torch.Tensor            # weighted mean cross-entropy (scalar, differentiable)
    correct: torch.Tensor         # [B-1] drafted token == label counts per slot (DFlash2: the selector's pick)
    count: torch.Tensor           # [B-1] valid labels per slot
    accept_sum: float             # sum over valid anchors of accepted-prefix length (teacher forced)
    anchors: int                  # anchors with a full block of labels
    selector: SelectorOut | None = None     # DFlash2 only: its term, top-K recall, unary accuracy
    unary_correct: torch.Tensor | None = None


def soft_labels(teacher: Teacher, final_hidden: torch.Tensor, anchors: Anchors, block_size: int) -> torch.Tensor:
    """p_target for every slot: [N, nA, B-1, V] from the target's last-layer taps
    final_hidden [N, C, H] at positions a … a+B-2 (position j predicts token j+1). The head runs once
    per distinct position, not once per slot."""
    return at_slots(teacher.probs(final_hidden), anchors, block_size)


def kept_soft_labels(teacher: Teacher, final_hidden: torch.Tensor, anchors: Anchors, block_size: int,
                     head_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`soft_labels` over a reduced head's tokens: p_target restricted to `head_ids` and
    renormalised [N, nA, B-1, K], and whether the target's argmax at the slot is kept [N, nA, B-1]."""
    p, ok = teacher.kept_probs(final_hidden, head_ids)
    return at_slots(p, anchors, block_size), at_slots(ok[..., None], anchors, block_size)[..., 0]


def at_slots(x: torch.Tensor, anchors: Anchors, block_size: int) -> torch.Tensor:
    """x [N, C, D] per position -> [N, nA, B-1, D] at each slot's predicting position a + k - 1."""
    N, C, D = x.shape
    pos = anchors.pos[:, :, None] + torch.arange(block_size - 1, device=anchors.pos.device)
    idx = pos.clamp(max=C - 1).flatten(1)                                         # [N, nA*(B-1)]
    return x.gather(1, idx[..., None].expand(-1, -1, D)).view(N, *pos.shape[1:], D)


def objective(model: DFlashDraft, features: torch.Tensor, tokens: torch.Tensor, anchors: Anchors, *,
              gamma: float = 4.0, attention: str = "factored", teacher: Teacher | None = None,
              final_hidden: torch.Tensor | None = None, distill: float = 1.0,
              selector_alpha: float = 1.0) -> LossOut:
    """Weighted block loss. With `teacher` and the target's last-layer `final_hidden` [N, C, H],
    the label is `distill` x p_target + (1 - distill) x one-hot(x_{a+k}). A DFlash2 draft adds
    `selector_alpha` x its selector term (`dflash2_objective`); its base loss is on the unary
    logits after the multiplier and soft cap, as inference computes them."""
    h, labels, valid = draft_hidden(model, features, tokens, anchors, attention=attention)
    logits = model.draft_logits(h[:, :, 1:]).float()                   # [N, nA, B-1, head_size]
    head_ids = model.head_ids()
    target_labels = labels
    kept = torch.ones_like(valid)
    if head_ids is not None:
        labels = vocab.t2d_index(head_ids, model.cfg.vocab_size)[labels]     # draft ids, -1 if not kept
        kept = labels >= 0
        labels = labels.clamp(min=0)
    pw = position_weights(model.cfg.block_size, gamma, logits.device)
    w = pw * valid.float()

    def weighted(ce: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        ww = w * ok.float()
        return (ce * ww).sum() / ww.sum().clamp(min=1e-6)

    def hard() -> torch.Tensor:
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        return weighted(ce, kept)

    if teacher is not None and distill > 0:
        if head_ids is None:
            p, soft_ok = soft_labels(teacher, final_hidden, anchors, model.cfg.block_size), kept
        else:
            p, soft_ok = kept_soft_labels(teacher, final_hidden, anchors, model.cfg.block_size, head_ids)
        loss = distill * weighted(-(p * torch.log_softmax(logits, -1)).sum(-1), soft_ok)
        if distill < 1:
            loss = loss + (1 - distill) * hard()
    else:
        loss = hard()
    sel = None
    if isinstance(model, DFlash2Draft):
        anchor_ids = tokens.gather(1, anchors.pos)
        sel = selector_term(model, h[:, :, 1:], logits, anchor_ids, labels, valid & kept, pw,
                            target_labels=target_labels)
        loss = loss + selector_alpha * sel.loss
    with torch.no_grad():
        unary_hit = (logits.argmax(-1) == labels) & valid & kept
        hit = unary_hit if sel is None else sel.hit
        correct = hit.sum((0, 1)).float()
        count = valid.sum((0, 1)).float()
        full = valid.all(-1)
        # accepted prefix length under teacher forcing: leading run of correct slots
        run = hit.int().cumprod(-1).sum(-1).float()
        accept_sum = float(run[full].sum())
    return LossOut(loss, correct, count, accept_sum, int(full.sum()), sel, unary_hit.sum((0, 1)).float())
