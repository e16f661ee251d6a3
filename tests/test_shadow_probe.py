"""Shadow probes of DFlash (`SpeculativeLoop`, `AutoPolicy.take_shadow`): a proposal made while
the target decodes is scored against the tokens the target commits after it, node by node as a
verify would have tried them, and only once the walk has settled (a miss, or the request's end)."""
from __future__ import annotations

import asyncio

from gateway.generation import Stats
from gateway.policy import SHADOW_FIRST, AutoPolicy, Measurements, Offer
from gateway.spec_loop import Shadow, SpeculativeLoop
from splitspec.v1 import common_pb2, draft_pb2


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
