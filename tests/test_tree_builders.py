"""Each tree builder against a brute-force enumeration on small hand-made distributions: the
tree it returns is the best-scoring ancestor-closed node set under the budget that contains
the spine (the chain the drafter proposes alone), within the depth and topk limits, and every
prefix of its node order is a tree too (the gateway cuts proposals to a prefix)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from draft_service.dflash2_tree import dflash2_tree
from draft_service.dflash_tree import dflash_tree
from splitspec.engine.tree import Tree
from splitspec.ngram import NgramIndex, trie_tree


def candidate_nodes(children_of, root_token: int, depth: int) -> dict[tuple, float]:
    """Every node of the candidate tree as path -> path log-probability, by plain recursion:
    children_of(path_tokens, d) -> [(token, log_prob)] of the node at the end of `path`."""
    out: dict[tuple, float] = {}

    def visit(path: tuple, score: float) -> None:
        if len(path) >= depth:
            return
        for tok, lp in children_of((root_token, *path), len(path) + 1):
            out[path + (tok,)] = score + lp
            visit(path + (tok,), score + lp)
    visit((), 0.0)
    return out


def best_value(nodes: dict[tuple, float], spine: tuple, budget: int) -> float:
    """max over ancestor-closed sets S with spine ⊆ S, |S| <= budget of sum exp(score)."""
    spine = spine[:budget]
    spine_paths = {spine[:d] for d in range(1, len(spine) + 1)}
    others = [p for p in nodes if p not in spine_paths]
    base = sum(math.exp(nodes[p]) for p in spine_paths)
    best = base
    room = budget - len(spine_paths)
    for r in range(1, room + 1):
        for combo in itertools.combinations(others, r):
            chosen = spine_paths | set(combo)
            if all(p[:-1] in chosen or len(p) == 1 for p in combo):
                best = max(best, base + sum(math.exp(nodes[p]) for p in combo))
    return best


def paths(token_ids, parents) -> list[tuple]:
    out: list[tuple] = []
    for tok, p in zip(token_ids, parents):
        out.append((out[p] if p >= 0 else ()) + (tok,))
    return out


def check_shape(token_ids, parents, *, budget: int, depth: int, topk: int, spine: list[int]) -> list[tuple]:
    tree = Tree(tuple(token_ids), tuple(parents)).validate()
    assert len(tree) <= budget
    assert max(tree.depths(), default=0) <= depth
    for node in [-1, *range(len(tree))]:
        kids = tree.children(node)
        assert len(kids) <= topk
        assert len({tree.token_ids[c] for c in kids}) == len(kids), "siblings must hold distinct tokens"
    want = spine[:min(budget, depth)]
    assert list(token_ids[:len(want)]) == want and list(parents[:len(want)]) == list(range(-1, len(want) - 1))
    return paths(token_ids, parents)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 8), topk=st.integers(1, 3), laid=st.booleans())
def test_dflash_tree_is_the_best_node_set_with_the_greedy_chain(seed, budget, topk, laid):
    """laid: the greedy walk laid first as the spine (all of it), or not (greedy drafts, as the
    proposer builds them): then the best set of all, which holds the greedy walk as deep as any
    node goes, since it is the best node of every depth."""
    depth, vocab = 3, 6
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2
    logp = torch.log_softmax(logits, -1)
    greedy = logits.argmax(-1).tolist()
    spine = greedy if laid else []
    built = dflash_tree(logits, root_token=0, spine=spine, budget=budget, max_depth=depth, topk=topk)
    got = check_shape(built.token_ids, built.parents, budget=budget, depth=depth, topk=topk, spine=spine)
    assert all(tuple(greedy[:len(p)]) in got for p in got)

    def children_of(path, d):          # per-position marginals: the parent does not matter
        lp, ids = torch.topk(logp[d - 1], topk)
        return list(zip(ids.tolist(), lp.tolist()))
    nodes = candidate_nodes(children_of, 0, depth)
    assert all(p in nodes for p in got)
    value = sum(math.exp(nodes[p]) for p in got)
    assert value == pytest.approx(best_value(nodes, tuple(spine), budget), rel=1e-9)
    for n in range(1, len(got) + 1):                  # every prefix is a tree
        Tree(tuple(built.token_ids[:n]), tuple(built.parents[:n])).validate()
    for i, p in enumerate(built.parents):
        assert built.scores[i] == pytest.approx(nodes[got[i]], abs=1e-9)


class TinySelector(torch.nn.Module):
    """The parts of a DFlash2 candidate selector the tree builder reads."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.top_k = top_k
        self.predecessor_codebook = torch.nn.Parameter(torch.randn(vocab, rank, generator=g))
        self.successor_codebook = torch.nn.Parameter(torch.randn(vocab, rank, generator=g))
        self.hidden_projection = torch.nn.Linear(hidden, rank, bias=False)
        with torch.no_grad():
            self.hidden_projection.weight.copy_(torch.randn(rank, hidden, generator=g))

    def candidates(self, unary):
        scores, ids = torch.topk(unary.float(), self.top_k, dim=-1)
        return ids, scores


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 7), topk=st.integers(1, 3))
def test_dflash2_tree_is_the_best_node_set_of_the_selector_lattice(seed, budget, topk):
    depth, vocab, hidden, rank, K = 3, 10, 8, 4, 4
    sel = TinySelector(vocab, hidden, rank, K, seed)
    g = torch.Generator().manual_seed(seed + 1)
    h, unary = torch.randn(depth, hidden, generator=g), torch.randn(depth, vocab, generator=g) * 2

    def cond(parent: int, d: int) -> dict[int, float]:
        """log softmax over the K unary candidates of S_d(parent, b), written out directly."""
        cand = torch.topk(unary[d - 1], K).indices.tolist()
        with torch.no_grad():
            gate = sel.predecessor_codebook[parent] * (sel.hidden_projection.weight @ h[d - 1])
            s = torch.tensor([float(unary[d - 1, b] + gate @ sel.successor_codebook[b]) for b in cand])
        return dict(zip(cand, torch.log_softmax(s, -1).tolist()))

    root, greedy, prev = 3, [], 3
    for d in range(1, depth + 1):
        c = cond(prev, d)
        prev = max(c, key=c.get)
        greedy.append(prev)
    with torch.no_grad():
        built = dflash2_tree(sel, h, unary, root_token=root, spine=greedy, budget=budget, max_depth=depth, topk=topk)
    got = check_shape(built.token_ids, built.parents, budget=budget, depth=depth, topk=topk, spine=greedy)

    def children_of(path, d):
        c = cond(path[-1], d)
        return sorted(c.items(), key=lambda kv: -kv[1])[:topk]
    nodes = candidate_nodes(children_of, root, depth)
    assert all(p in nodes for p in got)
    value = sum(math.exp(nodes[p]) for p in got)
    assert value == pytest.approx(best_value(nodes, tuple(greedy), budget), rel=1e-6)


