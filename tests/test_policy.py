"""The adaptive policy's parts as plain functions: the cost model's arithmetic against hand
computations, the forward-time fit, the acceptance estimates, exploration, the gateway's n-gram
index against a brute-force scan, and the request plan's refusals (parameters no drafter can
honour are refused, never silently changed)."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import SpeculativeConfig
from gateway.cost_model import Costs, choose, expected_tokens
from gateway.plan import plan_request
from gateway.policy import PROBE_EVERY, Acceptance, AutoPolicy, FixedPolicy, ForwardModel, Measurements, Offer
from gateway.request import RequestError
from splitspec.ngram import NgramIndex
from splitspec.v1 import common_pb2, draft_pb2, target_pb2


def costs(rows=1.0, token_ms=3.0, row_ms=2.0, dflash_ms=5.0, **kw):
    return Costs(fixed_ms=10.0, row_ms=row_ms, token_ms=token_ms, rows=rows, verify_overhead_ms=0.0,
                 decode_overhead_ms=0.0, draft_ms={"dflash": dflash_ms, "ngram": 0.0}, **kw)


def test_expected_tokens_by_hand():
    assert expected_tokens([0.8, 0.5], 0) == 1.0
    assert expected_tokens([0.8, 0.5], 2) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert expected_tokens([0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)   # the last rate repeats
    assert expected_tokens([], 4) == 1.0


def test_choose_picks_the_k_of_a_hand_computation():
    # a = 10, b = 0, c = 3 ms, one row, a DFlash proposal 5 ms, acceptance 0.8 at every position:
    #   none: 1 / (10 + 3)                     = 0.0769 tokens/ms
    #   k=1: 1.8    / (5 + 10 + 3*2) = 1.8/21  = 0.0857
    #   k=2: 2.44   / 24                      = 0.1017
    #   k=3: 2.952  / 27                      = 0.1093
    #   k=4: 3.3616 / 30                      = 0.1121   <- best
    #   k=5: 3.6893 / 33                      = 0.1118
    c = choose({"dflash": [0.8] * 8}, {"dflash": 7}, costs(row_ms=0.0))
    assert (c.method, c.k) == ("dflash", 4)
    assert c.tokens == pytest.approx(3.3616) and c.ms == pytest.approx(30.0)
    # The request's bound wins over the optimum.
    assert choose({"dflash": [0.8] * 8}, {"dflash": 2}, costs(row_ms=0.0)).k == 2


def test_heavy_load_drafts_less_then_not_at_all():
    # acceptance 0.5, b = 2, c = 3. One row:  none 1/15 = 0.0667; k=1 1.5/23 = 0.0652;
    # k=2 1.75/26 = 0.0673 (best); k=3 1.875/29 = 0.0647.
    accept = {"dflash": [0.5] * 8}
    assert (choose(accept, {"dflash": 7}, costs(rows=1)).method, choose(accept, {"dflash": 7}, costs(rows=1)).k) \
        == ("dflash", 2)
    # Sixteen rows, everyone doing the same: none 1/(10 + 16*5) = 0.0111; k=1 1.5/(15 + 16*8) = 0.0105.
    busy = choose(accept, {"dflash": 7}, costs(rows=16, sessions=16))
    assert (busy.method, busy.k) == ("none", 0)


def test_decode_is_priced_with_every_session_on_the_target():
    # Drafting sessions meet the target four at a time, but if they all decoded, every forward
    # would hold all sixteen: none 1/(10 + 16*5) = 0.0111, not 1/(10 + 4*5) = 0.0333.
    c = costs(rows=4, sessions=16)
    assert c.step_ms("none", 0) == pytest.approx(90.0)
    # A verify of width 3 (k = 2) is charged its own forward, 10 + 16*5 + 3*2 = 96, plus the
    # 3*2 ms its extra width adds to each of the 15 other sessions' forward: 5 + 96 + 90 = 191,
    # what sixteen sessions verifying width 3 would cost each (5 + 10 + 16 * (2 + 3*3)).
    assert c.step_ms("dflash", 2) == pytest.approx(5 + 96 + 15 * 3 * 2) == pytest.approx(5 + 10 + 16 * (2 + 3 * 3))
    # The sessions met in recent forwards count where they are more (a burst the servicer has
    # not counted yet).
    assert costs(rows=20, sessions=16).step_ms("dflash", 2) == pytest.approx(5 + 10 + 20 * 11)
    # The Decode stream a drafted step breaks is paid by the step (rejoin_ms), not by decoding.
    r = costs(rows=1, rejoin_ms=7.0)
    assert r.step_ms("dflash", 2) - costs(rows=1).step_ms("dflash", 2) == pytest.approx(7.0)
    assert r.step_ms("none", 0) == costs(rows=1).step_ms("none", 0)


def test_free_ngram_match_beats_a_paid_dflash_proposal_and_ties_go_to_the_cheaper():
    c = choose({"dflash": [0.7] * 8, "ngram": [0.7] * 8}, {"dflash": 7, "ngram": 7}, costs())
    assert c.method == "ngram"
    # Equal rates: fewer drafted tokens (the decode step comes first of all).
    flat = Costs(fixed_ms=1.0, row_ms=0.0, token_ms=0.0, rows=1, verify_overhead_ms=0.0, decode_overhead_ms=0.0)
    assert choose({"ngram": [0.0] * 8}, {"ngram": 7}, flat).method == "none"


def test_forward_model_recovers_its_coefficients():
    fm = ForwardModel(decay=1.0, ridge=1e-6)
    for rows in (1, 2, 4, 8, 16):
        for width in (1, 4, 8):
            verify = width > 1
            fm.add(rows, rows * width, 6.0 + 1.5 * rows + 0.25 * rows * width + 3.0 * rows * verify, verify)
    assert fm.coef() == pytest.approx((6.0, 1.5, 0.25, 3.0), rel=1e-3)


def test_forward_model_with_one_session_predicts_what_it_saw():
    # One session: a decode step 8 ms, a verify of any width about 12 ms (this CPU's shape:
    # a verify row costs a step up, then little per token).
    fm = ForwardModel()
    for width in (1, 8, 3, 8, 1, 5, 2, 1):
        fm.add(1, width, 8.0 if width == 1 else 11.5 + 0.07 * width, verify=width > 1)
    a, b, c, v = fm.coef()
    assert min(a, b, c, v) >= 0.0
    assert a + b + c == pytest.approx(8.0, rel=0.05)
    assert a + b + 2 * c + v == pytest.approx(11.64, rel=0.05)
    assert a + b + 8 * c + v == pytest.approx(12.06, rel=0.05)


def test_acceptance_counts_the_positions_that_were_looked_at():
    acc = Acceptance(4, prior=[0.5] * 4, prior_weight=0.0)
    acc.update(3, 1)           # draft 1 accepted, draft 2 rejected, draft 3 never looked at
    assert acc.trials[0][:3] == pytest.approx([1.0, 1.0, 0.0])      # rank 0: the chain
    assert acc.hits[0][:3] == pytest.approx([1.0, 0.0, 0.0])
    acc = Acceptance(4, prior=[0.5] * 4, prior_weight=2.0)
    assert acc.rates() == [0.5] * 4
    acc.update(2, 2)
    assert acc.rates()[0] == pytest.approx((1 + 1.0) / 3) and acc.rates()[2] == 0.5


def measured(propose_ms: float) -> Measurements:
    """One session's measurements: decode 10 ms, a width-8 verify 12 ms, a Propose propose_ms."""
    m = Measurements()
    for _ in range(20):
        m.target_step(10.0, 1, 1)
        m.target_step(12.0, 1, 8, verify=True)
    m.proposal("dflash", propose_ms)
    return m


