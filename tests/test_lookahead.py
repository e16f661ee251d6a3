"""The target's prompt lookup inside Decode runs (target_service/lookahead.py): its pricing
against hand-computed cases, greedy output equal to plain decoding, exactly n tokens per run,
and sampled output that keeps the target's distribution."""
from __future__ import annotations

import asyncio
import collections

import pytest

from scheduler_helpers import run_scheduler
from service_helpers import tiny_target_dir
from splitspec.engine.sample import SamplingParams
from target_service import lookahead
from target_service.engine import generate
from splitspec.models.loader import load_model
from target_service.lookahead import MIN_GAIN, MIN_TOKENS, best_k, expected_accepted
from sampling_law import chi_square_pvalue, exact_joint

# (rates, k_max, (fixed, per row, per token, per verify row) ms, rows, tokens, verify_rows, produced) -> k
# Each case worked out by hand below it: a k-token chain adds c·k + v ms to the forward and an
# expected E_k = sum_i prod_{j<=i} r_j tokens. It may run when E_k >= MIN_TOKENS (1) and
# E_k / (c·k + v) beats MIN_GAIN (1.1) x the batch's rate (produced / base ms); of those, the k
# with the most (produced + E_k) / (base + c·k + v) wins, or plain decoding if none may run.
CASES = [
    # One stream, cheap verify: base 2+2+0.1 = 4.1 ms, rate 0.244, margin 0.268 /ms. r = 0.9:
    # E_8 = 9(1 - 0.9^8) = 5.13 over 1.8 ms = 2.85 /ms; (1 + 5.13)/(4.1 + 1.8) = 1.038, the best.
    ([0.9] * 8, 8, (2.0, 2.0, 0.1, 1.0), 1, 1, 0, 1.0, 8),
    # Same prices, r = 0.2: E_8 = 0.25 tokens: off.
    ([0.2] * 8, 8, (2.0, 2.0, 0.1, 1.0), 1, 1, 0, 1.0, 0),
    # r = 0.45, base 4 ms: E_8 = 0.817 over 1 ms would beat plain ((1 + 0.817)/5 = 0.363 > 0.25)
    # and the margin, but adds under one token (T = 1's drafts, where the estimates' errors decide): off.
    ([0.45] * 8, 8, (2.0, 2.0, 0.0, 1.0), 1, 1, 0, 1.0, 0),
    # r = 0.6, a dear verify (v = 5.5): E_8 = 1.475 over 5.5 ms = 0.268 /ms, above the rate 0.25
    # ((1 + 1.475)/9.5 = 0.261 beats plain) but under the margin 0.275: off.
    ([0.6] * 8, 8, (2.0, 2.0, 0.0, 5.5), 1, 1, 0, 1.0, 0),
    # A full batch: 16 decoders, base 2 + 16 + 8 = 26 ms, rate 0.615, margin 0.677 /ms. r = 0.8:
    # E_8 = 4(1 - 0.8^8) = 3.33 over 0.5·8 + 3 = 7 ms = 0.476 /ms: off. r = 0.9: 5.13 over 7 ms =
    # 0.732 /ms: on, (16 + 5.13)/33 = 0.640 (k = 7: 20.70/32.5 = 0.637). The r = 0.9 draft alone
    # (base 3.5): (1 + 5.13)/(3.5 + 7) = 0.583 beats k = 7's 5.70/10 = 0.570.
    ([0.8] * 8, 8, (2.0, 1.0, 0.5, 3.0), 16, 16, 0, 16.0, 0),
    ([0.9] * 8, 8, (2.0, 1.0, 0.5, 3.0), 16, 16, 0, 16.0, 8),
    ([0.9] * 8, 8, (2.0, 1.0, 0.5, 3.0), 1, 1, 0, 1.0, 8),
    # Per-token cost dominates: c = 1.5, base 5.5 ms (margin 0.2), r = 0.6: k = 1, 2 add under one
    # token; k = 3: 2.176/10 = 0.218 (1.176 over 4.5 ms = 0.261 /ms), k = 4: 2.306/11.5 = 0.200.
    ([0.6] * 8, 8, (2.0, 2.0, 1.5, 0.0), 1, 1, 0, 1.0, 3),
    # k_max caps the chain: the request has 3 tokens left (k <= 2; E_2 = 1.71).
    ([0.9] * 8, 2, (2.0, 2.0, 0.1, 1.0), 1, 1, 0, 1.0, 2),
]


