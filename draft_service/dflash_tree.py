"""DFlash token trees: a budgeted best-first search over the block's per-position marginals
(DDTree's construction). A DFlash block drafts every position in one forward, so the draft's
distribution at depth d does not depend on the tokens above it: a node's children are the top-k
tokens of position d whatever its parent, and a path's score is the sum of its tokens'
per-position log-probabilities."""
from __future__ import annotations

import torch

from .tree_search import BuiltTree, best_first_tree


def dflash_tree(logits: torch.Tensor, *, root_token: int, spine: list[int], budget: int, max_depth: int,
                topk: int) -> BuiltTree:
    """logits [D, V]: the block's logits for depths 1..D. spine: the chain the draft proposes
    alone (its argmax walk, or its sampled one), laid first."""
    depth = min(max_depth, logits.shape[0])
    logp = torch.log_softmax(logits[:depth].float(), -1)
    top_lp, top_ids = torch.topk(logp, min(topk, logp.shape[-1]), dim=-1)
    table = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist())]
    spine_lp = logp[torch.arange(min(len(spine), depth)), torch.tensor(spine[:depth], dtype=torch.long)].tolist()
    return best_first_tree(lambda _parent, d: table[d - 1], root_token=root_token,
                           spine=list(zip(spine[:depth], spine_lp)), budget=budget, max_depth=depth, topk=topk)
