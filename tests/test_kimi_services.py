"""Speculation on a hybrid (KDA + MLA + MoE) target through the real services: greedy n-gram and
DFlash (taps on a KDA and on the last, MLA, layer) equal target-only greedy token for token,
sampled speculation follows the target's distribution, and a tree verify on a chain-accepting
session works too (the KDA state follows the accepted branch)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from draft_service.dflash import new_draft, save_draft
from hybrid_models import save_tiny_kimi
from service_helpers import (VOCAB, collect, gateway_stub, repeating_prompts, running_draft, running_gateway,
                             running_stack, target_info)
from splitspec_tools.client import build_request
from target_service.engine import generate
from sampling_law import dflash_law

N_NEW = 24


def prompts():
    return repeating_prompts(6, 7, (3, 9), repeat=3)


# Many tiny forwards: thread start-up costs more than it saves.
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_kimi(tmp_path_factory.mktemp("kimi") / "tiny-kimi", vocab_size=VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def services(model, target_dir, tmp_path_factory):
    draft_dir = tmp_path_factory.mktemp("draft") / "tiny-dflash"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=4, mask_token_id=2, target_layer_ids=(1, 3), seed=5),
               draft_dir)
    logs = tmp_path_factory.mktemp("logs")
    # A draft timeout a loaded machine cannot hit: a fallback would leave a request undrafted.
    with running_stack(target_dir, logs, draft_dir, "--speculative-algorithm", "DFLASH", "--draft-timeout-ms", "60000",
                       service_args=("--torch-threads", "1")) as stack:
        yield stack


def test_target_reports_the_hybrid_family(services, model):
    info = target_info(services[0].address)
    assert info.architecture == "KimiLinearForCausalLM" and info.num_layers == model.cfg.num_hidden_layers


@pytest.mark.parametrize("method", ["dflash", "ngram"])
def test_greedy_speculation_equals_target_only(stub, model, method):
    refs = [generate(model, p, N_NEW) for p in prompts()]

    def run(p):
        req = build_request(p, max_new_tokens=N_NEW, ignore_eos=True, method=method)
        req.speculative.num_draft_tokens = 3
        return collect(stub.Generate(req, timeout=300))
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, prompts()))
    lookups = 0
    for p, (ids, _, complete), ref in zip(prompts(), results, refs):
        assert ids == ref
        # A step without drafts runs target-only and equals the reference whatever the drafter
        # does. DFlash drafts every step; n-gram lookup (min n 1) has a draft exactly when the
        # last token occurred before, which the test checks itself on the committed tokens.
        assert complete.stats.draft_fallbacks == 0
        ctx = p + ids[:1]                          # b0 comes from the prefill
        for step in complete.stats.steps:
            done = len(ctx) - len(p)
            if N_NEW - done >= 2 and (method == "dflash" or ctx[-1] in ctx[:-1]):
                assert step.k > 0, (p, done, method)
                lookups += 1
            ctx += ids[done:done + step.accepted + 1]
    assert lookups > 0


def test_sampled_dflash_follows_the_target_distribution(stub, model):
    stats = dflash_law(stub, model, 300, prompt=[7, 8, 9, 7, 8, 9, 7], draft_sampling="sample", workers=6,
                       num_draft_tokens=3)
    assert all(any(s.k for s in st.steps) for st in stats)      # every request verified sampled drafts


def test_tree_verify_and_stream_choice_on_the_wire(services, model):
    import grpc

    from splitspec.v1 import common_pb2, target_pb2
    from test_bad_input import Stream, open_msg
    address = services[0].address
    prompt = [5, 17, 9, 33, 2]
    g = generate(model, prompt, 5)
    s = Stream(address)
    try:
        opened = s.send(open=open_msg(prompt)).recv().opened
        assert opened.first_token_id == g[0]
        # root -> [wrong] and root -> [g1 -> g2]: the second branch is accepted
        tree = common_pb2.TokenTree(token_ids=[(g[1] + 1) % VOCAB, g[1], g[2]], parents=[-1, -1, 1])
        verified = s.send(verify=target_pb2.TargetVerify(base_len=len(prompt) + 1, tree=tree)).recv().verified
        assert list(verified.committed_token_ids) == g[1:4]
        assert s.send(decode=target_pb2.TargetDecode(n=1)).recv().token.token_id == g[4]   # state of the branch
    finally:
        s.close()
    s = Stream(address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            s.send(open=open_msg(prompt, hidden_layer_ids=[1], hidden_stream="attn_res")).recv()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "open.hidden_stream" in err.value.details()
    finally:
        s.close()


def test_the_drafts_declared_tap_stream_reaches_the_target(services, model, target_dir, tmp_path):
    """A draft declares the stream its taps were trained on (`aux_hidden_stream`); the draft
    service reports it, the gateway opens the target with it, and a target without Attention
    Residuals refuses it by name instead of serving features the draft never saw."""
    import dataclasses

    import grpc

    from splitspec.v1 import common_pb2, draft_pb2_grpc
    d = new_draft(model.cfg, num_layers=1, block_size=4, mask_token_id=2, target_layer_ids=(1, 3), seed=5)
    d.cfg = dataclasses.replace(d.cfg, aux_hidden_stream="attn_res")
    save_draft(d, tmp_path / "attn-res-draft")
    with running_draft(target_dir, tmp_path, "--torch-threads", "1", draft_dir=tmp_path / "attn-res-draft") as draft, \
            running_gateway(services[0], tmp_path, "--draft", draft.address, "--speculative-algorithm",
                            "DFLASH") as gw:
        with grpc.insecure_channel(draft.address) as ch:
            info = draft_pb2_grpc.DraftStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert info.target_hidden_stream == "attn_res"
        ch, stub = gateway_stub(gw.address)
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(build_request([5, 6, 7], max_new_tokens=4, method="dflash"), timeout=60))
        ch.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hidden_stream" in err.value.details() and "attn_res" in err.value.details()


def test_kda_target_verifies_and_rolls_back_draft_trees(stub, model):
    """DFlash trees (topk 2) on the hybrid target: every verify runs a branching tree through
    the KDA layers and keeps only the accepted branch's recurrent state; greedy output equals
    target-only decoding."""
    refs = [generate(model, p, N_NEW) for p in prompts()[:3]]

    def run(p):
        req = build_request(p, max_new_tokens=N_NEW, ignore_eos=True, method="dflash")
        req.speculative.topk, req.speculative.num_draft_tokens = 2, 6
        return collect(stub.Generate(req, timeout=300))
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, prompts()[:3]))
    trees = 0
    for (ids, _, complete), ref in zip(results, refs):
        assert ids == ref and complete.stats.draft_fallbacks == 0
        trees += sum(1 for s in complete.stats.steps if s.k > s.depth > 0)
    assert trees > 0