def test_a_sampled_spine_outside_the_top_k_is_kept_and_counts_as_a_child():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0], [5.0, 4.0, 3.0, 0.0]])
    built = dflash_tree(logits, root_token=0, spine=[3, 3], budget=6, max_depth=2, topk=2)
    tree = Tree(tuple(built.token_ids), tuple(built.parents))
    assert built.token_ids[:2] == [3, 3] and built.spine == 2
    assert [tree.token_ids[c] for c in tree.children(-1)] == [3, 0]     # the spine + the best other one


@settings(max_examples=25, deadline=None)
@given(history=st.lists(st.integers(0, 3), min_size=4, max_size=24), budget=st.integers(1, 7),
       topk=st.integers(1, 3))
@example(history=[1, 1, 0, 1, 1, 1], budget=3, topk=1)
def test_ngram_trie_is_the_best_node_set_by_continuation_count(history, budget, topk):
    """Best first by count is the best set when `topk` does not bind (a child never counts more
    than its parent). Where it binds, a heavier child can hide a deeper branch (history
    [1, 1, 0, 1, 1, 1], budget 3, topk 1: the spine [1], then (1, 1) rather than (1, 0) and
    (1, 0, 1)); there the tree must still be valid and pick, node by node, the most counted
    child a parent may still take."""
    depth = 3
    index = NgramIndex(1, 2)
    index.extend(history)
    conts, n = index.continuations(depth, 4 * topk)
    chain, n_chain = index.match(depth)
    assert n == n_chain and (conts[0] if conts else []) == chain
    ids, parents = trie_tree(conts, budget=budget, max_depth=depth, topk=topk)
    got = check_shape(ids, parents, budget=budget, depth=depth, topk=topk, spine=chain)
    # Brute force: a node's weight is how many continuations pass through it.
    count: dict[tuple, int] = {}
    for c in conts:
        for d in range(1, min(len(c), depth) + 1):
            count[tuple(c[:d])] = count.get(tuple(c[:d]), 0) + 1
    assert all(p in count for p in got)
    spine_paths = {tuple(chain[:d]) for d in range(1, min(len(chain), budget, depth) + 1)}
    others = [p for p in count if p not in spine_paths]
    best = 0
    for r in range(0, budget - len(spine_paths) + 1):
        for combo in itertools.combinations(others, r):
            chosen = spine_paths | set(combo)
            kids: dict[tuple, int] = {}
            for p in chosen:
                kids[p[:-1]] = kids.get(p[:-1], 0) + 1
            if all(len(p) == 1 or p[:-1] in chosen for p in chosen) and max(kids.values(), default=0) <= topk:
                best = max(best, sum(count[p] for p in combo))
    value = sum(count[p] for p in got if p not in spine_paths)
    widest = max(sum(1 for q in count if q[:-1] == p) for p in [()] + list(count))
    if widest <= topk:
        assert value == best
    else:
        assert value <= best
        chosen = set(spine_paths)
        for p in got:
            if p in spine_paths:
                continue
            # Nothing still open when p was taken counted more than p.
            open_ = [q for q in count if q not in chosen and (len(q) == 1 or q[:-1] in chosen)
                     and sum(1 for c in chosen if c[:-1] == q[:-1]) < topk]
            assert count[p] == max(count[q] for q in open_)
            chosen.add(p)
