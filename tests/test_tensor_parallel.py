"""Tensor parallelism (target_service/parallel.py, tp_worker.py): each sharded layer (dense) and
each sharded Kimi-family model against its unsharded reference on two gloo ranks; rank 0's driver
(spawned worker, KV copies and KDA state commits replayed) against the one-process engine; greedy
output through the services at --tensor-parallel-size 2 equal to transformers and to TP=1, with
DFlash, n-gram and without speculation, on dense, KimiLinear and DeepSeek-V3 targets; T=1 sampled
speculation through a TP=2 target follows the exact target distribution; a rank killed
mid-stream: the request fails over with the same tokens and the replica goes out of service."""
from __future__ import annotations

import collections
import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
import torch.multiprocessing as tmp

from draft_service.dflash import new_draft, save_draft
from service_helpers import (VOCAB, collect, finish_with_one_failover, gateway_stub, running_draft, running_gateway,
                             running_target, sampled_runs, target_info, tiny_target_dir, wait_not_serving)
from splitspec_tools.client import build_request
from splitspec.engine.sample import SamplingParams
from splitspec_tools.ops.launch import free_port
from splitspec.v1 import target_pb2, target_pb2_grpc
from target_service.engine import TargetSequence, generate
from splitspec.models.loader import load_model
from sampling_law import chi_square_pvalue, exact_joint
from tiny_models import save_tiny_model
from tp_ranks import check_sharded

N_NEW = 24
PROMPTS = [[5, 9, 300, 17, 42, 42, 7], [100, 200, 300, 400, 100, 200, 300], [3]]


def test_sharded_models_equal_unsharded_on_two_gloo_ranks(tmp_path):
    """Dense, layer by layer: KV heads split (4 over 2 ranks) and replicated (1 for 2 ranks), Qwen2's
    q/k/v biases, a tied head, a vocabulary of 129 (the last range padded with zero rows).
    Kimi family, whole model and every tap: KimiLinear (KDA heads, convs and state split by heads;
    MLA heads split with the latent cache whole on each rank; a dense first layer; routed + shared
    experts cut along their intermediate); K3's shape (q LoRA, latent MoE, Attention Residuals, the
    MLA output gate, the padded A_log)."""
    from hybrid_models import save_tiny_k3, save_tiny_kimi
    dense = [str(save_tiny_model(tmp_path / arch, arch, vocab_size=129, num_heads=4, num_kv_heads=kv,
                                 tie_word_embeddings=tied, seed=5))
             for arch, kv, tied in [("llama", 4, False), ("qwen3", 1, True), ("qwen2", 2, False)]]
    hybrid = [str(save_tiny_kimi(tmp_path / "kimi")), str(save_tiny_k3(tmp_path / "k3"))]
    tmp.start_processes(check_sharded, args=(2, free_port(), dense, hybrid), nprocs=2, start_method="spawn")


def test_uneven_shapes_are_refused_before_any_rank_starts(tmp_path):
    from target_service import tp_worker
    from splitspec.models.config import ConfigError
    path = save_tiny_model(tmp_path / "m", "qwen3", num_heads=4, num_kv_heads=2)
    with pytest.raises(ConfigError, match="does not divide num_attention_heads=4"):
        tp_worker.start(path, 3, dtype=torch.float32, device=torch.device("cpu"), timeout_s=10)
    from hybrid_models import save_tiny_kimi
    kimi = save_tiny_kimi(tmp_path / "kimi")       # 2 KDA heads
    with pytest.raises(ConfigError, match="does not divide"):
        tp_worker.start(kimi, 4, dtype=torch.float32, device=torch.device("cpu"), timeout_s=10)