def test_auto_policy_probes_a_drafter_it_stopped_choosing():
    m = measured(8.0)
    policy = AutoPolicy(m, max_k=7)
    for _ in range(5):
        policy.observe(policy.choose(Offer(dflash=7), 100), 0)     # dflash never accepted
    chosen = [policy.choose(Offer(dflash=7), 100) for _ in range(2 * PROBE_EVERY)]
    for c in chosen:
        policy.observe(c, 0)
    methods = [c.method for c in chosen]
    assert methods.count("none") > PROBE_EVERY and "dflash" in methods


def test_requests_skip_a_dflash_session_where_dflash_stopped_winning_and_reopen_to_remeasure():
    from gateway.policy import DRAFT_WORTH, MAX_REOPEN_GAP, REOPEN_EVERY, WORTH_AFTER, sampling_bucket
    m = measured(8.0)
    sampled, greedy = sampling_bucket(1.0, "greedy"), sampling_bucket(0.0, "greedy")
    assert sampled != greedy == "greedy"
    first = AutoPolicy(m, max_k=7, bucket=sampled)
    assert first.wants_draft()                                    # nothing measured: try it
    assert not AutoPolicy(m, max_k=7, bucket=greedy).wants_draft()  # one explorer at a time
    m.opened_draft(5.0)                                           # its Open measured (the Propose was)
    # DFlash's drafts never accepted, until its share of the bucket's decisions is below DRAFT_WORTH.
    while m.worth_seen.get(sampled, 0) < WORTH_AFTER or m.dflash_worth[sampled].get() >= DRAFT_WORTH:
        first.observe(first.choose(Offer(dflash=7), 1000), 0)
    # One in REOPEN_EVERY re-measures, then one in 2, 4, 8 x REOPEN_EVERY (at most MAX_REOPEN_GAP)
    # while those keep confirming the skip: each costs an Open and features on the wire.
    opens = [AutoPolicy(m, max_k=7, bucket=sampled).wants_draft() for _ in range(200)]
    gaps = [REOPEN_EVERY * 2 ** i for i in range(4)]
    at = [sum(gaps[:i + 1]) - 1 for i in range(4)]
    assert [i for i, o in enumerate(opens) if o][:5] == [*at, at[-1] + MAX_REOPEN_GAP]
    assert AutoPolicy(m, max_k=7, bucket=greedy).wants_draft()     # other buckets are not judged by it
    assert FixedPolicy("dflash").wants_draft()                     # an explicit method always drafts
    # the sampled bucket's acceptance estimate is its own: greedy requests still start optimistic
    assert m.acceptance(("dflash", sampled)).rates()[0] < m.acceptance(("dflash", greedy)).rates()[0]


