"""Budgeted best-first search for draft token trees, shared by the tree builders
(`dflash_tree.py`, `dflash2_tree.py`).

A builder describes its candidate tree by `expand(parent_token, depth) -> [(token, log_prob)]`:
the at most `topk` children a node at depth `depth - 1` holding `parent_token` may get, best
first. A node's score is the sum of its path's log-probabilities, so a child never scores above
its parent, and the highest-scoring nodes form an ancestor-closed set by themselves.

The search first lays the spine, when given one (the chain the drafter would have proposed
alone; the proposer passes its sampled walk, whose rows carry q), so a tree never accepts less
than the chain it extends, then adds the best remaining candidates from a heap until the node
budget is spent. Without a spine (greedy drafts) the greedy walk is still in the tree, as deep
as its score earns: it is every level's best child. Nodes come out in the
order they were chosen: parents before children, the spine first, then by falling score. Any
prefix of that order is itself the best tree of its size containing the spine's prefix, which
lets the gateway cut a proposal to the budget it can afford this step."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

Expand = Callable[[int, int], Sequence[tuple[int, float]]]


@dataclass
class BuiltTree:
    token_ids: list[int]
    parents: list[int]
    scores: list[float]          # cumulative log-probability of each node's path
    spine: int                   # the first `spine` nodes are the spine, a chain


def best_first_tree(expand: Expand, *, root_token: int, spine: Sequence[tuple[int, float]],
                    budget: int, max_depth: int, topk: int) -> BuiltTree:
    """spine: (token, log_prob) of the chain laid first (cut to the budget and depth)."""
    out = BuiltTree([], [], [], 0)
    if budget <= 0 or max_depth <= 0:
        return out
    children: dict[int, list[int]] = {}            # node (-1: root) -> its children's tokens
    cursor: dict[int, int] = {}                    # node -> next index into its expansion
    tokens_of = {-1: root_token}
    depth_of = {-1: 0}
    score_of = {-1: 0.0}
    cache: dict[tuple[int, int], Sequence[tuple[int, float]]] = {}
    heap: list[tuple[float, int, int, int, float]] = []   # (-score, order, parent, token, log_prob)
    order = 0

    def options(node: int):
        key = (tokens_of[node], depth_of[node] + 1)
        if key not in cache:
            cache[key] = list(expand(*key))[:topk]
        return cache[key]

    def add(parent: int, token: int, lp: float) -> int:
        i = len(out.token_ids)
        out.token_ids.append(token)
        out.parents.append(parent)
        out.scores.append(score_of[parent] + lp)
        tokens_of[i], depth_of[i], score_of[i] = token, depth_of[parent] + 1, out.scores[-1]
        children.setdefault(parent, []).append(token)
        return i

    def push_next(node: int) -> None:
        """Queue `node`'s best child not yet in the tree, if it may have another."""
        nonlocal order
        if depth_of[node] >= max_depth or len(children.get(node, ())) >= topk:
            return
        opts = options(node)
        j = cursor.get(node, 0)
        taken = children.get(node, ())
        while j < len(opts) and opts[j][0] in taken:
            j += 1
        cursor[node] = j + 1
        if j < len(opts):
            token, lp = opts[j]
            heapq.heappush(heap, (-(score_of[node] + lp), order, node, token, lp))
            order += 1

    parent = -1
    for token, lp in list(spine)[:min(budget, max_depth)]:
        parent = add(parent, token, lp)
    out.spine = len(out.token_ids)
    for node in range(-1, out.spine):
        push_next(node)
    while heap and len(out.token_ids) < budget:
        _, _, parent, token, lp = heapq.heappop(heap)
        if token in children.get(parent, ()):
            push_next(parent)                       # a sibling equal to one added since: skip it
            continue
        node = add(parent, token, lp)
        push_next(parent)
        push_next(node)
    return out