@pytest.mark.parametrize("arch", ["qwen3", "kimi", "default"])
def test_driver_decodes_and_verifies_trees_like_one_process(tmp_path, arch):
    """Rank 0 drives a spawned rank 1: greedy decode, taps, and a verify whose accepted node is a
    second branch (its K/V, or MLA latent row, is copied down on rank 0 and, at the next forward,
    on rank 1)."""
    from splitspec.engine.tree import Tree
    from target_service import tp_worker
    from target_service.pools import make_pool
    if arch == "kimi":      # KDA + MLA + MoE: the workers replay rank 0's state commits of the kept path
        from hybrid_models import save_tiny_kimi
        path = save_tiny_kimi(tmp_path / "m", vocab_size=130, seed=11)
    elif arch == "default":  # the bundled target (Qwen3, 8 layers): TP=2 equals TP=1 on it too
        from splitspec_tools.defaults import DEFAULT_TARGET, model_dir
        path = model_dir(None, DEFAULT_TARGET)
    else:
        path = save_tiny_model(tmp_path / "m", "qwen3", vocab_size=130, num_heads=4, num_kv_heads=2, seed=11)
    ref = load_model(path)
    drv = tp_worker.start(path, 2, dtype=torch.float32, device=torch.device("cpu"), timeout_s=60)
    try:
        pool = make_pool(drv, num_blocks=32, block_size=4)
        prompt = [5, 7, 9, 11, 3, 100, 120]
        a = TargetSequence(ref, prompt, max_len=128, hidden_layers=(0, 1), block_size=4)
        b = TargetSequence(drv, prompt, max_len=128, hidden_layers=(0, 1), pool=pool)
        oa, ob = a.prefill(), b.prefill()
        assert oa.committed == ob.committed
        torch.testing.assert_close(ob.hidden, oa.hidden, rtol=1e-4, atol=1e-4)
        for _ in range(3):
            assert a.decode().committed == b.decode().committed
        for _ in range(4):
            # The greedy next token as the SECOND child of the root, a wrong one first: the
            # accepted path is [root, node 1], so node 1's K/V moves to the root's next slot.
            nxt = generate(ref, a.tokens, 2)
            wrong = (nxt[0] + 1) % 130
            tree = Tree([wrong, nxt[0], nxt[1]], [-1, -1, 1])
            va, vb = a.verify(tree), b.verify(tree)
            assert va.committed == vb.committed and va.result.accepted == [1, 2]
            torch.testing.assert_close(vb.hidden, va.hidden, rtol=1e-4, atol=1e-4)
        for _ in range(4):
            assert a.decode().committed == b.decode().committed
        assert drv.sends > 0 and drv.send_bytes > 0
    finally:
        drv.close()


# ---- through the services ----------------------------------------------------------------------

@pytest.fixture(scope="module", params=[("llama", 2), ("qwen3", 1)], ids=["llama-kv-split", "qwen3-kv-replicated"])
def tp_stack(request, tmp_path_factory):
    """A TP=2 target (+ a DFlash draft and a gateway), its checkpoint, and the TP=1 engine."""
    arch, kv = request.param
    root = tmp_path_factory.mktemp(arch)
    path = save_tiny_model(root / "target", arch, vocab_size=VOCAB, num_heads=4, num_kv_heads=kv,
                           tokenizer=True, max_position_embeddings=256, seed=2)
    model = load_model(path)
    draft = root / "draft"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=4, mask_token_id=2, seed=3), draft)
    with running_target(path, root, "--tensor-parallel-size", "2", "--torch-threads", "1") as target, \
            running_draft(path, root, "--torch-threads", "1", draft_dir=draft) as drafter, \
            running_gateway(target, root, "--draft", drafter.address, "--draft-timeout-ms", "60000") as gw:
        yield target, gw, path, model


def _hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_greedy_through_tp2_services_equals_transformers_and_tp1(tp_stack):
    target, gw, path, model = tp_stack
    info = target_info(target.address)
    assert info.tensor_parallel_size == 2 and "tp=2" in info.parallel_layout
    ch, stub = gateway_stub(gw.address)
    with ch:
        for prompt in PROMPTS:
            want = generate(model, prompt, N_NEW)
            assert want == _hf_greedy(path, prompt, N_NEW)
            for method in ("dflash", "none"):
                req = build_request(prompt, max_new_tokens=N_NEW, ignore_eos=True, method=method)
                if method == "dflash":
                    req.speculative.num_draft_tokens, req.speculative.num_steps = 4, 3
                ids, _, complete = collect(stub.Generate(req, timeout=120))
                assert ids == want, (method, prompt)
                assert complete.stats.method == method
                if method == "dflash":
                    # verify_steps counts target-only Decode steps too: drafted tokens say it speculated
                    assert complete.stats.draft_fallbacks == 0 and complete.stats.draft_tokens > 0