def test_auto_policy_decode_runs_grow_while_decoding_and_reset_after_a_draft():
    # Two tokens at least: a run is extended (or ended) at its second-to-last token, and a
    # one-token run would end before anything could be decided, its session sitting out a forward.
    policy = AutoPolicy(Measurements(), max_k=7)
    assert [policy.decode_run(1000) for _ in range(7)] == [2, 4, 8, 16, 32, 64, 64]
    assert policy.decode_run(3) == 3 and policy.decode_run(1) == 1
    from gateway.cost_model import Choice
    policy.observe(Choice("dflash", 3, 0, 0), 1)
    assert policy.decode_run(100) == 2


def test_fixed_policy_runs_its_method_and_never_overshoots():
    p = FixedPolicy("dflash")
    assert (p.choose(Offer(dflash=7), 100).k, p.choose(Offer(dflash=7), 3).k) == (7, 2)
    assert p.choose(Offer(dflash=0), 100).method == "none" and p.decode_run(50) == 50   # the draft is gone
    q = FixedPolicy("ngram")
    assert q.choose(Offer(ngram=0), 100).method == "none" and q.decode_run(50) == 1     # no match this step


def brute_force(tokens, k, min_n, max_n):
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k], n
    return [], 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.lists(st.integers(1, 20), max_size=4),
       st.integers(1, 8), st.integers(1, 3), st.integers(0, 3))
