"""`speculative.method = "auto"` through the real services: the gateway picks drafter (DFlash,
its own n-gram index, or none) and draft length per step. Greedy output must still equal
target-only decoding, sampled output must still follow the target's distribution, and
parameters no drafter can honour are refused before any session opens."""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from draft_service.dflash import new_draft, save_draft
from gateway.policy import sampling_bucket
from service_helpers import (collect, fixed_prices, gateway_stub, inproc_gateway, repeating_prompts, running_stack,
                             sampled_runs, target_info)
from splitspec_tools.client import build_request
from splitspec.engine.sample import SamplingParams
from splitspec.v1 import gateway_pb2
from target_service.engine import generate
from sampling_law import assert_follows, exact_joint

N_PROMPTS, N_NEW = 16, 64


def prompts():
    return repeating_prompts(N_PROMPTS, 99, (3, 10), repeat=4)


TARGET_CONTEXT = 1024


@pytest.fixture(scope="module")
def services(model, target_dir, tmp_path_factory):
    draft_dir = tmp_path_factory.mktemp("draft") / "tiny-dflash"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=8, mask_token_id=2, seed=5), draft_dir)
    logs = tmp_path_factory.mktemp("logs")
    # No --speculative-algorithm: with a draft, the gateway's default is auto.
    with running_stack(target_dir, logs, draft_dir) as stack:
        yield stack


def test_auto_is_the_default_with_a_draft(stub):
    assert stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10).speculative_method == "auto"


def test_auto_greedy_equals_target_only_using_both_drafters_and_several_k(stub, services, model):
    refs = [generate(model, p, N_NEW) for p in prompts()]

    def send(stub):
        def run(p):
            return collect(stub.Generate(build_request(p, max_new_tokens=N_NEW, ignore_eos=True), timeout=300))
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(run, prompts()))
    # The gateway as deployed, at the prices it measures (on this CPU it drafts little) ...
    results = send(stub)
    # ... and in process at prices under which any draft pays (see the distribution test), so
    # that both drafters and several k run.
    target, draft, _ = services
    # DFlash's acceptance is given too: on the prior alone its sessions would open beside the
    # target (measuring ones) and DFlash would be shadow-probed before it drafts.
    prices = fixed_prices(decode_ms=12.0, verify_ms=4.0, propose_ms=0.0, draft_open_ms=0.0,
                          accept={("dflash", "greedy"): 0.5})
    with inproc_gateway(target.address, draft.address, measurements=prices, num_draft_tokens=8) as address:
        results += send(gateway_stub(address)[1])
    refs = refs + refs
    used = collections.Counter()
    ks = collections.Counter()
    for (ids, _, complete), ref in zip(results, refs):
        assert ids == ref
        st = complete.stats
        assert st.method == "auto" and st.draft_fallbacks == 0
        assert len(st.steps) == st.verify_steps == sum(st.steps_by_method.values())
        assert sum(s.accepted + 1 for s in st.steps) == len(ids) - 1     # each step: accepted + one bonus
        for s in st.steps:
            assert 0 <= s.accepted <= s.k <= 7
            used[s.method] += 1
            ks[s.k] += 1
    print(f"steps by drafter {dict(used)}, by k {dict(sorted(ks.items()))}")
    assert used["dflash"] and used["ngram"], used
    assert len([k for k in ks if k > 0]) >= 3, ks


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_auto_sampling_follows_the_target_distribution(services, model, draft_sampling):
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]          # repeats: the n-gram index offers drafts too
    n, samples = 4, 720
    params = SamplingParams(temperature=1.0, top_k=3)
    joint = exact_joint(model, prompt, params, n)
    # The chi-square says something about speculation only if most requests verify drafts.
    # Which step auto picks depends on the prices it measured and the acceptance it learns, and
    # a random draft at T=1 is rarely accepted, so measured prices would (rightly) stop it
    # drafting. The gateway here runs in process with prices under which any draft pays (a
    # verify cheaper than a decode, a free Propose and Open): auto then drafts wherever a
    # drafter offers, through its own choices, cuts and acceptance updates, and the test checks
    # that every such path keeps the target's distribution. Its n-gram chains come from its own
    # index here: the target's lookahead prices with its own measured forwards (and its
    # distribution has its test in test_lookahead.py).
    target, draft, _ = services
    # DFlash's acceptance is given too: on the prior alone its session would open beside the
    # target (a measuring one), too late for these 4-token requests to draft with it.
    prices = fixed_prices(decode_ms=12.0, verify_ms=4.0, propose_ms=0.0, draft_open_ms=0.0,
                          accept={("dflash", sampling_bucket(1.0, draft_sampling)): 0.5})
    with inproc_gateway(target.address, draft.address, measurements=prices, num_draft_tokens=8,
                        target_lookahead=False) as address:
        _, stub = gateway_stub(address)
        results = sampled_runs(stub, prompt, n, samples, method="auto", draft_sampling=draft_sampling)
    drafted = sum(1 for _, st in results if any(s.k for s in st.steps))
    methods = collections.Counter(s.method for _, st in results for s in st.steps)
    print(f"{draft_sampling}: {drafted} of {samples} requests verified drafts; methods {methods}")
    assert drafted >= samples // 2, drafted
    assert methods["dflash"] and methods["ngram"], methods
    assert_follows([ids for ids, _ in results], joint, samples)


