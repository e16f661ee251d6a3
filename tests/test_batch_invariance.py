"""Batch-invariant forwards (`--batch-invariant`, attention "torch-exact"): at bfloat16 a token's
logits are the same bits whether it is decoded alone, verified as a row of a draft chain or a
tree, or decoded beside other sessions, so greedy speculation equals target-only decoding.

Two things differ otherwise, both measured on this CPU: SDPA over a key list padded with
masked keys (a verify row, a batch of decode rows) reduces its last block in another order than
over the exact keys; and the BLAS multiplies a single row with another kernel than 2+ rows."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from splitspec.engine.sample import SamplingParams
from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence
from splitspec.models.loader import load_model
from target_service.pools import make_pool
from target_service.runner import Decode, run_batch
from target_service.torch_verifier import TorchVerifier
from tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Wide enough (K = 1536 in the down projection, as SmolLM2's) for the one-row kernel to differ.
    path = save_tiny_model(tmp_path_factory.mktemp("bi"), "llama", vocab_size=512, hidden_size=256,
                           intermediate_size=1536, num_layers=2, num_heads=4, num_kv_heads=2, seed=21)
    return load_model(path, dtype="bfloat16")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A random Qwen2 of Qwen2-1.5B's width (hidden 1,536, tied embeddings), 2 layers and a 4,096
    vocabulary to stay fast: at K = 1,536 and N >= 2,048 this CPU's bf16 GEMM gives a lone row other
    last bits than the same row among 2+, in lm_head as in the body. Real-model-sized weights
    (initializer 0.02) keep the logits close enough for a flipped bit to matter."""
    path = save_tiny_model(tmp_path_factory.mktemp("wide"), "qwen2", vocab_size=4096, hidden_size=1536,
                           intermediate_size=2048, num_layers=2, num_heads=12, num_kv_heads=2,
                           tie_word_embeddings=True, initializer_range=0.02, seed=63)
    return load_model(path, dtype="bfloat16")


def _lm_head_outputs(model):
    """Hook lm_head: the logits it returns (every row) and the row count each call multiplied."""
    got, counts = [], []
    orig = model.lm_head.forward

    def hook(x):
        out = orig(x)
        counts.append(x.reshape(-1, x.shape[-1]).shape[0])
        got.append(out.detach().reshape(-1, out.shape[-1]).clone())
        return out
    model.lm_head.forward = hook
    return got, counts, lambda: setattr(model.lm_head, "forward", orig)


def _lm_head_inputs(model):
    rows = []
    orig = model.lm_head.forward

    def hook(x):
        rows.append(x.detach().reshape(-1, x.shape[-1]).clone())
        return orig(x)
    model.lm_head.forward = hook
    return rows, lambda: setattr(model.lm_head, "forward", orig)


PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(40 + 23 * i)] for i in range(6)]


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_a_verify_row_is_the_decode_row_bit_for_bit(model, prompt):
    rows, restore = _lm_head_inputs(model)
    try:
        ref = TargetSequence(model, prompt, max_len=len(prompt) + 40, attention="torch-exact")
        greedy = [ref.prefill().committed[0]]
        rows.clear()
        for _ in range(8):
            greedy.append(ref.decode().committed[0])
        decoded = torch.cat([r[:1] for r in rows[:8]])     # a lone row is multiplied twice; the first is read
        spec = TargetSequence(model, prompt, max_len=len(prompt) + 40, attention="torch-exact")
        spec.prefill()
        rows.clear()
        out = spec.verify(Tree.chain(greedy[1:8]))
        assert torch.equal(rows[-1][:8], decoded)
        assert out.committed == greedy[1:9]
        # A tree whose second branch holds the greedy chain: its nodes see only their ancestors.
        spec2 = TargetSequence(model, prompt, max_len=len(prompt) + 40, attention="torch-exact")
        spec2.prefill()
        wrong = (greedy[1] + 1) % 500
        tree = Tree((wrong, greedy[1], greedy[2], greedy[3]), (-1, -1, 1, 2))
        assert spec2.verify(tree).committed == greedy[1:5]
    finally:
        restore()


def test_greedy_speculation_equals_target_only_on_every_prompt(model):
    for prompt in PROMPTS:
        ref = TargetSequence(model, prompt, max_len=len(prompt) + 60, attention="torch-exact")
        greedy = [ref.prefill().committed[0]]
        while len(greedy) < 48:
            greedy.append(ref.decode().committed[0])
        spec = TargetSequence(model, prompt, max_len=len(prompt) + 60, attention="torch-exact")
        got = [spec.prefill().committed[0]]
        while len(got) < 48:
            got += spec.verify(Tree.chain(greedy[len(got):len(got) + 5])).committed
        assert got[:48] == greedy