def test_ngram_index_equals_a_scan_of_the_history(tokens, cuts, k, min_n, extra):
    index = NgramIndex(min_n, min_n + extra)
    pos = 0
    for cut in cuts + [len(tokens)]:        # tokens arrive in several pieces
        index.extend(tokens[pos:pos + cut])
        pos = min(len(tokens), pos + cut)
        assert index.match(k) == brute_force(index.tokens, k, min_n, min_n + extra)
    index.extend(tokens[pos:])
    assert index.match(k) == brute_force(tokens, k, min_n, min_n + extra)


# -- the plan ------------------------------------------------------------------------------------
TARGET = target_pb2.TargetInfo(max_num_batched_tokens=512, tokenizer_hash="h")
DFLASH = draft_pb2.DraftInfo(model_id="d", method="dflash", block_size=8, target_layer_ids=[1, 3])
NGRAM_ONLY = draft_pb2.DraftInfo(model_id="n", method="ngram")


def plan(method="dflash", draft=DFLASH, has_draft=True, **raw):
    msg = common_pb2.SpeculativeParams(method=method, **raw)
    spec = SpeculativeConfig(method=method, num_steps=raw.get("num_steps", 7), eagle_topk=raw.get("topk", 1),
                             num_draft_tokens=raw.get("num_draft_tokens", 8))
    return plan_request(spec, msg, has_draft=has_draft, draft=draft, target=TARGET)


@pytest.mark.parametrize("kw, words", [
    (dict(topk=3), ["speculative.topk = 3", "chains only"]),
    (dict(num_draft_tokens=1000), ["speculative.num_draft_tokens = 1000", "block size (8)"]),
    (dict(num_steps=12), ["speculative.num_steps = 12", "block size"]),
    (dict(num_steps=3, num_draft_tokens=8), ["num_draft_tokens = 8", "num_steps = 3"]),
    (dict(method="dflash", draft=NGRAM_ONLY), ["serves ngram only"]),
    (dict(method="dflash", draft=None, has_draft=False), ["no draft service"]),
    (dict(method="ngram", draft=NGRAM_ONLY, num_draft_tokens=100), ["n-gram limit (64)"]),
])
def test_plan_refuses_what_no_drafter_can_honour(kw, words):
    with pytest.raises(RequestError) as err:
        plan(**kw)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for w in words:
        assert w in str(err.value)


def test_plan_with_auto_takes_the_numbers_as_upper_bounds():
    p = plan("auto", topk=3, num_draft_tokens=1000)
    assert (p.method, p.max_k, p.local_ngram) == ("auto", 7, True)
    assert p.speculative.method == "dflash" and p.speculative.num_draft_tokens == 8 and p.layer_ids == [1, 3]
    assert plan("auto", num_draft_tokens=4).max_k == 3
    # An n-gram-only draft service: auto drafts with the gateway's own index, no draft session.
    p = plan("auto", draft=NGRAM_ONLY)
    assert p.speculative is None and p.local_ngram and p.max_k == 7


def test_plan_with_auto_hands_n_gram_chains_to_a_target_that_looks_ahead():
    looking = target_pb2.TargetInfo()
    looking.CopyFrom(TARGET)
    looking.max_lookahead = 15
    msg = common_pb2.SpeculativeParams(method="auto")
    p = plan_request(SpeculativeConfig(method="auto"), msg, has_draft=True, draft=DFLASH, target=looking)
    assert (p.lookahead, p.local_ngram, p.max_k) == (7, False, 7)     # the chain width, not the target's most
    looking.max_lookahead = 3
    assert plan_request(SpeculativeConfig(method="auto"), msg, has_draft=True, draft=DFLASH, target=looking).lookahead == 3
    # Switched off (--target-lookahead off), against an older target (0), and for trees: the gateway's index.
    off = plan_request(SpeculativeConfig(method="auto", target_lookahead=False), msg, has_draft=True, draft=DFLASH,
                       target=looking)
    assert (off.lookahead, off.local_ngram) == (0, True)
    assert (plan("auto").lookahead, plan("auto").local_ngram) == (0, True)
    trees = draft_pb2.DraftInfo(model_id="d", method="dflash", block_size=8, target_layer_ids=[1, 3], max_topk=4)
    tree = plan_request(SpeculativeConfig(method="auto", eagle_topk=3), common_pb2.SpeculativeParams(method="auto"),
                        has_draft=True, draft=trees, target=looking)
    assert tree.ngram_tree is not None
    assert (tree.lookahead, tree.local_ngram) == (0, True)
    # Explicit methods never: ngram and dflash run what was asked at every step.
    assert plan("ngram", has_draft=False, draft=None).lookahead == 0


