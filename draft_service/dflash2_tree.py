"""DFlash2 token trees: a budgeted best-first search over the candidate selector's lattice. At
depth d the selector keeps the K best unary candidates and scores each given the token above it,
S_d(a, b) = U_d(b) + <A[a] * W_h h_d, B[b]>; a child's log-probability is log softmax_b S_d(parent,
b) over those K, and a node's score is the sum along its path. This is the selector beam
(SGLang's DFlash2 tree) searched best-first under the node budget instead of a fixed width per
depth, so at a given budget it keeps exactly the highest-scoring nodes."""
from __future__ import annotations

import torch

from .tree_search import BuiltTree, best_first_tree


def dflash2_tree(selector, h: torch.Tensor, unary: torch.Tensor, *, root_token: int, spine: list[int],
                 budget: int, max_depth: int, topk: int) -> BuiltTree:
    """selector: the draft's CandidateSelector; h [D, H] and unary [D, V] of the block's mask
    slots. spine: the selector walk the draft proposes alone (greedy or sampled), laid first."""
    depth = min(max_depth, h.shape[0])
    cand, u = selector.candidates(unary[:depth])                           # [D, K]
    gate = selector.hidden_projection(h[:depth]).float()                   # [D, r]
    succ = selector.successor_codebook[cand].float()                       # [D, K, r]
    pred = selector.predecessor_codebook
    ids = cand.tolist()

    def log_probs(parent: int, d: int) -> torch.Tensor:
        s = u[d - 1] + succ[d - 1] @ (pred[parent].float() * gate[d - 1])
        return torch.log_softmax(s, -1)

    def expand(parent: int, d: int):
        lp = log_probs(parent, d)
        best = torch.topk(lp, min(topk, lp.shape[0]))
        return [(ids[d - 1][j], v) for v, j in zip(best.values.tolist(), best.indices.tolist())]

    spine_scored, prev = [], root_token
    for d, tok in enumerate(spine[:depth], start=1):
        row = ids[d - 1]
        # A sampled spine token is always one of the K candidates (q is zero elsewhere).
        lp = float(log_probs(prev, d)[row.index(tok)]) if tok in row else float("-inf")
        spine_scored.append((tok, lp))
        prev = tok
    return best_first_tree(expand, root_token=root_token, spine=spine_scored, budget=budget,
                           max_depth=depth, topk=topk)
