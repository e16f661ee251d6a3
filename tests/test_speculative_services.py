"""Speculation through the real services on loopback: gateway -> draft (Propose) -> target
(Verify). Greedy output must equal target-only decoding token for token, for dflash and
ngram and several verify widths; the pair is checked at start-up; stale state is refused."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from draft_service.dflash import new_draft, save_draft
from service_helpers import collect, repeating_prompts, running_draft, running_stack
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import start_service
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2_grpc
from splitspec.wire import tensor_to_pb
from target_service.engine import generate
from splitspec.models.loader import load_model

MAX_CONTEXT = TARGET_CONTEXT = 1024
N_PROMPTS, N_NEW = 20, 64


def prompts():
    return repeating_prompts(N_PROMPTS, 1234, (2, 12), repeat=3)


@pytest.fixture(scope="module")
def services(target_dir, draft_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # A draft timeout a loaded machine cannot hit: a fallback would leave a request undrafted.
    with running_stack(target_dir, logs, draft_dir, "--speculative-algorithm", "DFLASH",
                       "--draft-timeout-ms", "60000") as stack:
        yield stack


@pytest.fixture(scope="module")
def references(model):
    return [generate(model, p, N_NEW) for p in prompts()]


def speculative_request(prompt, method, width, **sampling):
    req = build_request(prompt, max_new_tokens=N_NEW, ignore_eos=True, method=method, **sampling)
    req.speculative.num_draft_tokens = width
    req.speculative.num_steps = width - 1
    return req


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("method", ["dflash", "ngram"])
def test_greedy_speculation_equals_target_only(stub, references, method, width):
    # Four streams at a time: the services interleave sessions, which is also under test here.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: collect(stub.Generate(speculative_request(p, method, width), timeout=300)),
                                prompts()))
    taus, drafted, accepted_steps = [], 0, 0
    for (ids, texts, complete), ref in zip(results, references):
        assert ids == ref
        st = complete.stats
        assert st.method == method
        assert st.draft_fallbacks == 0, "the draft failed: this run did not test speculation"
        drafted += st.draft_tokens > 0
        accepted_steps += sum(1 for s in st.steps if s.k and s.accepted)
        accepted = sum(st.accepted_per_position)
        # Every step commits its accepted drafts plus one bonus; b0 comes from the prefill.
        assert st.verify_steps + accepted == len(ids) - 1
        assert 1.0 <= st.accept_length <= width
        assert len(st.accepted_per_position) <= width - 1
        assert st.draft_tokens >= accepted
        if method == "dflash":
            assert st.hidden_state_bytes > 0
        taus.append(st.accept_length)
    print(f"{method} width {width}: mean tau {sum(taus) / len(taus):.2f}, {drafted} of {len(results)} requests "
          f"drafted, {accepted_steps} steps accepted drafts")
    # Equal to target-only proves nothing about speculation unless drafts were verified: the
    # prompts repeat, so n-gram lookup finds drafts in every request, and they get accepted
    # (the random DFlash draft is rarely right, so for it drafting is what is required).
    assert drafted == len(results)
    if method == "ngram":
        assert accepted_steps > 0


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_seeded_sampled_speculation_is_reproducible(stub, draft_sampling):
    prompt = prompts()[1]

    def run(seed):
        req = speculative_request(prompt, "dflash", 8, temperature=1.0, top_p=0.9, seed=seed)
        req.speculative.draft_sampling = draft_sampling
        ids, _, complete = collect(stub.Generate(req, timeout=120))
        assert complete.stats.method == "dflash"
        return ids
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_draft_refuses_stale_base_len_and_bad_hidden(services, target_dir, draft_dir):
    from draft_service.architectures import load_draft
    feat = load_draft(draft_dir, target_dir).cfg.target_feature_size
    with grpc.insecure_channel(services[1].address) as ch:
        stub = draft_pb2_grpc.DraftStub(ch)

        def session(*msgs):
            try:
                return list(stub.Session(iter(msgs), timeout=30)), None
            except grpc.RpcError as exc:
                return None, exc
        open_ok = draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
            session_id="t", prompt_token_ids=[5, 6, 7], prompt_hidden=tensor_to_pb(torch.randn(3, feat))))
        _, err = session(open_ok, draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(base_len=9, new_token_ids=[1])))
        assert err.code() == grpc.StatusCode.ABORTED and "base_len" in err.details()
        bad_open = draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
            session_id="t", prompt_token_ids=[5, 6, 7], prompt_hidden=tensor_to_pb(torch.randn(3, feat + 1))))
        _, err = session(bad_open)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "open.prompt_hidden.shape" in err.details()
        ok, err = session(open_ok, draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(base_len=4, new_token_ids=[1])))
        assert err is None and len(ok[1].proposal.tree.token_ids) == 7
        info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert info.active_sessions == 0 and info.method == "dflash" and info.block_size == 8


def _open_rows(stub, prompt, info, model):
    """Greedy DFlash through a gateway: the output must equal target-only decoding; returns how
    many prompt feature rows the session's Open carried, from the request's hidden_state_bytes
    (the Open's rows plus one row per token committed by a Verify)."""
    ids, _, complete = collect(stub.Generate(speculative_request(prompt, "dflash", 8), timeout=300))
    assert ids == generate(model, prompt, N_NEW)
    st = complete.stats
    assert st.method == "dflash" and st.draft_fallbacks == 0 and st.draft_tokens > 0
    dtype_bytes = {common_pb2.DTYPE_F32: 4, common_pb2.DTYPE_F16: 2, common_pb2.DTYPE_BF16: 2}[info.hidden_dtype]
    row = len(info.target_layer_ids) * info.target_hidden_size * dtype_bytes
    assert st.hidden_state_bytes % row == 0
    return st.hidden_state_bytes // row - (st.verify_steps + sum(st.accepted_per_position))


def test_windowed_draft_open_carries_only_its_window(services, stub, model, target_dir, tmp_path_factory):
    """A draft whose layers all slide over W = 16 reports context_window 15: the gateway asks the
    target for only the last 15 prompt features and opens the draft with prompt_hidden_start, and
    greedy output on prompts longer than the window still equals target-only decoding; the
    full-attention draft of this module still gets every prompt row."""
    import dataclasses
    import random
    from service_helpers import running_gateway
    W = 16
    d = new_draft(model.cfg, num_layers=1, block_size=8, mask_token_id=2, seed=3)
    d.cfg = dataclasses.replace(d.cfg, layer_types=("sliding_attention",), sliding_window=W, is_causal=False)
    path = tmp_path_factory.mktemp("windowed") / "tiny-dflash-windowed"
    save_draft(d, path)
    rng = random.Random(77)
    long_prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (70, 140)]
    with grpc.insecure_channel(services[1].address) as ch:
        full_info = draft_pb2_grpc.DraftStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert full_info.context_window == 0
    logs = tmp_path_factory.mktemp("windowed-logs")
    with running_draft(target_dir, logs, draft_dir=path) as draft, \
            running_gateway(services[0], logs, "--draft", draft.address, "--speculative-algorithm", "DFLASH",
                            "--draft-timeout-ms", "60000") as gw:
        with grpc.insecure_channel(draft.address) as ch:
            info = draft_pb2_grpc.DraftStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert info.context_window == W - 1
        with grpc.insecure_channel(gw.address) as ch:
            wstub = gateway_pb2_grpc.GenerationStub(ch)
            for p in long_prompts:
                assert _open_rows(wstub, p, info, model) == W - 1
            short = long_prompts[0][:9]                   # shorter than the window: all of it
            assert _open_rows(wstub, short, info, model) == len(short)
    for p in long_prompts:
        assert _open_rows(stub, p, full_info, model) == len(p)