def test_plan_honours_what_it_can():
    p = plan("dflash", num_draft_tokens=5)
    assert p.speculative.num_draft_tokens == 5 and p.speculative.num_steps == 4 and p.speculative.topk == 1
    assert plan("ngram", has_draft=False, draft=None).local_ngram      # prompt lookup needs no draft service
    assert plan("none").speculative is None
    # A draft configured but unreachable: the request runs target-only (a fallback, not the client's error).
    assert plan("dflash", draft=None).speculative is None


def test_a_draft_refusing_the_clients_parameters_is_the_clients_error():
    from gateway.backends import BackendError
    from gateway.failover import refuses_client_params
    bad = BackendError(grpc.StatusCode.INVALID_ARGUMENT, "open.speculative.topk = 3: chains only", "draft")
    assert refuses_client_params(bad)
    # A prompt past the draft's context is not the client's fault: the target can still serve it.
    assert not refuses_client_params(BackendError(grpc.StatusCode.INVALID_ARGUMENT,
                                                  "open.prompt_token_ids has 5000 tokens", "draft"))
    assert not refuses_client_params(BackendError(grpc.StatusCode.UNAVAILABLE, "open.speculative", "draft"))


def test_decode_runs_stay_one_token_while_ngram_drafts_keep_paying():
    policy = AutoPolicy(Measurements(), max_k=7)
    for _ in range(10):
        assert policy.choose(Offer(ngram=3, ngram_match=2), 100).method == "ngram"   # free and, so far, accepted
    assert [policy.decode_run(100) for _ in range(3)] == [1, 1, 1]
    for _ in range(20):
        policy.choose(Offer(), 100)
    assert [policy.decode_run(100) for _ in range(3)] == [2, 4, 8]


def test_a_drafter_that_keeps_losing_is_probed_less_often():
    m = measured(30.0)                               # far too expensive to ever win
    policy = AutoPolicy(m, max_k=7)
    probes = []
    for i in range(16 + 32 + 64 + 1):
        c = policy.choose(Offer(dflash=7), 1000)
        policy.observe(c, 0)
        if c.method == "dflash":
            probes.append(i + 1)
    assert probes == [16, 48, 112]


def test_a_probe_does_not_cut_the_decode_runs_short():
    m = measured(30.0)
    policy = AutoPolicy(m, max_k=7)
    runs = []
    for _ in range(40):
        c = policy.choose(Offer(dflash=7), 10_000)
        policy.observe(c, 0)
        if c.method == "none":
            runs.append(policy.decode_run(10_000))
    assert runs[-10:] == [64] * 10


def test_the_draft_session_is_let_go_when_dflash_stops_winning_on_its_merits():
    policy = AutoPolicy(measured(30.0), max_k=7)      # a Propose far too slow to pay
    kept = []
    for _ in range(40):
        c = policy.choose(Offer(dflash=7), 10_000)
        policy.observe(c, 0)
        kept.append(policy.keeps_draft())
    assert kept[:31] == [True] * 31 and not any(kept[32:])
    assert FixedPolicy("dflash").keeps_draft()


