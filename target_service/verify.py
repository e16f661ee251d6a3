"""Lossless verification of a draft token tree against the target's logits.

`logits[0]` are the target's logits at the root (the last committed token) and
`logits[i + 1]` those at node i. Three rules, all of which leave the output distribution
exactly the target's (DESIGN §3):

* greedy (temperature 0): follow the child equal to the argmax; the bonus is the argmax at
  the last accepted node;
* target-only (deterministic draft, no q): try children in order, accepting x with
  probability p'(x) where p' is p with already rejected siblings removed and renormalised
  — i.e. p(x) / (1 - sum p(rejected)); if none is accepted, the bonus is drawn from p';
* with draft probabilities q (sampled drafts): accept x with min(1, p'(x)/q(x)); on
  rejection p' <- norm(max(p' - q, 0)) (Leviathan et al.; for siblings drawn i.i.d. from
  the same q this is SpecInfer's multi-draft rule).

With coupled sampling (`SamplingParams.coupled`, the default) none of those coins is drawn:
at every node on the way down the target computes its own token, the Gumbel-argmax keyed by
(seed, that token's absolute position) over its processed row, accepts the child carrying it,
and at the first node with no such child commits it as the bonus. The committed tokens are then
exactly those target-only sampling with that seed emits, whatever was drafted, for chains and
trees alike; q plays no part (a draft that shares the noise just proposes those tokens more often).

In the other modes a tree may mix the two kinds: a node whose row of `draft_probs` is all zero was chosen
deterministically and is tested by the target-only rule. Each test, of either kind, emits a
token distributed exactly as the p' it starts from (accepted, or drawn later from the residual
it leaves), whatever the order of the siblings and however the deterministic ones were chosen,
as long as the draft chose them without seeing the target's coins; so a sampled spine with
deterministic side branches is lossless too (`tests/test_tree_verify.py` enumerates it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.engine.sample import SamplingParams, coupled_sample, probs_from_logits, sample_from_probs
from splitspec.engine.tree import Tree


# How far a sampled row of q may sum from 1, beyond the rounding of the dtype it came in: a row
# rounded entry by entry to bf16 / f16 sums to within that dtype's unit roundoff (2^-8, 2^-11) of
# the float32 row the draft sampled from, which sums to 1 within float32 rounding, far inside
# this. A row off by more (0.991) was not a distribution the draft sampled from; a row within it
# is renormalised, so the verifier tests the distribution the rounding came from.
Q_SUM_TOLERANCE = 1e-4


def q_sum_tolerance(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 + Q_SUM_TOLERANCE


class DraftProbsError(ValueError):
    """Draft probabilities the rules above cannot stand on (INVALID_ARGUMENT, naming the node)."""


def check_draft_probs(draft_probs: torch.Tensor, tree: Tree, field: str = "verify.draft_probs") -> torch.Tensor:
    """q as the verifier takes it: float32, each sampled row renormalised to sum to 1. Refuses a
    q that would bias the output silently instead of being tested: NaN or infinite entries,
    negative ones, a row that is neither all zero (a deterministic node) nor sums to 1 within
    its dtype's rounding (`q_sum_tolerance`), or q(x) = 0 for a node whose row says it was
    sampled (its acceptance ratio p/q would be infinite, so the node would pass whatever the
    target thinks of it). Names the first bad node. Cheap next to the forward: a few passes over
    [nodes, vocab]; run it on the engine thread, as the forward."""
    q = draft_probs.to(torch.float32, copy=True)
    checks = (
        (~torch.isfinite(q)).any(-1), "has a NaN or infinite entry",
        (q < 0).any(-1), "has a negative entry",
    )
    for i in range(0, len(checks), 2):
        bad = checks[i].nonzero()
        if len(bad):
            node = int(bad[0])
            raise DraftProbsError(f"{field}[{node}] (tree node {node}) {checks[i + 1]}: q must be a distribution")
    sums = q.sum(-1)
    sampled = sums > 0
    tolerance = q_sum_tolerance(draft_probs.dtype)
    off = (sampled & ((sums - 1).abs() > tolerance)).nonzero()
    if len(off):
        node = int(off[0])
        raise DraftProbsError(f"{field}[{node}] (tree node {node}) sums to {float(sums[node]):.6g}; a sampled node's "
                              f"row must sum to 1 (within {tolerance:.3g} at {str(draft_probs.dtype).removeprefix('torch.')}), "
                              "a deterministic node's be all zero")
    if len(tree):
        ids = torch.tensor(tree.token_ids, dtype=torch.long, device=q.device)
        q_x = q.gather(1, ids[:, None])[:, 0]
        zero = (sampled & (q_x <= 0)).nonzero()
        if len(zero):
            node = int(zero[0])
            raise DraftProbsError(f"{field}[{node}] (tree node {node}) gives its own token {tree.token_ids[node]} "
                                  "probability 0: the draft cannot have sampled it from that row")
    q[sampled] /= sums[sampled, None]
    return q


@dataclass
class VerifyResult:
    accepted: list[int]     # node indices of the accepted path, root to leaf
    bonus: int              # token sampled at the last accepted node (or at the root)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def committed(self, tree: Tree) -> list[int]:
        return [tree.token_ids[i] for i in self.accepted] + [self.bonus]


def _uniform(generator: torch.Generator, device) -> float:
    return float(torch.rand((), generator=generator, device=device, dtype=torch.float64))


def _follow(tree: Tree, target_token) -> VerifyResult:
    """Walk down the tree taking the child equal to the target's own token at each node;
    target_token(row, depth) is that token for logits row `row` at depth `depth` (0: the root)."""
    node, path = -1, []
    while True:
        target = target_token(node + 1, len(path))
        nxt = next((c for c in tree.children(node) if tree.token_ids[c] == target), None)
        if nxt is None:
            return VerifyResult(path, target)
        path.append(nxt)
        node = nxt


def verify_greedy(logits: torch.Tensor, tree: Tree) -> VerifyResult:
    argmax = logits.argmax(-1).tolist()
    return _follow(tree, lambda row, depth: argmax[row])


def verify_coupled(logits: torch.Tensor, tree: Tree, params: SamplingParams, seed: int,
                   position: int) -> VerifyResult:
    """position: the absolute position of the token the root's row predicts (the committed
    length); a node at depth d predicts position + d. Only rows on the accepted path are sampled."""
    return _follow(tree, lambda row, depth: coupled_sample(logits[row], params, seed, position + depth))


def verify_sampling(logits: torch.Tensor, tree: Tree, params: SamplingParams,
                    generator: torch.Generator, draft_probs: torch.Tensor | None = None) -> VerifyResult:
    """draft_probs[i] is the distribution node i was drawn from (None, or a row of zeros: a
    deterministic node)."""
    sampled = [False] * len(tree) if draft_probs is None else (draft_probs.sum(-1) > 0).tolist()
    node, path = -1, []
    while True:
        p = probs_from_logits(logits[node + 1], params).double()
        accepted = None
        for child in tree.children(node):
            x = tree.token_ids[child]
            if not sampled[child]:
                ratio = float(p[x])
            else:
                q = draft_probs[child].double()
                qx = float(q[x])
                ratio = 1.0 if qx <= 0.0 and p[x] > 0 else min(1.0, float(p[x]) / max(qx, 1e-300))
            if _uniform(generator, logits.device) < ratio:
                accepted = child
                break
            if not sampled[child]:
                p[x] = 0.0
            else:
                p = torch.clamp(p - q, min=0.0)
            total = p.sum()
            if total <= 0:  # only reachable through rounding: nothing left to reject into
                p = probs_from_logits(logits[node + 1], params).double()
            else:
                p = p / total
        if accepted is None:
            return VerifyResult(path, sample_from_probs(p, generator))
        path.append(accepted)
        node = accepted


def verify_tree(logits: torch.Tensor, tree: Tree, params: SamplingParams,
                generator: torch.Generator | None = None,
                draft_probs: torch.Tensor | None = None, position: int | None = None) -> VerifyResult:
    """position: the absolute position the root's row predicts (coupled sampling keys its noise
    by it, and by the generator's seed)."""
    if logits.shape[0] != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} rows of logits (root + nodes), got {logits.shape[0]}")
    if params.greedy:
        return verify_greedy(logits, tree)
    if generator is None:
        raise ValueError("sampling verification needs a generator")
    if draft_probs is not None and draft_probs.shape[0] != len(tree):
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows, expected one per node ({len(tree)})")
    if params.coupled:
        if position is None:
            raise ValueError("coupled verification needs the position of the root's next token")
        return verify_coupled(logits, tree, params, generator.initial_seed(), position)
    return verify_sampling(logits, tree, params, generator, draft_probs)