def test_a_decode_beside_other_sessions_is_the_decode_alone(model):
    """Target-only decoding at many streams equals it at one stream."""
    pool = make_pool(model, num_blocks=64, block_size=16)
    seqs = [TargetSequence(model, p, max_len=len(p) + 20, pool=pool, attention="torch-exact") for p in PROMPTS[:4]]
    alone = [TargetSequence(model, p, max_len=len(p) + 20, attention="torch-exact") for p in PROMPTS[:4]]
    for s in seqs + alone:
        s.prefill()
    for _ in range(6):
        together = run_batch(model, pool, TorchVerifier(), [Decode(s.seq) for s in seqs], "torch-exact")
        for out, s in zip(together, alone):
            assert out.committed == s.decode().committed


def test_the_service_turns_it_on_for_bf16_dense_targets(model):
    import argparse
    from target_service.server import attention_mode
    args = argparse.Namespace(batch_invariant="auto", attention_backend="torch", tensor_parallel_size=1)
    assert attention_mode(args, model) == "torch-exact"
    model_f32 = type(model).__new__(type(model))
    torch.nn.Module.__init__(model_f32)
    model_f32.cfg = model.cfg
    model_f32.register_parameter("w", torch.nn.Parameter(torch.zeros(1)))
    assert attention_mode(args, model_f32) == "torch"
    args.batch_invariant = "off"
    assert attention_mode(args, model) == "torch"


def test_prefill_chunking_does_not_change_a_bit(model):
    """A prefix-cache hit resumes a prompt at a block boundary: the prompt's tokens, prefilled
    in chunks ending on any multiples of 16, give the same bits as one chunk."""
    prompt = PROMPTS[5]
    rows, restore = _lm_head_inputs(model)
    try:
        seen = []
        for chunk in (512, 16, 48):
            s = TargetSequence(model, prompt, max_len=len(prompt) + 20, attention="torch-exact", prefill_chunk=chunk)
            rows.clear()
            tokens = [s.prefill().committed[0]] + [s.decode().committed[0] for _ in range(6)]
            seen.append((tokens, torch.cat([r[-2:-1] for r in rows])))
        for tokens, bits in seen[1:]:
            assert tokens == seen[0][0] and torch.equal(bits, seen[0][1])
    finally:
        restore()


@pytest.mark.parametrize("prefilled,n,prompt_len,end", [
    (0, 512, 1000, 512), (0, 500, 1000, 496), (0, 1000, 150, 150), (96, 10, 150, 96), (96, 16, 150, 112),
    (100, 30, 150, 128), (144, 6, 150, 150), (144, 3, 150, 144), (0, 7, 150, 0)])
def test_exact_prefill_chunks_end_on_span_boundaries(prefilled, n, prompt_len, end):
    from target_service.scheduler import exact_chunk_end
    assert exact_chunk_end(prefilled, n, prompt_len) == end


@settings(max_examples=400, deadline=None)
@given(blocks=st.integers(0, 64), n=st.integers(1, 600), extra=st.integers(1, 700),
       span=st.sampled_from([1, 4, 16, 32]))
def test_an_exact_prefill_chunk_never_runs_past_its_budget(blocks, n, extra, span):
    """Property: from a block boundary (where every chunk and every cache hit ends) a chunk ends
    on a boundary or the prompt's end, within the n tokens it was given, as far as it can, and
    moves on whenever it was given a span or the rest of the prompt."""
    from target_service.scheduler import exact_chunk_end
    prefilled = blocks * span
    prompt_len = prefilled + extra
    end = exact_chunk_end(prefilled, n, prompt_len, span)
    assert prefilled <= end <= min(prefilled + n, prompt_len)
    assert end == prompt_len or end % span == 0
    assert end == prompt_len or end + span > prefilled + n          # no further boundary was within reach
    if n >= span or prefilled + n >= prompt_len:
        assert end > prefilled


