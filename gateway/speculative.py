"""Wire-level pieces of the speculative step (the loop itself is `spec_loop.py`): trimming a
proposal to the chosen size, joining feature rows owed to the draft, and the per-step stats."""
from __future__ import annotations

from splitspec import tracing
from splitspec.acceptance import count_accepted
from splitspec.v1 import common_pb2

from .generation import Stats


def is_chain(parents) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def trim_tree(tree: common_pb2.TokenTree, probs: common_pb2.Tensor | None, n: int, max_depth: int | None = None):
    """Keep the first n nodes of a tree whose nodes come parents first (and their draft_probs
    rows), dropping those deeper than max_depth: nodes past the step's budget or the request's
    remaining tokens would be verified only to be thrown away. Drafters list their nodes best
    first, so the first n are the best n (and for a chain, its first n tokens)."""
    parents = list(tree.parents)
    keep = list(range(min(n, len(parents))))
    if max_depth is not None:
        d = depths(parents)
        keep = [i for i in keep if d[i] <= max_depth]
    if len(keep) == len(parents):
        return tree, probs
    new_index = {old: new for new, old in enumerate(keep)}
    tree = common_pb2.TokenTree(token_ids=[tree.token_ids[i] for i in keep],
                                parents=[-1 if parents[i] < 0 else new_index[parents[i]] for i in keep])
    if probs is not None and probs.shape:
        row = len(probs.data) // probs.shape[0]
        probs = common_pb2.Tensor(data=b"".join(probs.data[i * row:(i + 1) * row] for i in keep), dtype=probs.dtype,
                                  shape=[len(keep), *probs.shape[1:]])
    return tree, probs


def tree_trials(parents, token_ids, committed: list[int]) -> list[tuple[int, int, bool]]:
    """What a verify tried, as (depth - 1, sibling rank, accepted) per tried node: at each node
    the walk reached, its children in order up to the accepted one (all of them when none
    was). `committed` is the accepted path's tokens and the bonus; siblings hold distinct
    tokens, so the path is found by following them."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    out, node = [], -1
    for depth, tok in enumerate(committed):
        nxt = None
        for rank, child in enumerate(children.get(node, ())):
            hit = token_ids[child] == tok
            out.append((depth, rank, hit))
            if hit:
                nxt = child
                break
        if nxt is None:
            break
        node = nxt
    return out


def concat_rows(tensors: list[common_pb2.Tensor]) -> common_pb2.Tensor | None:
    """Row-wise concatenation of [n_i, d] tensors of one dtype, without decoding them."""
    if not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0]
    return common_pb2.Tensor(data=b"".join(t.data for t in tensors), dtype=first.dtype,
                             shape=[sum(t.shape[0] for t in tensors), *first.shape[1:]])


def record_step(stats: Stats, method: str, drafted: int, accepted: int, committed: int, depth: int | None = None) -> None:
    stats.verify_steps += 1
    stats.draft_tokens += drafted
    stats.committed += committed
    stats.steps.append((method, drafted, accepted, drafted if depth is None else depth))
    stats.steps_by_method[method] = stats.steps_by_method.get(method, 0) + 1
    if stats.trace is not None:
        tracing.step(stats, method, drafted, accepted, committed)
    if drafted:
        # Per depth: a tree's nodes share their depths' positions.
        count_accepted(stats.accepted_per_position, drafted if depth is None else depth, accepted)
