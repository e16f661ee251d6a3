"""Wire-level pieces of the speculative step (the loop itself is `spec_loop.py`): trimming a
proposal to the chosen width, joining feature rows owed to the draft, and the per-step stats."""
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


def concat_rows(tensors: list[common_pb2.Tensor]) -> common_pb2.Tensor | None:
    """Row-wise concatenation of [n_i, d] tensors of one dtype, without decoding them."""
    if not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0]
    return common_pb2.Tensor(data=b"".join(t.data for t in tensors), dtype=first.dtype,
                             shape=[sum(t.shape[0] for t in tensors), *first.shape[1:]])


def record_step(stats: Stats, method: str, drafted: int, accepted: int, committed: int) -> None:
    stats.verify_steps += 1
    stats.draft_tokens += drafted
    stats.committed += committed
    stats.steps.append((method, drafted, accepted))
    stats.steps_by_method[method] = stats.steps_by_method.get(method, 0) + 1
    if drafted:
        count_accepted(stats.accepted_per_position, drafted, accepted)