def test_a_batch_invariant_target_keeps_its_forwards_in_the_measured_row_range(model):
    """--max-num-batched-tokens above the 512 rows measured row-invariant is clamped at start-up,
    a prefill share below one KV block raised to one, each saying so; a scheduled forward then
    never holds more query rows than the budget, even where prompts arriving together get shares
    smaller than a block."""
    from structlog.testing import capture_logs

    from scheduler_helpers import run_scheduler
    from target_service.scheduler import exact_budgets

    with capture_logs() as logs:
        assert exact_budgets(4096, 8, 16) == (512, 16)
        assert exact_budgets(512, 128, 16) == (512, 128)
    assert [e["event"] for e in logs] == ["max_num_batched_tokens_clamped", "chunked_prefill_size_raised"]
    assert logs[0]["used"] == 512 and logs[0]["requested"] == 4096
    with pytest.raises(ValueError, match="kv-block-size 1024"):
        exact_budgets(4096, 128, 1024)

    seen = []
    orig = model.forward_batch

    def spy(input_ids, positions, batch, **kw):
        seen.append(len(input_ids))
        return orig(input_ids, positions, batch, **kw)

    async def body(sched):
        import asyncio
        from splitspec.engine.sample import SamplingParams
        opens = [sched.open(str(i), p, SamplingParams(), max_new_tokens=4) for i, p in enumerate(PROMPTS[:4])]
        await asyncio.gather(*opens)
        return sched.max_batched_tokens, sched.chunked_prefill_size

    model.forward_batch = spy
    try:
        budget, chunk = run_scheduler(model, body, pool=make_pool(model, num_blocks=128, block_size=4),
                                      attention="torch-exact", max_batched_tokens=37, chunked_prefill_size=3,
                                      max_context=512)
    finally:
        del model.forward_batch
    assert (budget, chunk) == (37, 4)
    assert seen and max(seen) <= budget


def test_sampled_speculation_follows_the_target_law_in_exact_mode(model):
    """At T=1 the exact path verifies a sampled draft with the same rule as the plain one: the
    first 3 tokens of many seeded runs (prefill, then chains of 2 drafted from a fixed q, each
    verified with that q) follow target-only's law (chi-square), drafts rejected and accepted."""
    from sampling_law import SAMPLED, assert_follows, exact_joint
    from splitspec.engine.sample import make_generator, sample_from_probs
    prompt = PROMPTS[1][:24]
    joint = exact_joint(model, prompt, SAMPLED, 3)
    # The draft's q, the same at every position: uniform over every token the target could say
    # in these 3 steps, so drafts are accepted and rejected alike.
    support = sorted({t for answer in joint for t in answer})
    q = torch.zeros(model.cfg.vocab_size)
    q[support] = 1.0 / len(support)
    answers, accepted, drafted, n = [], 0, 0, 600
    for seed in range(n):
        seq = TargetSequence(model, prompt, SamplingParams(temperature=1.0, top_k=3, seed=seed),
                             max_len=len(prompt) + 16, attention="torch-exact")
        draw = make_generator(10_000 + seed)
        got = list(seq.prefill().committed)
        while len(got) < 3:
            chain = [sample_from_probs(q, draw) for _ in range(2)]
            out = seq.verify(Tree.chain(chain), torch.stack([q, q]))
            accepted += len(out.committed) - 1
            drafted += 2
            got += out.committed
        answers.append(tuple(got[:3]))
    assert 0 < accepted < drafted
    assert_follows(answers, joint, n)


def test_a_batch_invariant_target_keeps_its_threads_for_every_forward(model):
    """A forward's bits depend on its intra-op thread count (SDPA's CPU kernel gives a head other
    last bits on another OpenMP thread), so a batch-invariant target verifies on the threads its
    target-only decodes ran on: neither --verify-torch-threads nor a core-sharing change moves it.
    A plain target still gives a co-located draft its threads."""
    from scheduler_helpers import run_scheduler

    async def body(sched):
        start = sched.exact_threads
        sched._draft_busy = lambda steps: True          # sessions drafting with a model: verify threads
        sched.threads = start + 3                       # a core-sharing change
        exact = sched._forward_threads([])
        sched.attention = "torch"
        return start, exact, sched._forward_threads([])

    start, exact, plain = run_scheduler(model, body, attention="torch-exact", verify_threads=1)
    assert start == torch.get_num_threads()
    assert exact == start
    assert plain == 1


