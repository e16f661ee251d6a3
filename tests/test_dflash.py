"""DFlash drafter: forward equals a from-scratch reference, the draft cache is exact across
steps, checkpoints round-trip, and the in-process speculative loop is lossless."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from draft_service.architectures import load_draft
from draft_service.dflash import (DFlashConfig, DraftCache, default_target_layer_ids, draft_block, draft_blocks, new_draft,
                                 new_pool, save_draft)
from draft_service.proposer import DFlashProposer, NgramProposer, ProposerError
from splitspec.ngram import lookup
from splitspec_tools.speculate import speculative_generate
from splitspec.models.config import ConfigError
from target_service.engine import TargetSequence, forward_sequences, generate
from splitspec.models.loader import load_model
from splitspec.engine.sample import SamplingParams, probs_from_logits
from sampling_law import chi_square_pvalue
from tiny_models import rough_draft


def make_draft(target, block_size=4, num_layers=2, seed=0):
    d = new_draft(target.cfg, num_layers=num_layers, block_size=block_size,
                  mask_token_id=target.cfg.vocab_size - 1, seed=seed,
                  target_layer_ids=[0, target.cfg.num_hidden_layers - 1])
    return rough_draft(d, target, seed=seed + 7, std=0.2).eval()


def reference_block_logits(d, features, last_token, position, window=None):
    """DFlash written out directly: no cache, explicit softmax attention, every K/V recomputed;
    with `window`, each query attends exactly to the keys fewer than `window` positions away."""
    cfg = d.cfg
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    C, B = features.shape[0], cfg.block_size

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def rope(x, pos):   # x [T, heads, hd]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cos(ang).repeat(1, 2)[:, None], torch.sin(ang).repeat(1, 2)[:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    ctx = rms(features @ d.fc.weight.T, d.hidden_norm.weight)            # [C, H]
    ids = torch.tensor([last_token] + [cfg.mask_token_id] * (B - 1))
    x = d._target["embed"][ids]
    ctx_pos, blk_pos = torch.arange(C), torch.arange(position, position + B)
    for layer in d.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        q = rope(rms((h @ a.q_proj.weight.T).view(B, nh, hd), a.q_norm.weight), blk_pos)
        kin = torch.cat([ctx, h])
        k = rms((kin @ a.k_proj.weight.T).view(C + B, nkv, hd), a.k_norm.weight)
        k = rope(k, torch.cat([ctx_pos, blk_pos]))
        v = (kin @ a.v_proj.weight.T).view(C + B, nkv, hd)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        if window:
            dist = blk_pos[:, None] - torch.cat([ctx_pos, blk_pos])[None, :]
            scores = scores.masked_fill(dist.abs() >= window, float("-inf"))
        att = torch.softmax(scores, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(B, nh * hd)
        x = x + o @ a.o_proj.weight.T
        h = rms(x, layer.post_attention_layernorm.weight)
        m = layer.mlp
        x = x + (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    x = rms(x, d.norm.weight)
    return (x @ d._target["lm_head"].T)[1:]


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3", vocab_size=64, seed=31))


def test_forward_matches_reference(target):
    d = make_draft(target, block_size=5)
    feats = torch.randn(9, d.cfg.target_feature_size)
    cache = DraftCache(d, 64)
    cache.append(d, feats[:4])
    cache.append(d, feats[4:])            # appended in two pieces on purpose
    with torch.no_grad():
        got = draft_block(d, cache, last_token=7, position=9)
        want = reference_block_logits(d, feats, 7, 9)
    assert got.shape == (4, target.cfg.vocab_size)
    assert (got - want).abs().max().item() < 1e-5


def test_windowed_propose_attends_to_exactly_the_window(target):
    """A draft whose layers all slide (W = 12) on a 300-token context equals the reference that
    masks every key W or more positions from its query, alone and batched with a row whose context
    is shorter than the window; without the window the result differs."""
    import dataclasses
    d = make_draft(target, block_size=5, seed=3)
    W = 12
    d.cfg = dataclasses.replace(d.cfg, layer_types=("sliding_attention",) * 2, sliding_window=W, is_causal=False)
    assert d.cfg.common_window == W
    feats = torch.randn(300, d.cfg.target_feature_size)
    pool = new_pool(d, 64)                 # one pool for both rows, as the draft service shares one
    long_cache, short_cache = DraftCache(d, 400, pool), DraftCache(d, 400, pool)
    long_cache.append(d, feats[:150])
    long_cache.append(d, feats[150:])
    short_cache.append(d, feats[:7])
    with torch.no_grad():
        alone = draft_block(d, long_cache, last_token=9, position=300)
        both = draft_blocks(d, [short_cache, long_cache], [4, 9], [7, 300])
        want_long = reference_block_logits(d, feats, 9, 300, window=W)
        want_short = reference_block_logits(d, feats[:7], 4, 7, window=W)
        unwindowed = reference_block_logits(d, feats, 9, 300)
    assert (alone - want_long).abs().max().item() < 1e-5
    assert (both[1] - want_long).abs().max().item() < 1e-5
    assert (both[0] - want_short).abs().max().item() < 1e-5
    assert (alone - unwindowed).abs().max().item() > 1e-3


def test_windowed_cache_opened_with_an_offset_proposes_what_a_full_cache_does(target):
    """A windowed draft (W = 12: Proposes read the last 11 positions) opened with only the
    prompt's tail (cache offset 100 - 11) proposes, step after step, exactly what the same draft
    opened with all 100 rows proposes; both give back the blocks that fall out of the window (pool
    use stays flat as the session grows), and a full-attention draft refuses a tail."""
    import dataclasses
    from draft_service.proposer import check_hidden_start, context_window
    d = make_draft(target, block_size=5, seed=5)
    full_attention_cw = context_window(d)
    W = 12
    d.cfg = dataclasses.replace(d.cfg, layer_types=("sliding_attention",) * 2, sliding_window=W, is_causal=False)
    cw = context_window(d)
    assert (full_attention_cw, cw) == (0, W - 1)
    g = torch.Generator().manual_seed(11)
    P, n = 100, 60
    feats = torch.randn(P + n, d.cfg.target_feature_size, generator=g)
    ids = torch.randint(3, 60, (P + n + 1,), generator=g).tolist()
    full_pool, tail_pool = new_pool(d, 64, block_size=4), new_pool(d, 64, block_size=4)
    full = DFlashProposer(d, max_len=400, pool=full_pool)
    tail = DFlashProposer(d, max_len=400, pool=tail_pool)
    start = P - cw
    full.open(ids[:P], feats[:P])
    tail.open(ids[:P], feats[start:P], start)
    assert tail.cache.offset == start and tail.cache.length == full.cache.length == P
    assert tail_pool.used_blocks == -(-cw // 4) < full_pool.used_blocks
    base, new_ids, new_h, k = P + 1, [ids[P]], None, 1
    with torch.no_grad():
        while base + k <= P + n:
            a, b = full.propose(base, new_ids, new_h), tail.propose(base, new_ids, new_h)
            assert a.tree == b.tree
            la = draft_block(d, full.cache, ids[base - 1], base - 1)
            lb = draft_block(d, tail.cache, ids[base - 1], base - 1)
            assert (la - lb).abs().max().item() < 1e-5
            # The next step commits k tokens (their features arrive with them).
            new_ids, new_h = ids[base:base + k], feats[base - 1:base - 1 + k]
            base += k
            k = k % 3 + 1
    assert tail.cache.length == full.cache.length
    assert tail.cache.offset > start                          # whole blocks left the window...
    bound = -(-(cw + 4) // 4) + 1
    assert tail_pool.used_blocks <= bound                     # ...and went back to the pool,
    assert full.cache.offset > 0 and full_pool.used_blocks <= bound    # the full cache's too, once proposed
    with pytest.raises(ProposerError, match="context_window = 0"):
        check_hidden_start(make_draft(target, block_size=5), P, start)
    with pytest.raises(ProposerError, match="reads the last 11"):
        check_hidden_start(d, P, P - cw + 1)
    check_hidden_start(d, 5, 0)                               # a short prompt: all of it
    with pytest.raises(ProposerError, match="reads the last 11"):
        check_hidden_start(d, 5, 1)
    full.close(), tail.close()
    assert tail_pool.used_blocks == 0


def test_slot0_is_the_real_last_token(target):
    d = make_draft(target)
    cache = DraftCache(d, 32)
    cache.append(d, torch.randn(5, d.cfg.target_feature_size))
    with torch.no_grad():
        a = draft_block(d, cache, 3, 5)
        b = draft_block(d, cache, 4, 5)
    assert not torch.allclose(a, b)


def test_draft_cache_after_many_steps_equals_from_scratch(target):
    """Features arrive in pieces from verify steps (rejected tokens never enter); drafting
    from that cache must equal drafting from a fresh cache over the same committed context."""
    d = make_draft(target, block_size=4)
    layers = d.cfg.target_layer_ids
    seq = TargetSequence(target, [5, 9, 2, 11, 7], SamplingParams(temperature=1.0, seed=3),
                         max_len=256, hidden_layers=layers)
    prop = DFlashProposer(d, max_len=256)
    first = seq.prefill()
    prop.open(list(seq.prompt), first.hidden)
    new_ids, new_hidden = first.committed, None
    for _ in range(12):
        p = prop.propose(seq.length, new_ids, new_hidden)
        step = seq.verify(p.tree)
        new_ids, new_hidden = step.committed, step.hidden
    prop._commit(seq.length, new_ids)
    prop.cache.append(d, new_hidden)
    assert prop.cache.length == seq.length - 1
    # From scratch: one causal forward of the committed context gives every feature.
    full = forward_sequences(target, torch.tensor(seq.tokens[:-1]), hidden_layers=layers).hidden[0]
    with torch.no_grad():
        fresh = DraftCache(d, 256)
        fresh.append(d, full)
        a = draft_block(d, prop.cache, seq.tokens[-1], seq.length - 1)
        b = draft_block(d, fresh, seq.tokens[-1], seq.length - 1)
    assert (a - b).abs().max().item() < 1e-4


def test_checkpoint_roundtrip_and_block_size_meaning(tmp_path, target, tiny_model_factory):
    tdir = tiny_model_factory("qwen3", vocab_size=64, seed=31)
    d = make_draft(target, block_size=6)
    save_draft(d, tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", tdir)
    for (n, a), (_, b) in zip(d.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert loaded.cfg.block_size == 6
    as_count = load_draft(tmp_path / "draft", tdir, block_size_means="draft_count")
    assert as_count.cfg.block_size == 7
    with pytest.raises(ConfigError, match="architectures"):
        DFlashConfig.from_dict({"architectures": ["Qwen3ForCausalLM"]})


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert all(0 <= i < 6 for i in default_target_layer_ids(6, 3))
    # too shallow for z-lab's spread: distinct, increasing layers instead of [1, 1] / [1, 0]
    assert default_target_layer_ids(4, 2) == [0, 3] and default_target_layer_ids(3, 2) == [0, 2]


def test_ngram_lookup_prefers_longest_recent_match():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3]
    assert lookup(toks, 3, 1, 3) == [5, 7, 2]
    assert lookup([1, 2, 3], 3, 1, 3) == []
    prop = NgramProposer(num_draft_tokens=3)
    prop.open([1, 2, 1])
    with pytest.raises(ProposerError, match="base_len"):
        prop.propose(9, [2], None)


@pytest.mark.parametrize("method", ["dflash", "ngram"])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_greedy_speculative_equals_target_only(target, method, width):
    d = make_draft(target, block_size=8)
    rng = random.Random(width)
    for _ in range(4):
        prompt = [rng.randrange(60) for _ in range(rng.randrange(1, 12))]
        ref = generate(target, prompt, 40)
        prop = (DFlashProposer(d, num_draft_tokens=width, max_len=128) if method == "dflash"
                else NgramProposer(num_draft_tokens=width))
        seq = TargetSequence(target, prompt, max_len=128, hidden_layers=d.cfg.target_layer_ids)
        out, st = speculative_generate(seq, prop, 40)
        assert out == ref
        assert 1.0 <= st.accept_length <= width


def exact_joint(target, prompt, params, n=2):
    """Exact target-only probability of each n-token continuation."""
    V = target.cfg.vocab_size
    table = {}
    with torch.no_grad():
        for prefix in itertools.product(range(V), repeat=n - 1):
            logits = forward_sequences(target, torch.tensor(prompt + list(prefix))).logits[0]
            p_first = probs_from_logits(logits[len(prompt) - 1], params)
            p_next = probs_from_logits(logits[-1], params)
            for t in range(V):
                table[prefix + (t,)] = float(p_first[prefix[0]] * p_next[t]) if n == 2 else None
    return table


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.9),
                                    SamplingParams(temperature=0.7, top_k=20)],
                         ids=["t1-topp0.9", "t0.7-topk20"])
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_speculative_sampling_matches_target_distribution(tiny_model_factory, one_thread, params, draft_sampling):
    target = load_model(tiny_model_factory("qwen3", vocab_size=24, seed=41))
    d = make_draft(target, block_size=4, seed=5)
    prompt = [3, 8, 1]
    exact = exact_joint(target, prompt, params)
    n, counts = 2000, {}
    for seed in range(n):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)
        seq = TargetSequence(target, prompt, p, max_len=32, hidden_layers=d.cfg.target_layer_ids)
        prop = DFlashProposer(d, max_len=32,
                              sampling=SamplingParams(params.temperature, params.top_p, params.top_k,
                                                      seed=10_000 + seed) if draft_sampling == "sample" else None)
        out, _ = speculative_generate(seq, prop, 2)
        key = tuple(out[:2])
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, exact, n) > 1e-3
