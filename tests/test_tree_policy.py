"""How the gateway reasons about trees: what a verify tried (by depth and sibling rank), the
expected committed tokens of every prefix of a tree, the cut `auto` makes (wide trees price
themselves out when the target's forwards are shared), trimming, and the draft side's limits."""
from __future__ import annotations

import random

import pytest

from draft_service.proposer import ProposerError, TreeShape
from gateway.cost_model import expected_tokens, expected_tree_tokens
from gateway.policy import AutoPolicy, Measurements
from gateway.speculative import tree_trials, trim_tree
from splitspec.v1 import common_pb2

#          root
#        /   |   \
#      0:a  3:b  5:c
#      / \    |
#   1:d  4:e 6:f
#    |
#   2:g
PARENTS = [-1, 0, 1, -1, 0, -1, 3]
TOKENS = [10, 11, 12, 20, 21, 30, 31]


def test_tree_trials_walk_the_accepted_path_and_count_tried_siblings():
    # b accepted at depth 1 after a was rejected; then f accepted; the bonus matches no child.
    assert tree_trials(PARENTS, TOKENS, [20, 31, 99]) == [(0, 0, False), (0, 1, True), (1, 0, True)]
    # a, then e (after d was rejected), then nothing below e.
    assert tree_trials(PARENTS, TOKENS, [10, 21, 7]) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    # nothing accepted: every child of the root was tried.
    assert tree_trials(PARENTS, TOKENS, [5]) == [(0, 0, False), (0, 1, False), (0, 2, False)]


def recursive_expectation(parents, n, rate) -> float:
    """E[committed] for the first n nodes, written as the walk: at a node, children are tried
    in order; child i is reached when all before it failed; its subtree adds its own E."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents[:n]):
        kids.setdefault(p, []).append(i)
    depth = {-1: 0}
    for i, p in enumerate(parents[:n]):
        depth[i] = depth[p] + 1

    def e(node) -> float:
        total, none_yet = 0.0, 1.0
        for rank, c in enumerate(kids.get(node, ())):
            a = rate(rank, depth[c] - 1)
            total += none_yet * a * (1 + e(c))
            none_yet *= 1 - a
        return total
    return 1.0 + e(-1)


def test_expected_tree_tokens_matches_the_walk_on_every_prefix():
    rng = random.Random(0)
    table = [[rng.random() for _ in range(4)] for _ in range(3)]

    def rate(rank, depth):
        row = table[min(rank, len(table) - 1)]
        return row[min(depth, len(row) - 1)]
    got = expected_tree_tokens(PARENTS, table)
    for n in range(len(PARENTS) + 1):
        assert got[n] == pytest.approx(recursive_expectation(PARENTS, n, rate))


def test_a_chain_is_the_rank_zero_case():
    rates = [0.9, 0.7, 0.5, 0.3]
    chain = list(range(-1, 5))
    got = expected_tree_tokens(chain, [rates, [0.0] * 4])
    assert got == pytest.approx([expected_tokens(rates, k) for k in range(7)])


def measured(rows: float, token_ms: float) -> Measurements:
    """A gateway whose target forwards cost 10 ms + token_ms per query token, with `rows`
    sessions' rows in each."""
    m = Measurements()
    for _ in range(200):
        for width in (1, 8, 16, 32):
            m.target_step(10.0 + rows * token_ms * width, int(rows), int(rows * width), verify=width > 1)
    m.proposal("dflash", 5.0)
    return m


def wide_tree() -> list[int]:
    """A 7-deep spine with three siblings under each of its nodes (28 nodes)."""
    parents = list(range(-1, 6))
    parents += [p for p in range(-1, 6) for _ in range(3)]
    return parents


def test_auto_cuts_trees_smaller_when_forwards_are_shared():
    tree = wide_tree()
    cuts = {}
    for rows in (1, 16):
        policy = AutoPolicy(measured(rows, 0.5), max_k=len(tree))
        key = policy._key("dflash", 0)
        for _ in range(50):          # first drafts accepted often, second siblings sometimes
            policy._acceptance(key).update_tried([(0, 0, False), (0, 1, True), (1, 0, True), (2, 0, False)])
        cuts[rows] = policy.cut("dflash", tree, len(tree))
    assert 1 <= cuts[16] < cuts[1] <= len(tree)
    # With one session a width-16 verify costs 18 ms against a decode's 10.5: siblings pay.
    assert cuts[1] > 7


def test_trim_keeps_a_prefix_and_drops_nodes_past_the_depth():
    tree = common_pb2.TokenTree(token_ids=TOKENS, parents=PARENTS)
    probs = common_pb2.Tensor(data=bytes(range(28)), shape=[7, 1])         # 4 bytes a row: one float32
    cut, cut_probs = trim_tree(tree, probs, 5, max_depth=1)
    assert list(cut.token_ids) == [10, 20] and list(cut.parents) == [-1, -1]
    assert cut_probs.data == probs.data[0:4] + probs.data[12:16] and list(cut_probs.shape) == [2, 1]


@pytest.mark.parametrize("kw,needle", [
    (dict(num_draft_tokens=8, num_steps=None, topk=5), "speculative.topk = 5"),
    (dict(num_draft_tokens=8, num_steps=9, topk=2), "speculative.num_steps = 9"),
    (dict(num_draft_tokens=66, num_steps=None, topk=2), "verify cap"),
    (dict(num_draft_tokens=10, num_steps=None, topk=1), "for a chain"),
])
def test_tree_shapes_past_the_drafters_limits_are_refused_by_name(kw, needle):
    with pytest.raises(ProposerError, match=needle.replace("=", "=").replace("(", r"\(")):
        TreeShape.resolve(max_depth=7, max_topk=4, what="this draft", **kw)
    assert TreeShape.resolve(num_draft_tokens=16, num_steps=None, topk=4, max_depth=7, max_topk=4,
                             what="d") == TreeShape(15, 7, 4)


def test_plan_for_trees_honours_and_refuses_by_the_drafters_limits():
    from gateway.request import RequestError
    from test_policy import plan
    from splitspec.v1 import draft_pb2
    tree_draft = draft_pb2.DraftInfo(model_id="d2", method="dflash", block_size=8, target_layer_ids=[1, 3],
                                     max_topk=4, max_draft_nodes=64)
    p = plan("dflash", draft=tree_draft, topk=4, num_draft_tokens=16)
    assert (p.speculative.topk, p.speculative.num_draft_tokens, p.speculative.num_steps) == (4, 16, 7)
    assert p.max_k == 15 and not p.local_ngram
    # auto: the numbers are upper bounds (topk cut to the draft's 4, nodes to the verify cap);
    # the gateway's own n-gram index drafts tries too.
    p = plan("auto", draft=tree_draft, topk=9, num_draft_tokens=100)
    assert p.speculative.topk == 4 and p.speculative.num_draft_tokens == 65 and p.ngram_tree == (64, 7, 4)
    # An explicit ngram goes to the draft service's n-gram; without one, to the gateway's own.
    assert plan("ngram", draft=tree_draft, topk=3, num_draft_tokens=9).speculative.method == "ngram"
    assert plan("ngram", draft=None, has_draft=False, topk=3, num_draft_tokens=9).ngram_tree == (8, 7, 3)
    for kw, words in ((dict(topk=5), "offers per node (4)"), (dict(topk=2, num_draft_tokens=70), "verify cap"),
                      (dict(topk=2, num_steps=8), "block size (8) minus one")):
        with pytest.raises(RequestError) as err:
            plan("dflash", draft=tree_draft, **kw)
        assert words in str(err.value)