def test_sessions_whose_blocks_interleave_decode_the_bits_of_a_session_alone(model):
    """Sessions that took their blocks in turns (so a row's blocks are not consecutive in the
    pool) read their keys from blocks gathered once a layer; sessions alone in a pool read them
    in place. The same keys, the same layout: the same bits."""
    rows, restore = _lm_head_inputs(model)
    try:
        shared = make_pool(model, num_blocks=128, block_size=4)
        mixed = [TargetSequence(model, p, max_len=len(p) + 24, pool=shared, attention="torch-exact")
                 for p in PROMPTS[1:3]]
        alone = [TargetSequence(model, p, max_len=len(p) + 24, pool=make_pool(model, num_blocks=64, block_size=4),
                                attention="torch-exact") for p in PROMPTS[1:3]]
        for s in mixed + alone:
            s.prefill()
        together, apart = [], []
        for _ in range(12):
            rows.clear()
            outs = run_batch(model, shared, TorchVerifier(), [Decode(s.seq) for s in mixed], "torch-exact")
            together.append((torch.cat(rows), [o.committed for o in outs]))
            rows.clear()
            outs = [s.decode().committed for s in alone]
            apart.append((torch.cat([r[:1] for r in rows]), outs))
        blocks = mixed[0].seq.table.blocks
        assert blocks != list(range(blocks[0], blocks[0] + len(blocks)))       # the gathered path ran
        for (x, a), (y, b) in zip(together, apart):
            assert a == b
            assert torch.equal(x, y)
    finally:
        restore()


@pytest.mark.parametrize("attention,least", [("torch-exact", 2), ("torch", 1)])
def test_lm_head_never_multiplies_a_lone_row_in_exact_mode(model, attention, least):
    """A prompt's last chunk and a decode alone have one logits row; the exact path hands lm_head
    two (the plain path, which does not, shows the hook sees the count)."""
    got, counts, restore = _lm_head_outputs(model)
    try:
        s = TargetSequence(model, PROMPTS[0], max_len=len(PROMPTS[0]) + 8, attention=attention)
        s.prefill()
        for _ in range(3):
            s.decode()
    finally:
        restore()
    assert len(counts) == 4 and min(counts) == least


def test_a_verify_rows_logits_are_the_decode_logits_at_hidden_1536(wide):
    """lm_head's output, not just its input: each token's logits are the same bits decoded alone
    and verified as a row of a chain, on a target wide enough for the one-row GEMM to differ."""
    prompt = [(11 * j) % 4000 + 7 for j in range(45)]
    got, _, restore = _lm_head_outputs(wide)
    try:
        ref = TargetSequence(wide, prompt, max_len=len(prompt) + 24, attention="torch-exact")
        greedy = [ref.prefill().committed[0]]
        got.clear()
        for _ in range(8):
            greedy.append(ref.decode().committed[0])
        decoded = torch.cat([g[:1] for g in got])
        spec = TargetSequence(wide, prompt, max_len=len(prompt) + 24, attention="torch-exact")
        spec.prefill()
        got.clear()
        out = spec.verify(Tree.chain(greedy[1:8]))
    finally:
        restore()
    assert out.committed == greedy[1:9]
    assert torch.equal(got[-1], decoded)


def _wide_prompts(n: int, longest: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1536)
    return [torch.randint(3, 4096, (int(torch.randint(8, longest, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _diverging(model, prompts, new_tokens: int, width: int = 6) -> list[int]:
    """Indices of the prompts whose greedy speculation (a perfect drafter: chains of target-only's
    own continuation, every verify row compared) leaves target-only decoding."""
    bad = []
    for i, prompt in enumerate(prompts):
        max_len = len(prompt) + new_tokens + width + 2
        ref = TargetSequence(model, prompt, max_len=max_len, attention="torch-exact")
        greedy = [ref.prefill().committed[0]]
        while len(greedy) < new_tokens:
            greedy.append(ref.decode().committed[0])
        spec = TargetSequence(model, prompt, max_len=max_len, attention="torch-exact")
        got = [spec.prefill().committed[0]]
        while len(got) < new_tokens and got == greedy[:len(got)]:
            got += spec.verify(Tree.chain(greedy[len(got):len(got) + width - 1])).committed
        if got[:new_tokens] != greedy[:len(got[:new_tokens])]:
            bad.append(i)
    return bad


def test_greedy_speculation_equals_target_only_at_hidden_1536(wide):
    assert _diverging(wide, _wide_prompts(20, 64), new_tokens=16) == []


@pytest.mark.slow
def test_greedy_speculation_equals_target_only_at_hidden_1536_on_200_prompts(wide):
    assert _diverging(wide, _wide_prompts(200, 160), new_tokens=32) == []