def test_a_burst_on_a_fresh_gateway_opens_one_draft_session_to_measure_the_prices():
    """Nothing measured yet: the first request opens a DFlash session and finds the prices (an
    Open, a Propose) for all; the others of the burst do not each pay an Open. Once measured,
    each request is judged on them; an explorer whose session never reported lets another try
    after EXPLORE_S."""
    from gateway.policy import EXPLORE_S
    m = Measurements()
    burst = [AutoPolicy(m, max_k=7).wants_draft(64) for _ in range(16)]
    assert burst == [True] + [False] * 15
    m.exploring_until -= EXPLORE_S                                 # the explorer never reported back
    assert AutoPolicy(m, max_k=7).wants_draft(64)
    m.opened_draft(20.0)
    assert not AutoPolicy(m, max_k=7).wants_draft(64)               # still no Propose measured
    m.proposal("dflash", 5.0)
    for _ in range(20):
        m.target_step(4.0, 1, 1)
        m.target_step(4.5, 1, 8, verify=True, verify_rows=1)
    assert AutoPolicy(m, max_k=7).wants_draft(1000)                 # cheap verifies, optimistic acceptance
    assert not AutoPolicy(m, max_k=7).wants_draft(2)                # too short to repay a 20 ms Open



def test_a_bucket_measured_on_the_prior_alone_opens_one_session_at_a_time():
    """Prices measured, DFlash's acceptance of a bucket not yet: a session that pays on the prior
    alone is a measuring one, opened beside the target, and one request of the bucket at a time
    holds it (a burst of sixteen once opened 9-13, each a draft prefill on shared cores); its end
    lets the next one open, as does EXPLORE_S passing; other buckets measure on their own."""
    from gateway.policy import EXPLORE_S
    m = Measurements()
    m.opened_draft(1.0)
    m.proposal("dflash", 1.0)
    for _ in range(20):
        m.target_step(8.0, 1, 1)
        m.target_step(8.5, 1, 8, verify=True, verify_rows=1)
    burst = [AutoPolicy(m, max_k=7, bucket="sampled/greedy") for _ in range(16)]
    opened = [p.wants_draft(1000) for p in burst]
    assert opened == [True] + [False] * 15
    assert burst[0].opens_in_background and burst[0].measuring
    assert AutoPolicy(m, max_k=7, bucket="greedy").wants_draft(1000)        # its own bucket's measurer
    burst[0].finished()
    nxt = AutoPolicy(m, max_k=7, bucket="sampled/greedy")
    assert nxt.wants_draft(1000) and not AutoPolicy(m, max_k=7, bucket="sampled/greedy").wants_draft(1000)
    m.measuring_until["sampled/greedy"] -= EXPLORE_S                      # its request never ended
    assert AutoPolicy(m, max_k=7, bucket="sampled/greedy").wants_draft(1000)
    FixedPolicy("dflash").finished()                                       # nothing to release

# (sessions, drafter, acceptance, expected (method, k)) on CPU-like prices: a = 4, b = 0.5,
# c = 0.25, v = 1 ms, a Verify's overhead 1 ms, a DFlash Propose 5 ms, n-gram free. A decode
# step costs 4 + S·0.75 ms; a verify of k drafts 4 + S·(1.75 + 0.25·k) + 1 (+ 5 for DFlash).
CPU_CASES = [
    # one session, n-gram at 0.9: decode 1/4.75 = 0.211 tok/ms; k = 7: 5.695 tokens / 8.5 ms = 0.670
    (1, "ngram", 0.9, ("ngram", 7)),
    # sixteen sessions, same: decode 1/16 = 0.0625; k = 7: 5.695 / 61 = 0.093 (k = 3: 3.439 / 45 = 0.076)
    (16, "ngram", 0.9, ("ngram", 7)),
    # sixteen sessions, n-gram at 0.5: k = 1: 1.5 / 41 = 0.037 < 0.0625: drafting off
    (16, "ngram", 0.5, ("none", 0)),
    # one session, DFlash at 0.7: k = 7: 3.141 tokens / 13.5 ms = 0.233 > 0.211 (k = 6: 3.059 / 13.375 = 0.229)
    (1, "dflash", 0.7, ("dflash", 7)),
    # eight sessions, DFlash at 0.7: decode 1/10 = 0.1; k = 7: 3.141 / 38 = 0.083: drafting off
    (8, "dflash", 0.7, ("none", 0)),
    # one session, DFlash at 0.4: k = 1: 1.4 / 11 = 0.127; k = 7: 1.666 / 13.5 = 0.123 < 0.211: off
    (1, "dflash", 0.4, ("none", 0)),
]