def test_incompatible_pair_is_refused_at_start(tmp_path, target_dir, services):
    """A draft built for a different target (other hidden size): the gateway never serves."""
    from tiny_models import save_tiny_model
    other = save_tiny_model(tmp_path / "other", "qwen3", vocab_size=512, hidden_size=32, tokenizer=True, seed=9)
    d = new_draft(load_model(other).cfg, num_layers=1, block_size=4, mask_token_id=2)
    save_draft(d, tmp_path / "other-draft")
    with running_draft(other, tmp_path, draft_dir=tmp_path / "other-draft") as draft:
        gw = start_service("gateway", ["--target", services[0].address, "--draft", draft.address],
                           log_dir=tmp_path)
        try:
            deadline = time.monotonic() + 120
            while gw.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert gw.proc.returncode not in (None, 0)
            log = gw.log_tail(40)
            assert "FAILED_PRECONDITION" in log and "hidden size" in log
        finally:
            gw.stop()


def test_eight_concurrent_mixed_streams_each_equal_their_run_alone(stub, references, services):
    """Greedy and seeded sampling, dflash / ngram / none, all at once: the services batch their
    steps together, and each request still produces what it produces alone."""
    from splitspec.v1 import target_pb2_grpc
    cases = []
    for i, (method, temperature) in enumerate([("dflash", 0.0), ("ngram", 0.0), ("none", 0.0), ("dflash", 1.0),
                                               ("ngram", 1.0), ("none", 0.8), ("dflash", 0.7), ("none", 0.0)]):
        kw = dict(temperature=temperature, seed=100 + i, top_p=0.9) if temperature else {}
        req = speculative_request(prompts()[i], method, 8, **kw) if method != "none" else \
            build_request(prompts()[i], max_new_tokens=N_NEW, ignore_eos=True, method="none", **kw)
        if method == "dflash" and temperature == 1.0:
            req.speculative.draft_sampling = "sample"
        cases.append(req)

    queued = []

    def run(req):
        ids, _, complete = collect(stub.Generate(req, timeout=300))
        assert complete.stats.draft_fallbacks == 0
        queued.append(complete.stats.queue_ms)
        return ids
    alone = [run(r) for r in cases]
    ch = grpc.insecure_channel(services[0].address)
    info = target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, cases))
    after = target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    ch.close()
    assert together == alone
    assert sum(queued[len(cases):]) > 0          # the stats report time spent waiting for batched forwards
    for i, req in enumerate(cases):
        if req.sampling.temperature == 0:
            assert together[i] == references[i]
    # The steps of the eight requests really shared forwards.
    mean_batch = (after.batched_steps - info.batched_steps) / (after.forward_passes - info.forward_passes)
    print(f"target mean batch size with 8 streams: {mean_batch:.2f}")
    assert mean_batch > 1.5