@pytest.mark.parametrize("rates,k_max,coef,rows,tokens,verify_rows,produced,want", CASES)
def test_best_k_against_hand_computed_cases(rates, k_max, coef, rows, tokens, verify_rows, produced, want):
    k, e = best_k(rates, k_max, coef, rows=rows, tokens=tokens, verify_rows=verify_rows, produced=produced)
    assert k == want
    assert e == pytest.approx(expected_accepted(rates, k))


def test_expected_accepted_counts_a_chain_stopping_at_its_first_rejection():
    assert expected_accepted([0.5, 0.5, 0.5], 2) == pytest.approx(0.5 + 0.25)
    assert expected_accepted([1.0, 0.0, 1.0], 3) == pytest.approx(1.0)
    assert expected_accepted([0.9], 0) == 0.0
    assert MIN_GAIN > 1.0 and MIN_TOKENS == 1.0      # the cases below are worked out with these


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_target_dir())


def run(model, body, cheap_verify: bool = True):
    """body(sched) on a scheduler whose lookahead prices verifies as nearly free when
    `cheap_verify` (so that drafts are verified wherever a match exists, whatever this CPU's
    timings): the paths under test then run on every match."""
    async def priced(sched):
        if cheap_verify:
            sched.lookahead.forward.coef = lambda: (1.0, 1.0, 0.0, 0.0)
        return await body(sched)
    return run_scheduler(model, priced, blocks=512, max_running=16, max_queued=64, max_batched_tokens=128,
                         chunked_prefill_size=32, max_context=1024)


async def decode_all(sched, name, prompt, params, n, look):
    session, first = await sched.open(name, prompt, params, max_new_tokens=n + 1)
    out, drafted, forwards = [first.out.committed[0]], 0, 0
    async for st in sched.decode(session, n, lookahead=look):
        out.extend(st.out.committed)
        drafted += st.drafted
        forwards += 1
        assert 0 <= st.accepted <= st.drafted <= look
        assert len(st.out.committed) == st.accepted + 1 if st.drafted else len(st.out.committed) == 1
    sched.close(session)
    return out, drafted, forwards


PROMPTS = [[5, 6, 7, 8, 9] * 4, [40, 41, 42] * 5 + [7], [9, 10, 11, 12, 13, 14, 15, 16]]


def test_greedy_decode_with_lookahead_equals_plain_decoding_and_ends_at_n(model):
    n = 40

    async def body(sched):
        plain = await asyncio.gather(*(decode_all(sched, f"p{i}", p, SamplingParams(), n, 0)
                                       for i, p in enumerate(PROMPTS)))
        looked = await asyncio.gather(*(decode_all(sched, f"l{i}", p, SamplingParams(), n, 7)
                                        for i, p in enumerate(PROMPTS)))
        return plain, looked
    plain, looked = run(model, body)
    for prompt, (ref, d0, f0), (out, drafted, forwards) in zip(PROMPTS, plain, looked):
        assert out == ref == generate(model, prompt, n + 1)
        assert d0 == 0 and f0 == n
        assert len(out) == n + 1                       # exactly n decoded, however many per forward
    assert sum(d for _, d, _ in looked) > 0            # the lookup drafted ...
    assert sum(f for _, _, f in looked) < len(PROMPTS) * n   # ... and committed several tokens a forward


