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

A tree may mix the two kinds: a node whose row of `draft_probs` is all zero was chosen
deterministically and is tested by the target-only rule. Each test, of either kind, emits a
token distributed exactly as the p' it starts from (accepted, or drawn later from the residual
it leaves), whatever the order of the siblings and however the deterministic ones were chosen,
as long as the draft chose them without seeing the target's coins; so a sampled spine with
deterministic side branches is lossless too (`tests/test_tree_verify.py` enumerates it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.engine.sample import SamplingParams, probs_from_logits, sample_from_probs
from splitspec.engine.tree import Tree


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


def verify_greedy(logits: torch.Tensor, tree: Tree) -> VerifyResult:
    argmax = logits.argmax(-1).tolist()
    node, path = -1, []
    while True:
        target = argmax[node + 1]
        nxt = next((c for c in tree.children(node) if tree.token_ids[c] == target), None)
        if nxt is None:
            return VerifyResult(path, target)
        path.append(nxt)
        node = nxt


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
                draft_probs: torch.Tensor | None = None) -> VerifyResult:
    if logits.shape[0] != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} rows of logits (root + nodes), got {logits.shape[0]}")
    if params.greedy:
        return verify_greedy(logits, tree)
    if generator is None:
        raise ValueError("sampling verification needs a generator")
    if draft_probs is not None and draft_probs.shape[0] != len(tree):
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows, expected one per node ({len(tree)})")
    return verify_sampling(logits, tree, params, generator, draft_probs)
