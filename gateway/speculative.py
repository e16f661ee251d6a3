"""Pieces of the speculative step (DESIGN §3, "One speculative step"): Open on the target
(prefill, b0 and the prompt's features), Open on the draft with those features, then per step
Propose on the draft -> Verify on the target -> the committed tokens, the accepted drafts and
the bonus. The loop itself is `failover.ResilientSource._attempt`, which also survives a lost
draft or target."""
from __future__ import annotations

from splitspec.acceptance import count_accepted
from splitspec.v1 import common_pb2

from .generation import Stats


def trim_chain(tree: common_pb2.TokenTree, probs: common_pb2.Tensor | None, n: int):
    """Keep the first n nodes of a topologically ordered tree (and their draft_probs rows):
    nodes past the request's remaining budget would be verified only to be thrown away."""
    if len(tree.token_ids) <= n:
        return tree, probs
    tree = common_pb2.TokenTree(token_ids=tree.token_ids[:n], parents=tree.parents[:n])
    if probs is not None and probs.shape:
        row = len(probs.data) // probs.shape[0]
        probs = common_pb2.Tensor(data=probs.data[:n * row], dtype=probs.dtype, shape=[n, *probs.shape[1:]])
    return tree, probs


def record_step(stats: Stats, drafted: int, accepted: int, committed: int) -> None:
    stats.verify_steps += 1
    stats.draft_tokens += drafted
    stats.committed += committed
    count_accepted(stats.accepted_per_position, drafted, accepted)