def test_target_only_runs_are_extended_without_a_gap(stub, services, model):
    """Where drafts do not pay (T=1 with a random draft) and the gateway drafts n-gram chains
    itself (a target that cannot look ahead), auto decodes in runs; the next step is decided
    before a run's last token and the run extended on the target, so the session never sits out
    a forward between two runs: most runs after the first few are extensions, and every token
    still arrives once, in order. With the target looking ahead (the default), a request that
    holds no DFlash session has nothing to decide: one Decode run takes all its tokens."""
    def send(stub):
        def run(seed):
            prompt = [11 + seed, 40 + 3 * seed, 90 + seed, 7]
            req = build_request(prompt, max_new_tokens=160, ignore_eos=True, temperature=1.0, seed=seed,
                                method="auto")
            ids, _, complete = collect(stub.Generate(req, timeout=300))
            return ids, complete.stats
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(run, range(4)))
        for ids, st in results:
            assert len(ids) == 160
            assert sum(s.accepted + 1 for s in st.steps) == len(ids) - 1
            assert st.steps_by_method.get("none", 0) > 100
        return results
    target, draft, _ = services
    with inproc_gateway(target.address, draft.address, num_draft_tokens=8, target_lookahead=False) as address:
        results = send(gateway_stub(address)[1])
    runs = sum(st.decode_runs for _, st in results)
    extensions = sum(st.decode_extensions for _, st in results)
    print(f"gateway n-gram: {runs} Decode runs, {extensions} extensions")
    assert extensions > 0 and extensions >= runs // 2, (runs, extensions)
    sessionless = [st for _, st in send(stub) if st.hidden_state_bytes == 0]
    print(f"target lookahead: runs of the requests without a draft session {[st.decode_runs for st in sessionless]}")
    assert sessionless and all(st.decode_runs == 1 and st.decode_extensions == 0 for st in sessionless)


def test_parameters_no_drafter_can_honour_are_refused_before_any_session(stub, services):
    for method, field, value, words in [("dflash", "topk", 17, "offers per node (16)"),
                                        ("dflash", "num_draft_tokens", 1000, "block size (8)"),
                                        ("dflash", "num_steps", 20, "block size")]:
        req = build_request([5, 6, 7], max_new_tokens=8, method=method)
        setattr(req.speculative, field, value)
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"speculative.{field} = {value}" in err.value.details() and words in err.value.details()
    assert target_info(services[0].address).active_sessions == 0
    # With auto the same numbers are upper bounds; the stats say what ran.
    req = build_request([5, 6, 7], max_new_tokens=16, ignore_eos=True, method="auto")
    req.speculative.topk, req.speculative.num_draft_tokens = 3, 1000
    ids, _, complete = collect(stub.Generate(req, timeout=60))
    # (a tree of topk 3: at most the verify cap's 64 nodes, at most the block's 7 levels)
    assert len(ids) == 16 and all(s.k <= 64 and s.depth <= 7 for s in complete.stats.steps)
    # The target alone honours k = 0 requests exactly: method none never drafts.
    ids, _, complete = collect(stub.Generate(build_request([5, 6, 7], max_new_tokens=8, method="none"), timeout=60))
    assert set(complete.stats.steps_by_method) == {"none"} and all(s.k == 0 for s in complete.stats.steps)