def test_lookahead_stays_off_where_it_does_not_pay_and_without_a_match(model):
    async def body(sched):
        # Measured-looking prices under which a verify costs ten decodes: nothing is drafted.
        sched.lookahead.forward.coef = lambda: (1.0, 1.0, 0.0, 20.0)
        dear = await decode_all(sched, "dear", PROMPTS[0], SamplingParams(), 20, 7)
        sched.lookahead.forward.coef = lambda: (1.0, 1.0, 0.0, 0.0)
        # No token of the prompt repeats and the run is short: no match, nothing drafted.
        fresh = await decode_all(sched, "fresh", [100, 101, 102, 103], SamplingParams(), 2, 7)
        return dear, fresh
    dear, fresh = run(model, body)
    assert dear[1] == 0 and dear[2] == 20
    assert fresh[1] == 0


def test_lookahead_refuses_a_negative_width(model):
    async def body(sched):
        session, _ = await sched.open("neg", [5, 6], SamplingParams(), max_new_tokens=8)
        with pytest.raises(ValueError, match="decode.lookahead"):
            async for _ in sched.decode(session, 3, lookahead=-1):
                pass
        # The session is unharmed: a plain run still works.
        got = [st.out.committed[0] async for st in sched.decode(session, 3)]
        sched.close(session)
        return got
    assert len(run(model, body)) == 3


def test_sampled_decode_with_lookahead_follows_the_target_distribution(model):
    # Every token of the vocabulary occurs in the prompt, so whatever is sampled the lookup
    # finds a match and drafts what followed it.
    prompt = list(range(3, model.cfg.vocab_size)) + [7, 8, 9, 7, 8]
    n, samples = 4, 720
    params = dict(temperature=1.0, top_k=3)
    joint = exact_joint(model, prompt, SamplingParams(**params), n)

    async def body(sched):
        # One session at a time: in a batch the price of a verify is weighed against every
        # row's token, and a draft at T=1 from a random model seldom pays for a whole batch.
        sem = asyncio.Semaphore(1)
        # Nor would one at a time for long: the lookup's tokens are seldom among this model's
        # top 3, and the estimates would learn so. The prior (0.7) stands in for them here.
        sched.lookahead.observe = lambda *a: None

        async def one(seed):
            async with sem:
                out, drafted, _ = await decode_all(sched, f"s{seed}", prompt, SamplingParams(**params, seed=seed),
                                                   n - 1, 7)
                return tuple(out), drafted
        return await asyncio.gather(*(one(s) for s in range(samples)))
    results = run(model, body)
    counts = collections.Counter(ids for ids, _ in results)
    assert set(counts) <= set(joint)
    drafted = sum(1 for _, d in results if d)
    print(f"{drafted} of {samples} requests verified prompt-lookup drafts")
    assert drafted >= samples // 2, drafted
    assert chi_square_pvalue(counts, joint, samples) > 1e-3


def test_the_target_wide_estimate_seeds_each_sessions_own():
    la = lookahead.Lookahead(max_draft=4)
    a = lookahead.SessionLookahead(sampled=False)
    for _ in range(30):
        la.observe(a, 2, 4, 0)                  # session a: 2-token matches never accepted
    b = lookahead.SessionLookahead(sampled=False)
    la.observe(b, 1, 1, 1)
    local_b, shared = la._acceptance(b, 2)
    assert shared.rates()[0] < 0.1 and local_b.rates()[0] < 0.2      # b starts from what a taught
    c = lookahead.SessionLookahead(sampled=True)
    assert la._acceptance(c, 2)[0].rates()[0] > 0.5                     # sampled sessions learn apart


def test_no_lookup_where_even_a_whole_accepted_chain_would_not_pay():
    """The cheap check before any session's lookup: 64 decoders at (2, 1, 0.5, 8) ms, base 98 ms,
    rate 0.653, margin 0.718 /ms; 7 tokens all accepted add 7 over 3.5 + 8 ms = 0.609 /ms: no.
    One decoder (base 3.5 ms, margin 0.314): yes."""
    la = lookahead.Lookahead()
    la.forward.coef = lambda: (2.0, 1.0, 0.5, 8.0)
    assert la.could_pay(7, rows=1, tokens=1, verify_rows=0, produced=1.0)
    assert not la.could_pay(7, rows=64, tokens=64, verify_rows=0, produced=64.0)