def _tp_workers(pid: int) -> list[int]:
    """The spawned ranks among a target's children (not multiprocessing's resource tracker)."""
    # Per thread: the ranks are spawned by the engine thread, not the main one.
    kids = [k for task in Path(f"/proc/{pid}/task").iterdir() for k in (task / "children").read_text().split()]
    return [int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_killed_rank_fails_the_request_over_and_takes_the_replica_out_of_service(tmp_path):
    """A TP=2 replica and a TP=1 one behind a gateway: a rank of the TP=2 replica is killed while
    it streams a request; the request finishes on the other replica with the same greedy tokens,
    and the TP=2 replica turns NOT_SERVING and refuses new sessions with the reason, still up."""
    path = tiny_target_dir(256)
    model = load_model(path)
    prompt = [7, 300, 12, 99, 41]
    n = 160
    want = generate(model, prompt, n)
    with running_target(path, tmp_path, "--tensor-parallel-size", "2", "--torch-threads", "1") as tp2, \
            running_target(path, tmp_path, "--torch-threads", "1") as tp1, \
            running_gateway(f"{tp2.address},{tp1.address}", tmp_path, "--speculative-algorithm", "NONE",
                            "--reconnect-max-s", "0.5") as gw:
        ch, stub = gateway_stub(gw.address)
        with ch:
            # Round robin: of two concurrent requests, one runs on each replica.
            calls = [stub.Generate(build_request(prompt, max_new_tokens=n, ignore_eos=True, method="none"),
                                   timeout=300) for _ in range(2)]
            firsts = [list(next(c).chunk.token_ids) for c in calls]
            assert target_info(tp2.address).active_sessions == 1
            workers = _tp_workers(tp2.proc.pid)
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGKILL)
            finish_with_one_failover(calls, firsts, want)
        wait_not_serving(tp2.address)
        with grpc.insecure_channel(tp2.address) as ch:
            req = target_pb2.TargetRequest(open=target_pb2.TargetOpen(prompt_token_ids=[1, 2, 3]))
            with pytest.raises(grpc.RpcError) as err:
                list(target_pb2_grpc.TargetStub(ch).Session(iter([req]), timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "out of service" in err.value.details()
        assert tp2.proc.poll() is None      # the process stays up to answer health and GetInfo


# ---- n-gram through the dense TP=2 stack; the Kimi family through the services ---------------

NGRAM_PROMPTS = [[11, 250, 37, 11, 250, 37, 11, 250], [400, 7, 99, 18, 400, 7, 99, 18, 400, 7]]


def test_ngram_through_tp2_services_equals_tp1(tp_stack):
    """Prompt lookup through the TP=2 target: the prompts repeat, so the gateway's n-gram index
    drafts from the first steps on, and the verified output is TP=1's greedy output."""
    _, gw, _, model = tp_stack
    ch, stub = gateway_stub(gw.address)
    with ch:
        for prompt in NGRAM_PROMPTS:
            req = build_request(prompt, max_new_tokens=N_NEW, ignore_eos=True, method="ngram")
            req.speculative.num_draft_tokens = 4
            ids, _, complete = collect(stub.Generate(req, timeout=120))
            assert ids == generate(model, prompt, N_NEW), prompt
            assert complete.stats.method == "ngram" and complete.stats.draft_tokens > 0


SMALL_VOCAB = 16        # small enough that a random draft's token is often among the target's top 3
HYBRID_PROMPTS = [[5, 9, 3, 12, 7, 5, 9, 3, 12, 7, 5], [4, 4, 8, 15, 6, 8, 15, 6, 8], [3, 11, 13]]


@contextlib.contextmanager
def _hybrid_tp_stack(root: Path, family: str):
    """A TP=2 Kimi-family target (KimiLinear: KDA + MLA + MoE; DeepSeek-V3: MLA + grouped-routing
    MoE), a DFlash draft and a gateway; yields (target, gateway, checkpoint, TP=1 model)."""
    from hybrid_models import save_tiny_deepseek, save_tiny_kimi
    from tiny_models import save_tiny_tokenizer
    if family == "kimi":
        path = save_tiny_kimi(root / "target", vocab_size=SMALL_VOCAB, tokenizer=True, seed=4)
        taps = (1, 3)       # a KDA layer and the last (MLA) one
    else:
        path = save_tiny_tokenizer(save_tiny_deepseek(root / "target", vocab_size=SMALL_VOCAB, seed=4), SMALL_VOCAB)
        taps = None
    model = load_model(path)
    draft = root / "draft"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=4, mask_token_id=2, target_layer_ids=taps, seed=3),
               draft)
    with running_target(path, root, "--tensor-parallel-size", "2", "--torch-threads", "1") as target, \
            running_draft(path, root, "--torch-threads", "1", draft_dir=draft) as drafter, \
            running_gateway(target, root, "--draft", drafter.address, "--draft-timeout-ms", "60000") as gw:
        yield target, gw, path, model


@pytest.fixture(scope="module")
def kimi_tp_stack(tmp_path_factory):
    with _hybrid_tp_stack(tmp_path_factory.mktemp("kimi-tp"), "kimi") as stack:
        yield stack


@pytest.fixture(scope="module")
def deepseek_tp_stack(tmp_path_factory):
    with _hybrid_tp_stack(tmp_path_factory.mktemp("deepseek-tp"), "deepseek") as stack:
        yield stack


def _hf_argmax(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation, eos included among the candidates: the services'
    ignore_eos keeps eos sampleable, while generate's min_new_tokens would mask it (with 16 tokens
    eos is the argmax now and then)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


