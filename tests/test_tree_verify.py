"""Tree verification at T > 0 against the exact output distribution on a tiny vocabulary.

The "target" is a fixed random function from a context to logits over 4 tokens, so the exact
distribution of the first two generated tokens is a 16-cell table computed directly. Each
sample runs speculative steps on trees until two tokens are committed; the trees branch at the
root and below, and (in sampled mode) their spine is drawn from a draft q with the other nodes
chosen deterministically, the mix the tree drafters produce. A G-test compares the counts
with the exact table."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2

from splitspec.engine.sample import SamplingParams, probs_from_logits
from splitspec.engine.tree import Tree
from target_service.verify import verify_tree

V = 4


def target_logits(ctx: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(ctx) % (2 ** 31))
    return torch.randn(V, generator=g) * 1.5


def draft_q(ctx: tuple[int, ...]) -> torch.Tensor:
    """A draft distribution unlike the target's (so rejections happen)."""
    g = torch.Generator().manual_seed((hash(ctx) * 7 + 3) % (2 ** 31))
    return torch.softmax(torch.randn(V, generator=g) * 2.0, -1)


def build_tree(ctx: tuple[int, ...], mode: str, g: torch.Generator):
    """Root: the spine's first token + two deterministic siblings; the spine goes two deep with
    one deterministic sibling under its first node, and a side node has a child of its own."""
    def spine_token(c):
        if mode == "sampled":
            return int(torch.multinomial(draft_q(c), 1, generator=g))
        return int(draft_q(c).argmax())

    def others(c, exclude, n):
        order = torch.argsort(draft_q(c), descending=True).tolist()
        return [t for t in order if t not in exclude][:n]

    s1 = spine_token(ctx)
    s2 = spine_token(ctx + (s1,))
    a, b = others(ctx, {s1}, 2)
    c = others(ctx + (s1,), {s2}, 1)[0]
    d = others(ctx + (a,), set(), 1)[0]
    tokens = [s1, s2, a, b, c, d]
    parents = [-1, 0, -1, -1, 0, 2]
    tree = Tree(tuple(tokens), tuple(parents)).validate()
    probs = None
    if mode == "sampled":
        probs = torch.zeros(len(tokens), V)
        probs[0], probs[1] = draft_q(ctx), draft_q(ctx + (s1,))       # the spine's rows; the rest stay zero
    return tree, probs


def speculative_first_two(prompt: tuple[int, ...], params: SamplingParams, mode: str,
                          g_draft: torch.Generator, g_verify: torch.Generator) -> tuple[int, int]:
    out: list[int] = []
    while len(out) < 2:
        ctx = prompt + tuple(out)
        tree, probs = build_tree(ctx, mode, g_draft)
        rows = [target_logits(ctx)] + [target_logits(ctx + tuple(tree.token_ids[j] for j in tree.path_to(i)))
                                       for i in range(len(tree))]
        res = verify_tree(torch.stack(rows), tree, params, g_verify, probs)
        out.extend(res.committed(tree))
    return out[0], out[1]


@pytest.mark.parametrize("mode", ["deterministic", "sampled"])
@pytest.mark.parametrize("params", [SamplingParams(coupled=False, temperature=1.0), SamplingParams(coupled=False, temperature=0.7, top_p=0.9)],
                         ids=["T1", "T0.7-top_p0.9"])
def test_tree_verification_samples_the_target_distribution(mode, params):
    prompt = (1, 2)
    exact = torch.zeros(V, V, dtype=torch.float64)
    p1 = probs_from_logits(target_logits(prompt), params).double()
    for t1 in range(V):
        exact[t1] = p1[t1] * probs_from_logits(target_logits(prompt + (t1,)), params).double()
    n = 4000
    g_draft, g_verify = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(n):
        t1, t2 = speculative_first_two(prompt, params, mode, g_draft, g_verify)
        counts[t1, t2] += 1
    assert counts[exact == 0].sum() == 0, "a token the target gives no mass was emitted"
    mask = exact > 0
    expected = exact[mask] * n
    observed = counts[mask]
    g_stat = 2 * float(sum(o * math.log(o / e) for o, e in zip(observed.tolist(), expected.tolist()) if o > 0))
    p_value = chi2.sf(g_stat, int(mask.sum()) - 1)
    assert p_value > 1e-3, (p_value, counts, exact * n)


def test_a_sampled_spine_is_tried_by_its_q_and_the_side_nodes_by_p():
    """A sampled spine node whose q equals p is always accepted (min(1, p/q) = 1); a
    deterministic node with p = 0 never is, whatever the coins."""
    logits = torch.log(torch.tensor([[0.5, 0.5, 1e-30, 1e-30], [0.25, 0.25, 0.25, 0.25],
                                     [0.25, 0.25, 0.25, 0.25]]))
    tree = Tree((2, 0), (-1, -1))                 # node 0: deterministic, p = 0; node 1: sampled, q = p
    probs = torch.zeros(2, V)
    probs[1] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        res = verify_tree(logits, tree, SamplingParams(coupled=False, temperature=1.0), g, probs)
        assert res.accepted == [1]
