"""Shadow probes (`SpeculativeLoop`, `AutoPolicy.take_shadow`): a DFlash proposal made while the
target decodes, or an n-gram draft a step did not take, is scored against the tokens the target
commits after it, node by node as a verify would have tried them, and only once the walk has
settled (a miss, or the request's end). For deterministic drafts that is a verify's acceptance in
distribution, at any temperature (the last test checks it against `verify_tree`)."""
from __future__ import annotations

import asyncio

import torch

from gateway.generation import Stats
from gateway.policy import SHADOW_FIRST, AutoPolicy, FixedPolicy, Measurements, Offer
from gateway.spec_loop import NgramShadow, Shadow, SpeculativeLoop
from gateway.speculative import shadow_trials, tree_trials
from splitspec.engine.sample import SamplingParams, probs_from_logits, sample_from_probs
from splitspec.engine.tree import Tree
from splitspec.ngram import NgramIndex
from splitspec.v1 import common_pb2, draft_pb2
from target_service.verify import verify_tree


def loop_with(policy: AutoPolicy, m: Measurements) -> SpeculativeLoop:
    return SpeculativeLoop(None, None, Stats(), policy, measurements=m, draft_call=None, open_draft=None,
                           layer_ids=[], ngram=None, max_width=8, step_timeout_s=1.0)


def proposal(token_ids: list[int], parents: list[int]) -> asyncio.Future:
    """A Propose that has answered (the caller runs inside an event loop)."""
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(draft_pb2.Proposal(tree=common_pb2.TokenTree(token_ids=token_ids, parents=parents)))
    return fut


def in_loop(fn):
    """Run the test body inside an event loop, as the gateway runs the speculative loop."""
    def run():
        async def body():
            fn()
        asyncio.run(body())
    run.__name__ = fn.__name__
    return run


@in_loop
def test_a_shadow_chain_is_scored_once_the_target_misses_it():
    m = Measurements()
    policy = AutoPolicy(m, max_k=7)
    loop = loop_with(policy, m)
    loop.shadow = Shadow(proposal([5, 6, 7], [-1, 0, 1]))
    acc = m.acceptance(("dflash", "greedy"))
    loop._committed([5], None)
    loop._committed([6], None)
    assert loop.shadow is not None and acc.trials[0][0] == 0       # still matching: not settled
    loop._committed([9, 4], None)                                   # the third draft is missed
    assert loop.shadow is None
    assert acc.hits[0][:3] == [1.0, 1.0, 0.0] and acc.trials[0][:3] == [1.0, 1.0, 1.0]


@in_loop
def test_a_shadow_tree_counts_the_siblings_a_verify_would_have_tried():
    m = Measurements()
    policy = AutoPolicy(m, max_k=7)
    loop = loop_with(policy, m)
    # root children 5 (rank 0) and 8 (rank 1); 5 -> 6.
    loop.shadow = Shadow(proposal([5, 8, 6], [-1, -1, 0]))
    loop._committed([8, 2], None)
    acc = m.acceptance(("dflash", "greedy"))
    assert loop.shadow is None
    assert acc.trials[0][0] == 1.0 and acc.hits[0][0] == 0.0          # rank 0 at depth 1: tried, missed
    assert acc.trials[1][0] == 1.0 and acc.hits[1][0] == 1.0          # rank 1: accepted
    assert acc.trials[0][1] == 0.0                                     # the leaf 8 has no children


def test_at_the_end_a_shadow_is_scored_with_the_tokens_there_are():
    m = Measurements()
    policy = AutoPolicy(m, max_k=7)
    policy.run = 16                         # a decode run doubling, as at T=1
    loop = loop_with(policy, m)

    async def body():
        loop.shadow = Shadow(proposal([5, 6, 7], [-1, 0, 1]))
        loop._committed([5], None)
        await loop._end_shadow()
    asyncio.run(body())
    acc = m.acceptance(("dflash", "greedy"))
    assert acc.trials[0][:2] == [1.0, 0.0] and acc.hits[0][0] == 1.0   # depth 2 was never settled
    assert policy.run == 16                 # an accepted shadow draft does not restart the runs


