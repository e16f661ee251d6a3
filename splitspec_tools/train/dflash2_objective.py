"""The DFlash2 candidate selector's training term.

At each block slot k the draft keeps the K best unary candidates C_k and scores them after a
predecessor a with S_k(a, b) = U_k(b) + <A[a] * W_h h_k, B[b]>. Training teacher-forces the
predecessor (the gold token before slot k; the anchor for k = 1) and asks the selector to put
the gold token first among C_k: a K-way cross-entropy over S_k(a, .), weighted by the same
per-slot decay as the base loss and normalised by its own weights. A gold token that the unary
top-K missed replaces the weakest candidate, keeping its true unary logit, so every valid slot
teaches the selector something and the term never rewards pushing gold out of C_k (SpecForge
PR #772 / speculators / TorchSpec; the alternative of dropping such slots hides them).

With a reduced vocabulary the unary logits, the candidates and the labels are draft ids; the
codebooks are indexed by target ids (a predecessor may be any committed token, kept or not), so
candidates are mapped to target ids before the successor codebook is read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draft_service.dflash2 import DFlash2Draft


@dataclass
class SelectorOut:
    loss: torch.Tensor            # weighted K-way cross-entropy (scalar)
    correct: torch.Tensor         # [B-1] teacher-forced selector argmax == gold
    recall: torch.Tensor          # [B-1] gold within the unary top-K
    count: torch.Tensor           # [B-1] valid slots
    hit: torch.Tensor             # [N, nA, B-1] per-slot selector hit (for the accept estimate)


def selector_term(model: DFlash2Draft, h: torch.Tensor, unary: torch.Tensor, anchor_ids: torch.Tensor,
                  labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                  target_labels: torch.Tensor | None = None) -> SelectorOut:
    """h [N, nA, B-1, H] final normed draft hidden of the mask slots; unary [.., head_size] their
    unary logits (after multiplier and cap); anchor_ids [N, nA]; labels / valid [N, nA, B-1]
    (labels as head ids, valid only where kept); target_labels: the same tokens as target ids
    (default: labels); weights [B-1]."""
    sel = model.candidate_selector
    K = sel.top_k
    scores_u, cand = unary.topk(K, dim=-1)                                     # [N, nA, B-1, K]
    in_top = cand == labels[..., None]
    recalled = in_top.any(-1)
    # Gold missing: it takes the weakest slot (the last of the sorted top-K) with its own logit.
    gold_u = unary.gather(-1, labels[..., None])
    cand = torch.where(recalled[..., None], cand, torch.cat([cand[..., :-1], labels[..., None]], -1))
    scores_u = torch.where(recalled[..., None], scores_u, torch.cat([scores_u[..., :-1], gold_u], -1))
    target = torch.where(recalled, in_top.float().argmax(-1), torch.full_like(labels, K - 1))
    gold = labels if target_labels is None else target_labels
    pred = torch.cat([anchor_ids[..., None], gold[..., :-1]], -1)              # teacher-forced a
    gate = sel.predecessor_codebook[pred] * sel.hidden_projection(h)           # [N, nA, B-1, r]
    head_ids = model.head_ids()
    succ = cand if head_ids is None else head_ids[cand]
    pair = torch.einsum("...r,...kr->...k", gate.float(), sel.successor_codebook[succ].float())
    s = scores_u.float() + pair
    ce = F.cross_entropy(s.flatten(0, 2), target.flatten(), reduction="none").view(labels.shape)
    w = weights * valid.float()
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (s.argmax(-1) == target) & valid & recalled     # an injected gold is never drafted
        return SelectorOut(loss, hit.sum((0, 1)).float(), (recalled & valid).sum((0, 1)).float(),
                           valid.sum((0, 1)).float(), hit)