@pytest.mark.parametrize("sessions, drafter, accept, want", CPU_CASES)
def test_the_cost_model_against_hand_computed_cells(sessions, drafter, accept, want):
    c = Costs(fixed_ms=4.0, row_ms=0.5, token_ms=0.25, rows=1.0, verify_overhead_ms=1.0, decode_overhead_ms=0.0,
              draft_ms={"dflash": 5.0, "ngram": 0.0}, verify_row_ms=1.0, sessions=float(sessions))
    best = choose({drafter: [accept] * 8}, {drafter: 7}, c)
    assert (best.method, best.k) == want


def test_a_gpus_prices_keep_dflash_on_at_sixteen_streams():
    # a = 6, b = 0.05, c = 0.01, v = 0.05 ms (a verify costs about a decode), a Propose 1.5 ms:
    # decode 6 + 16·0.06 = 6.96 ms (0.144 tok/ms); DFlash k = 7 at 0.7: 3.141 tokens in
    # 1.5 + 6 + 16·(0.05 + 0.08 + 0.05) + 0.5 = 10.88 ms (0.289 tok/ms).
    c = Costs(fixed_ms=6.0, row_ms=0.05, token_ms=0.01, rows=1.0, verify_overhead_ms=0.5, decode_overhead_ms=0.0,
              draft_ms={"dflash": 1.5}, verify_row_ms=0.05, sessions=16.0)
    best = choose({"dflash": [0.7] * 8}, {"dflash": 7}, c)
    assert (best.method, best.k) == ("dflash", 7)
    assert best.ms == pytest.approx(10.88) and best.tokens == pytest.approx(3.1412, abs=1e-3)


def test_round_trip_prices_are_kept_per_load():
    """A Verify among fifteen decoders waits for the forward in flight; alone it does not. The
    overhead measured under a burst stands for an idle target only until the idle target has its
    own measure (the policy would otherwise never draft again to re-measure it)."""
    m = Measurements()
    m.sessions = 16
    for _ in range(30):
        m.verify_round_trip(40.0, 10.0)               # 30 ms of waiting under load
    assert m.costs().verify_overhead_ms == pytest.approx(30.0)
    m.sessions = 1
    assert m.costs().verify_overhead_ms == pytest.approx(30.0)     # nothing measured alone yet: the nearest
    for _ in range(30):
        m.verify_round_trip(11.5, 10.0)
    assert m.costs().verify_overhead_ms == pytest.approx(1.5, abs=0.1)
    m.sessions = 20
    assert m.costs().verify_overhead_ms == pytest.approx(30.0)     # the burst's own measure is kept
    m.sessions = 5                                                  # 4-7: between the two, nearest first
    assert m.costs().verify_overhead_ms in (pytest.approx(30.0), pytest.approx(1.5, abs=0.1))


def test_forward_model_fed_only_decodes_prices_a_verify_as_a_decode_plus_a_little():
    # Decodes alone cannot tell a forward's fixed and per-row costs from its per-token ones
    # (every forward has as many tokens as rows). The time goes to the rows, so an unmeasured
    # width-8 verify is priced near a decode (here 1.5x), not at the 3.3x an even split gives,
    # which kept a fresh gateway from ever verifying an n-gram draft; verifies then teach it.
    for rows in (1, 16):
        fm = ForwardModel()
        for _ in range(20):
            fm.add(rows, rows, 5.0 * rows)
        a, b, c, v = fm.coef()
        decode = a + rows * (b + c)
        assert (decode + 7 * c + v) / decode < 1.6      # one row 7 tokens wider, verifying
        assert decode == pytest.approx(5.0 * rows, rel=0.01)
    for _ in range(40):
        fm.add(16, 16 + 7, 100.0, verify=True, verify_rows=1)
    a, b, c, v = fm.coef()
    assert a + 16 * b + 23 * c + v == pytest.approx(100.0, rel=0.05)