def test_dflash_is_measured_in_the_shadow_before_it_is_verified_on_its_merits():
    m = Measurements()                     # nothing measured: every price looks cheap
    policy = AutoPolicy(m, max_k=7)
    offer = Offer(dflash=7, shadow=True)
    choice = policy.choose(offer, 64)
    assert choice.method == "none" and policy.take_shadow() and not policy.take_shadow()
    for _ in range(int(SHADOW_FIRST) + 1):
        m.acceptance(("dflash", "greedy")).update(7, 6)
    assert policy.choose(offer, 64).method == "dflash"
    # Without a session that can shadow (sampled drafts, say), the prior decides as before.
    fresh = AutoPolicy(Measurements(), max_k=7, bucket="sampled/sample")
    assert not fresh.can_shadow
    assert fresh.choose(Offer(dflash=7), 64).method == "dflash"


def test_waiting_for_a_shadow_propose_never_swallows_the_request_s_cancel():
    m = Measurements()
    loop = loop_with(AutoPolicy(m, max_k=7), m)

    async def body():
        never = asyncio.get_running_loop().create_future()          # a Propose that does not answer
        loop.shadow = Shadow(never)
        waiting = asyncio.ensure_future(loop._end_shadow())
        await asyncio.sleep(0)
        waiting.cancel()                                              # the client went away
        try:
            await waiting
        except asyncio.CancelledError:
            return "cancelled"
        return "swallowed"
    assert asyncio.run(body()) == "cancelled"

    # A Propose cancelled on its own (the loop settling) just ends the probe, unscored.
    async def cancelled_propose():
        task = asyncio.get_running_loop().create_future()
        task.cancel()
        loop.shadow = Shadow(task)
        await loop._end_shadow()
        return loop.shadow
    assert asyncio.run(cancelled_propose()) is None


# -- n-gram drafts not taken -------------------------------------------------------------------

def ngram_loop(policy, m: Measurements, history: list[int]) -> SpeculativeLoop:
    index = NgramIndex()
    index.extend(history)
    return SpeculativeLoop(None, None, Stats(), policy, measurements=m, draft_call=None, open_draft=None,
                           layer_ids=[], ngram=index, max_width=8, step_timeout_s=1.0)


def test_an_ngram_draft_not_taken_is_scored_in_the_shadow_and_costs_no_verify():
    m = Measurements()                       # nothing measured: the optimistic prior alone
    policy = AutoPolicy(m, max_k=7)
    loop = ngram_loop(policy, m, [1, 2, 3, 4, 9, 1, 2])         # "1 2" matched: draft 3 4 9 1 2
    choice, local, match = loop._choose(64)
    assert match == 2 and list(local.token_ids)[:3] == [3, 4, 9]
    # A match length measured on the prior alone is measured in the shadow before it is verified.
    assert choice.method == "none" and isinstance(loop.ngram_shadow, NgramShadow)
    acc = m.acceptance(("ngram", 2, "greedy"))
    run = policy.run
    loop._committed([3], None)
    loop._committed([4], None)
    assert loop.ngram_shadow is not None and acc.trials[0][0] == 0     # still matching
    loop._committed([7], None)                                          # the third draft is missed
    assert loop.ngram_shadow is None
    assert acc.trials[0][:3] == [1.0, 1.0, 1.0] and acc.hits[0][:3] == [1.0, 1.0, 0.0]
    assert policy.run == run and loop.stats.verify_steps == 0  # no verify, and runs are not restarted
    # Once measured (and accepted), that match length's drafts are verified on their merits.
    for _ in range(int(SHADOW_FIRST) + 1):
        acc.update(5, 5)
    assert policy.choose(Offer(ngram=5, ngram_match=2, ngram_shadow=True), 64).method == "ngram"


def test_ngram_probes_are_shadows_and_an_explicit_ngram_is_never_shadowed():
    m = Measurements()
    for _ in range(20):
        m.target_step(4.0, 1, 1)
        m.target_step(30.0, 1, 8, verify=True)           # a verify far too dear for n-gram to win
    policy = AutoPolicy(m, max_k=7)
    for _ in range(int(SHADOW_FIRST) + 1):
        m.acceptance(("ngram", 1, "greedy")).update(3, 0)
    offer = Offer(ngram=3, ngram_match=1, ngram_shadow=True)
    assert all(policy.choose(offer, 1000).method == "none" for _ in range(300))    # no verify-probe
    unshadowed = AutoPolicy(m, max_k=7)
    assert "ngram" in {unshadowed.choose(Offer(ngram=3, ngram_match=1), 1000).method for _ in range(300)}
    fixed = FixedPolicy("ngram")
    assert not fixed.can_shadow_ngram
    loop = ngram_loop(fixed, m, [1, 2, 3, 1, 2])
    choice, _, _ = loop._choose(64)
    assert choice.method == "ngram" and loop.ngram_shadow is None