@pytest.mark.usefixtures("torch_one_thread")
@pytest.mark.parametrize("family", ["kimi", "deepseek"])
def test_kimi_family_greedy_through_tp2_services_equals_transformers_and_tp1(request, family):
    """dflash, ngram and none, three streams at a time (batched TP forwards over several
    sessions' KDA state rows and MLA latent rows): each equals the TP=1 engine and transformers."""
    target, gw, path, model = request.getfixturevalue(f"{family}_tp_stack")
    info = target_info(target.address)
    assert info.tensor_parallel_size == 2 and "MLA heads 1/rank" in info.parallel_layout
    if family == "kimi":
        assert "KDA heads and state 1/rank" in info.parallel_layout
    refs = [generate(model, p, N_NEW) for p in HYBRID_PROMPTS]
    assert refs == _hf_argmax(path, HYBRID_PROMPTS, N_NEW)

    def run(case):
        prompt, method = case
        req = build_request(prompt, max_new_tokens=N_NEW, ignore_eos=True, method=method)
        if method != "none":
            req.speculative.num_draft_tokens = 3
        return collect(stub.Generate(req, timeout=300))
    cases = [(p, m) for m in ("dflash", "ngram", "none") for p in HYBRID_PROMPTS]
    ch, stub = gateway_stub(gw.address)
    with ch, ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, cases))
    for (prompt, method), (ids, _, complete) in zip(cases, results):
        assert ids == refs[HYBRID_PROMPTS.index(prompt)], (method, prompt)
        st = complete.stats
        assert st.method == method and st.draft_fallbacks == 0
        # 16 tokens over 24 generated: every prompt repeats a token, so n-gram drafts too
        assert (st.draft_tokens > 0) == (method != "none"), (method, prompt)


@pytest.mark.usefixtures("torch_one_thread")
def test_sampled_speculation_through_tp2_follows_the_target_distribution(kimi_tp_stack):
    """T=1 / top-k 3, seeded, greedy DFlash drafts verified by the TP=2 KimiLinear target: the
    joint of the first tokens equals the exact target distribution computed in process (TP=1).
    Three tokens, not two: the first comes from the prefill and the gateway drafts only when at
    least two tokens remain, so the second is the verified draft (or the residual's sample) and
    the third the bonus after an accepted draft (or a decode after a rejected one).
    Power: the test requires drafts both accepted and rejected often (88 of 400 accepted), so a
    wrong rule shows. Checked locally on a copy of the tree: with verify.py's rejection rule
    broken (`p[x] = 0.0` dropped, so the rejected draft token stays in the residual) the same 400
    seeded samples give p = 1.5e-8; correct, p = 0.77. Far smaller errors are not caught at this
    size (the T=1.2 joint as the expectation gives p = 0.9)."""
    _, gw, _, model = kimi_tp_stack
    prompt = [10, 8, 12, 6, 11]     # the draft's first guess is often among the target's top 3 here
    n, samples = 3, 400
    joint = exact_joint(model, prompt, SamplingParams(temperature=1.0, top_k=3), n)
    ch, stub = gateway_stub(gw.address)
    with ch:
        results = sampled_runs(stub, prompt, n, samples, method="dflash", draft_sampling="greedy")
    counts = collections.Counter(ids for ids, _ in results)
    assert set(counts) <= set(joint)
    assert all(st.draft_fallbacks == 0 and st.steps[0].k == 1 for _, st in results)
    accepted = sum(1 for _, st in results if st.steps[0].accepted)
    print(f"TP=2 distribution: {accepted} of {samples} first drafts accepted, {len(counts)} of {len(joint)} "
          f"continuations seen")
    assert samples // 10 <= accepted <= samples - samples // 10
    assert chi_square_pvalue(counts, joint, samples) > 1e-3


def test_kda_prefix_hits_through_tp2_services(kimi_tp_stack):
    """A prefix-cache hit on a TP=2 KimiLinear target: rank 0 copies the checkpointed KDA state
    into the session's slot and rank 1 replays the copy (its share of the heads) before the next
    forward, so the second request resumes at block 32 and still equals the TP=1 engine."""
    _, gw, _, model = kimi_tp_stack
    prefix = [(5 * i) % 13 + 2 for i in range(40)]      # the tiny vocabulary has 16 ids
    ch, stub = gateway_stub(gw.address)
    with ch:
        cached = []
        for q in ([3, 7], [4, 7], [3, 7]):
            for method in ("dflash", "none"):
                req = build_request(prefix + q, max_new_tokens=N_NEW, ignore_eos=True, method=method)
                req.cache_salt = "tp-kda"
                ids, _, complete = collect(stub.Generate(req, timeout=300))
                assert ids == generate(model, prefix + q, N_NEW), (q, method)
                cached.append(complete.usage.cached_tokens)
    # The first request computes the prefix; every later one, drafted or not, resumes at 32 (the
    # blocks carry the draft's tap rows, which target-only requests compute and store too).
    assert cached == [0] + [32] * 5
