"""The speculative token source: Open on the target (prefill, b0 and the prompt's features),
Open on the draft with those features, then per step Propose on the draft -> Verify on the
target -> yield the committed tokens, the accepted drafts and the bonus (DESIGN §3, "One
speculative step"). It plugs into `generation.stream_response` like `target_only_steps`."""
from __future__ import annotations

import time
from typing import AsyncIterator

from splitspec.v1 import common_pb2

from .backends import DraftSession, TargetSession
from .generation import Stats
from .request import Request


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
    if len(stats.accepted_per_position) < drafted:
        stats.accepted_per_position.extend([0] * (drafted - len(stats.accepted_per_position)))
    for k in range(accepted):
        stats.accepted_per_position[k] += 1


async def speculative_steps(target: TargetSession, draft: DraftSession, req: Request, stats: Stats, *,
                            method: str, layer_ids: list[int], speculative: common_pb2.SpeculativeParams,
                            tokenizer_hash: str = "") -> AsyncIterator[list[int]]:
    stats.method = method
    t = time.perf_counter()
    width = speculative.num_draft_tokens or 8
    # Room for the last verify's nodes on top of max_new_tokens, so trimming never starves.
    opened = await target.open(req.request_id, req.prompt_ids, req.sampling, hidden_layer_ids=layer_ids,
                               max_new_tokens=req.max_new_tokens + width)
    stats.model_ms += opened.forward_ms
    stats.verify_ms += (time.perf_counter() - t) * 1e3
    stats.hidden_state_bytes += len(opened.hidden.data)
    yield [opened.first_token_id]

    t = time.perf_counter()
    await draft.open(req.request_id, req.prompt_ids, opened.hidden if layer_ids else None, speculative,
                     req.sampling, tokenizer_hash)
    stats.draft_ms += (time.perf_counter() - t) * 1e3
    new_ids, new_hidden, length = [opened.first_token_id], None, opened.length
    generated = 1
    while generated < req.max_new_tokens:
        t = time.perf_counter()
        prop = await draft.propose(length, new_ids, new_hidden)
        t_draft = time.perf_counter()
        stats.draft_ms += (t_draft - t) * 1e3
        stats.model_ms += prop.draft_ms
        probs = prop.draft_probs if prop.HasField("draft_probs") else None
        # At most remaining - 1 drafts: the step also commits a bonus token.
        tree, probs = trim_chain(prop.tree, probs, req.max_new_tokens - generated - 1)
        verified = await target.verify(stats.verify_steps, length, tree, probs)
        stats.verify_ms += (time.perf_counter() - t_draft) * 1e3
        stats.model_ms += verified.forward_ms
        stats.hidden_state_bytes += len(verified.hidden.data)
        record_step(stats, len(tree.token_ids), verified.num_accepted, len(verified.committed_token_ids))
        new_ids = list(verified.committed_token_ids)
        new_hidden = verified.hidden if layer_ids else None
        length = verified.length
        generated += len(new_ids)
        yield new_ids