def test_at_the_end_an_ngram_shadow_is_scored_with_the_tokens_there_are():
    m = Measurements()
    policy = AutoPolicy(m, max_k=7)
    loop = ngram_loop(policy, m, [1, 2, 3, 4, 1, 2])
    loop._choose(64)
    loop._committed([3], None)
    loop._score_ngram_shadow(final=True)
    acc = m.acceptance(("ngram", 2, "greedy"))
    assert loop.ngram_shadow is None
    assert acc.trials[0][:2] == [1.0, 0.0] and acc.hits[0][0] == 1.0


def test_shadow_scoring_of_a_deterministic_tree_is_a_verify_in_distribution():
    """At T > 0, scoring a deterministic tree against the tokens the target samples on its own
    counts, at every (depth, rank), the same acceptance rate as verifying it: a node is accepted
    with p'(x), the chance the target samples x given the siblings before it were not."""
    V = 4

    def logits(ctx):
        g = torch.Generator().manual_seed(hash(ctx) % (2 ** 31))
        return torch.randn(V, generator=g) * 1.2

    params = SamplingParams(temperature=1.0, top_p=0.95)
    ctx = (1, 2)
    tokens, parents = (0, 1, 2, 3, 0, 1), (-1, -1, -1, 0, 3, 3)     # three at the root; 0 -> 3 -> {0, 1}
    tree = Tree(tokens, parents).validate()
    rows = torch.stack([logits(ctx)] + [logits(ctx + tuple(tokens[j] for j in tree.path_to(i)))
                                        for i in range(len(tokens))])
    depth = 3
    g_verify, g_target = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    n = 6000
    verified, shadowed = {}, {}
    for _ in range(n):
        res = verify_tree(rows, tree, params, g_verify)
        for d, r, h in tree_trials(parents, tokens, res.committed(tree)):
            t, a = verified.get((d, r), (0, 0))
            verified[(d, r)] = (t + 1, a + h)
        realized = []
        while len(realized) < depth + 1:
            p = probs_from_logits(logits(ctx + tuple(realized)), params).double()
            realized.append(sample_from_probs(p, g_target))
        for d, r, h in shadow_trials(parents, tokens, realized, final=True):
            t, a = shadowed.get((d, r), (0, 0))
            shadowed[(d, r)] = (t + 1, a + h)
    assert set(verified) == set(shadowed) and len(verified) >= 4
    for key, (t1, a1) in verified.items():
        t2, a2 = shadowed[key]
        p1, p2 = a1 / t1, a2 / t2
        pooled = (a1 + a2) / (t1 + t2)
        se = (pooled * (1 - pooled) * (1 / t1 + 1 / t2)) ** 0.5 or 1e-9
        assert abs(p1 - p2) / se < 4.5, (key, p1, p2, t1, t2)
        assert abs(t1 / n - t2 / n) < 0.05, (key, t1, t2)        # each node is reached as often


def test_an_ngram_shadow_at_every_token_only_while_a_match_length_is_unmeasured():
    m = Measurements()
    policy = AutoPolicy(m, max_k=7)
    loop = ngram_loop(policy, m, [1, 2, 3, 1, 2, 3, 1, 2])
    loop._committed([3], None)                     # no decision, yet a shadow: nothing is measured
    assert loop.ngram_shadow is not None and loop.ngram_shadow.realized == []
    for n in range(1, 5):                          # every match length measured (never accepted)
        for _ in range(40):
            m.acceptance(("ngram", n, "greedy")).update(3, 0)
    for _ in range(20):                            # and a verify dearer than a decode
        m.target_step(4.0, 1, 1)
        m.target_step(8.0, 1, 8, verify=True)
    loop.ngram_shadow = None
    loop._committed([1], None)                     # a match, but a shadow per token no longer pays
    assert loop.ngram_shadow is None
    choice, _, _ = loop._choose(64)                # at a decision, the draft not taken is still scored
    assert choice.method == "none" and loop.ngram_shadow is not None
