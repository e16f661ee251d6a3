"""KV cache: accepted-path compaction (`keep`) against a reference list (hypothesis),
rollback (`truncate`) against never having appended, and capacity errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from target_service.config import ModelConfig
from target_service.kv_cache import CacheFullError, KVCache

TINY = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=16, hidden_size=8, intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=3,
                   rms_norm_eps=1e-6, rope_theta=10000.0)


def _filled(max_len: int, length: int) -> KVCache:
    """A cache whose entry at position t holds a value that identifies (layer, head, t, d)."""
    c = KVCache(TINY, max_len)
    L, B, H, T, D = c.k.shape
    ident = torch.arange(L * B * H * T * D, dtype=torch.float32).view(L, B, H, T, D)
    c.k.copy_(ident)
    c.v.copy_(-ident - 1)
    c.length = length
    return c


@st.composite
def keep_case(draw):
    max_len = draw(st.integers(1, 24))
    length = draw(st.integers(0, max_len))
    start = draw(st.integers(0, length))
    avail = list(range(length - start))
    offsets = sorted(draw(st.sets(st.sampled_from(avail), max_size=len(avail)))) if avail else []
    return max_len, length, start, offsets


@settings(max_examples=300, deadline=None)
@given(keep_case())
def test_keep_leaves_exactly_the_selected_entries_contiguous(case):
    max_len, length, start, offsets = case
    c = _filled(max_len, length)
    before_k, before_v = c.k.clone(), c.v.clone()
    # Reference: the cache as a list of per-position entries.
    entries = [(before_k[..., t, :], before_v[..., t, :]) for t in range(length)]
    expected = entries[:start] + [entries[start + o] for o in offsets]
    c.keep(start, offsets)
    assert c.length == start + len(offsets) == len(expected)
    for t, (k, v) in enumerate(expected):
        assert torch.equal(c.k[..., t, :], k), t
        assert torch.equal(c.v[..., t, :], v), t


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_keep_rejects_bad_offsets(data):
    length = data.draw(st.integers(2, 12))
    c = _filled(16, length)
    start = data.draw(st.integers(0, length - 1))
    kind = data.draw(st.sampled_from(["unsorted", "duplicate", "negative", "past_end", "bad_start"]))
    if kind == "unsorted":
        offsets = [1, 0]
    elif kind == "duplicate":
        offsets = [0, 0]
    elif kind == "negative":
        offsets = [-1, 0]
    elif kind == "past_end":
        offsets = [0, length - start]          # one past the last cached entry
    else:
        start, offsets = length + 1, []
    with pytest.raises(ValueError, match="keep"):
        c.keep(start, offsets)
    assert c.length == length


def test_keep_identity_and_empty():
    c = _filled(10, 7)
    k = c.k.clone()
    c.keep(3, [0, 1, 2])
    assert c.length == 6 and torch.equal(c.k, k)
    c.keep(2, [])
    assert c.length == 2


def test_truncate_then_decode_equals_never_appended(tiny_qwen3_model):
    model = tiny_qwen3_model
    cfg = model.cfg
    a, b, c = [5, 17, 99, 3, 64, 7], [11, 12, 13, 14], [42, 8, 120]
    with torch.no_grad():
        ref_cache = KVCache(cfg, 32)
        model(torch.tensor(a), cache=ref_cache)
        ref = [model(torch.tensor([t]), cache=ref_cache).logits[0, -1] for t in c]

        cache = KVCache(cfg, 32)
        model(torch.tensor(a), cache=cache)
        model(torch.tensor(b), cache=cache)       # appended, then rolled back
        cache.truncate(len(a))
        got = [model(torch.tensor([t]), cache=cache).logits[0, -1] for t in c]
    assert cache.length == ref_cache.length == len(a) + len(c)
    for r, g in zip(ref, got):
        assert torch.allclose(r, g, atol=1e-5)
    n = cache.length
    assert torch.allclose(cache.k[..., :n, :], ref_cache.k[..., :n, :], atol=1e-6)
    assert torch.allclose(cache.v[..., :n, :], ref_cache.v[..., :n, :], atol=1e-6)
    # And the check can fail: without the truncate the logits differ.
    with torch.no_grad():
        bad = KVCache(cfg, 32)
        model(torch.tensor(a + b), cache=bad)
        wrong = model(torch.tensor([c[0]]), cache=bad).logits[0, -1]
    assert not torch.allclose(wrong, ref[0], atol=1e-3)


def test_truncate_out_of_range():
    c = _filled(8, 4)
    with pytest.raises(ValueError, match=r"truncate\(5\)"):
        c.truncate(5)
    with pytest.raises(ValueError, match=r"truncate\(-1\)"):
        c.truncate(-1)
    c.truncate(0)
    assert c.length == 0


def test_forward_past_max_len_raises_and_leaves_cache_unchanged(tiny_qwen3_model):
    cache = KVCache(tiny_qwen3_model.cfg, 8)
    with torch.no_grad():
        tiny_qwen3_model(torch.arange(6), cache=cache)
        with pytest.raises(CacheFullError, match=r"sequence length 9 exceeds the KV cache max length 8"):
            tiny_qwen3_model(torch.tensor([1, 2, 3]), cache=cache)
    assert cache.length == 6
    with pytest.raises(CacheFullError, match="max length"):
        cache.advance(3)
    with pytest.raises(ValueError, match="max_len"):
        KVCache(TINY, 0)


def test_sizes():
    c = KVCache(TINY, 10, dtype=torch.bfloat16)
    assert c.nbytes == KVCache.bytes_needed(TINY, 10, torch.bfloat16) == 2 * 2 * 1 * 1 * 10 * 3 * 2
    c.length = 5
    assert c.used_bytes == c.nbytes // 2
