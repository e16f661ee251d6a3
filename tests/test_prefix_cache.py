"""The prefix cache: keys, reference counts, LRU eviction and namespaces on a tiny pool; and
through the target's scheduler, hits that change nothing a request computes (dense and KDA
targets), the drafter's tap rows on a hit, hits capped before the last prompt token, blocks
shared by sessions that roll back and close, and eviction under pool pressure."""
from __future__ import annotations

import asyncio
import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hybrid_models import save_tiny_kimi
from scheduler_helpers import run_scheduler
from service_helpers import tiny_target_dir
from splitspec.engine.kv_pool import BlockTable, KVPool, PoolExhausted
from splitspec.engine.prefix_cache import PrefixCache, block_keys, namespace_key
from splitspec.engine.sample import SamplingParams
from splitspec.engine.tree import Tree
from target_service.engine import generate
from splitspec.models.loader import load_model
from target_service.pools import make_pool

BS = 4


# --- the cache on its own ------------------------------------------------------------------
def test_keys_chain_blocks_and_separate_namespaces():
    root = namespace_key("m", "")
    toks = list(range(10))
    keys = block_keys(root, toks, BS)
    assert len(keys) == 2                                   # the partial block has no key
    assert block_keys(root, toks[:8] + [99, 98], BS) == keys
    changed = block_keys(root, [50] + toks[1:], BS)
    assert changed[0] != keys[0] and changed[1] != keys[1]  # a block's key covers the whole prefix
    assert block_keys(namespace_key("m", "tenant-a"), toks, BS)[0] != keys[0]
    assert block_keys(namespace_key("other-model", ""), toks, BS)[0] != keys[0]
    assert block_keys(root, toks, BS, keys[:1]) == keys     # extending what is known


def cached_pool(blocks=9) -> KVPool:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=blocks, block_size=BS)
    pool.cache = PrefixCache(BS)
    return pool


def publish(pool, table, keys):
    with pool.lock:
        for b, k in zip(table.blocks, keys):
            pool.cache.publish(b, k)


def test_refcounts_keep_shared_blocks_and_lru_evicts_oldest_tail_first():
    pool = cached_pool(blocks=9)            # 8 usable blocks
    keys = block_keys(namespace_key("m", ""), list(range(12)), BS)
    a = BlockTable(pool)
    a.ensure(12)
    publish(pool, a, keys)
    b = BlockTable(pool)
    with pool.lock:
        got = pool.cache.longest(keys, 0, 3)
        pool.cache.share(got)
    b.adopt(got)
    assert got == a.blocks and b.length == 12
    a.free()                                # b still holds all three: none is idle
    assert pool.cache.refs == {blk: 1 for blk in got} and not pool.cache.idle
    assert pool.free_blocks == 5
    b.free()
    assert pool.free_blocks == 8 and pool.used_blocks == 0
    assert list(pool.cache.idle) == got[::-1]               # the tail waits first in line
    c = BlockTable(pool)
    c.ensure(1 * BS)                        # no touched free block: the LRU cached one, the tail
    assert pool.cache.cached_blocks == 2 and c.blocks == [got[2]]
    with pool.lock:
        assert pool.cache.longest(keys, 0, 3) == got[:2]
    c.ensure(6 * BS)                        # the other two cached blocks, then 3 never touched
    assert pool.cache.cached_blocks == 0 and pool.cache.evictions == 3 and pool.touched_blocks == 6
    c.ensure(8 * BS)
    with pytest.raises(PoolExhausted):
        BlockTable(pool).ensure(1)


def test_an_equal_block_computed_twice_stays_private():
    pool = cached_pool()
    keys = block_keys(namespace_key("m", ""), list(range(4)), BS)
    a, b = BlockTable(pool), BlockTable(pool)
    a.ensure(4)
    b.ensure(4)
    with pool.lock:
        assert pool.cache.publish(a.blocks[0], keys[0])
        assert not pool.cache.publish(b.blocks[0], keys[0])
    b.free()                                # private: straight back on the free list
    assert pool.cache.cached_blocks == 1 and pool.free_blocks == 7


def test_tap_rows_live_in_a_bounded_arena_and_readers_get_copies():
    rows = lambda v, width=6: torch.full((BS, width), float(v))
    slot_bytes = rows(0).nbytes
    cache = PrefixCache(BS, feature_budget_bytes=3 * slot_bytes)
    for b in range(1, 6):
        assert cache.publish(b, bytes([b]))
    for b in (1, 2, 3):
        cache.add_features(b, "taps", rows(b))
    assert cache.feature_bytes == 3 * slot_bytes and cache.arena.shape == (3, BS, 6)
    got = cache.features_of(1, "taps")
    got += 100                                          # a copy: the stored rows stay
    assert torch.equal(cache.features_of(1, "taps"), rows(1))
    assert cache.features_of(1, "other taps") is None and cache.features_of(4, "taps") is None
    cache.add_features(4, "taps", rows(4))              # full: the least recently read rows (block 2's) go
    assert not cache.has_features(2, "taps") and torch.equal(cache.features_of(4, "taps"), rows(4))
    assert torch.equal(cache.features_of(3, "taps"), rows(3)) and cache.feature_bytes == 3 * slot_bytes
    cache.release([1])
    assert cache.evict(1) == [1]                        # block 1 goes, and its rows with it
    assert 1 not in cache.features and cache.feature_bytes == 2 * slot_bytes
    cache.add_features(5, "wide", rows(5, width=12))     # another draft's width: a new arena, the old rows go
    assert cache.arena.shape == (1, BS, 12) and list(cache.features) == [5]
    assert cache.features_of(5, "wide").shape == (BS, 12)
    assert PrefixCache(BS, feature_budget_bytes=slot_bytes - 1).add_features(1, "taps", rows(1)) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=30))
def test_blocks_are_never_lost_or_double_owned(ops):
    """Any sequence of sessions opening on shared prefixes and closing: every block is free,
    idle-cached or held, exactly once."""
    pool = cached_pool(blocks=17)
    root = namespace_key("m", "")
    live = []
    for prompt_id, nblocks in ops:
        if len(live) >= 3:
            live.pop(0).free()
        keys = block_keys(root, [prompt_id] * (nblocks * BS), BS)
        t = BlockTable(pool)
        with pool.lock:
            hit = pool.cache.longest(keys, 0, nblocks)
            pool.cache.share(hit)
        t.adopt(hit)
        t.ensure(nblocks * BS)
        publish(pool, t, keys)
        live.append(t)
    held = [b for t in live for b in t.blocks]
    shared = [b for b in held if b in pool.cache.key_of]
    for b in set(shared):
        assert pool.cache.refs[b] == shared.count(b)
    private = [b for b in held if b not in pool.cache.key_of]
    assert len(private) == len(set(private))
    untouched = set(range(pool.touched_blocks + 1, 17))
    everything = set(held) | set(pool.cache.idle) | set(pool._free) | untouched
    assert everything == set(range(1, 17))
    assert len(set(held)) + len(pool.cache.idle) + len(pool._free) + len(untouched) == 16


# --- through the scheduler ----------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return load_model(tiny_target_dir())


@pytest.fixture(scope="module")
def kimi():
    return load_model(save_tiny_kimi(tempfile.mkdtemp(prefix="kimi-") + "/tiny-kimi"))


def run(model, body, *, cache=True, blocks=200, checkpoints=4, features=1 << 24, **kw):
    pool = make_pool(model, num_blocks=blocks, block_size=BS, max_sessions=4, prefix_cache=cache,
                     feature_budget_bytes=features, state_checkpoints=checkpoints)
    return run_scheduler(model, body, pool=pool, **{"model_id": "tiny", **kw})


async def complete(sched, sid, prompt, n, params=None, **kw):
    params = params or SamplingParams()
    s, step = await sched.open(sid, prompt, params, max_new_tokens=n + 1, **kw)
    out = [step.out.committed[0]]
    async for t in sched.decode(s, n - 1):
        out.append(t.out.committed[0])
    sched.close(s)
    return out, step


PREFIX = [(5 * i) % 100 + 3 for i in range(37)]


def test_hits_change_nothing_and_cover_full_blocks_before_the_last_token(model):
    prompts = [PREFIX + [70], PREFIX + [71, 72], PREFIX[:24], PREFIX + [70]]

    async def body(sched):
        return [await complete(sched, str(i), p, 10) for i, p in enumerate(prompts)], sched
    got, sched = run(model, body)
    for p, (out, _) in zip(prompts, got):
        assert out == generate(model, p, 10)
    cached = [step.cached_tokens for _, step in got]
    # 38 tokens: 9 full blocks before the last token; PREFIX[:24] ends on a block boundary, so
    # its last block is computed again for b0; the repeat of prompt 0 takes all it can.
    assert cached == [0, 36, 20, 36]
    assert sched.prefix_queries == sum(map(len, prompts)) and sched.prefix_hits == sum(cached)


def test_sampled_outputs_are_the_same_with_and_without_the_cache(model):
    params = lambda seed: SamplingParams(temperature=1.0, top_p=0.9, seed=seed)  # noqa: E731

    async def body(sched):
        return [(await complete(sched, str(s), PREFIX + [s], 12, params(s)))[0] for s in range(4)]
    assert run(model, body) == run(model, body, cache=False)


def test_salts_never_share_blocks(model):
    async def body(sched):
        steps = []
        for salt in ("a", "b", "a", ""):
            steps.append((await complete(sched, salt, PREFIX, 3, cache_salt=salt))[1].cached_tokens)
        return steps
    assert run(model, body) == [0, 0, 36, 0]


def test_a_drafter_gets_the_same_tap_rows_on_a_hit(model):
    """A windowed drafter reads the last hidden_last prompt positions' features: on a hit they
    come from the stored rows and must be the ones a full prefill gives; with none stored the
    hit is shortened so that they are computed."""
    taps = dict(hidden_layers=(0, 1), hidden_last=10)

    async def body(sched):
        rows = []
        for i in range(2):
            _, step = await complete(sched, str(i), PREFIX + [60 + i], 2, **taps)
            rows.append((step.out.hidden, step.cached_tokens))
        return rows
    (miss, c0), (hit, c1) = run(model, body)
    (_, _), (cold, _) = run(model, body, cache=False)
    assert c0 == 0 and c1 == 36
    assert hit.shape[0] >= 10 and torch.allclose(hit[-10:], cold[-10:], atol=1e-5)
    # No stored rows: the hit stops before the window (38 - 10 = 28 -> 7 blocks).
    (_, _), (short, c2) = run(model, body, features=0)
    assert c2 == 28 and torch.allclose(short[-10:], cold[-10:], atol=1e-5)

    async def untapped_then_tapped(sched):
        await complete(sched, "plain", PREFIX + [60], 2)              # publishes blocks, no rows
        _, first = await complete(sched, "tapped", PREFIX + [61], 2, **taps)
        _, second = await complete(sched, "again", PREFIX + [61], 2, **taps)
        return first, second
    first, second = run(model, untapped_then_tapped)
    assert first.cached_tokens == 28 and torch.allclose(first.out.hidden[-10:], cold[-10:], atol=1e-5)
    # The tapped session computed the window's blocks again: their rows now ride on the cached ones.
    assert second.cached_tokens == 36 and torch.allclose(second.out.hidden[-10:], cold[-10:], atol=1e-5)


def test_prompt_logprobs_are_never_served_from_the_cache(model):
    async def body(sched):
        await complete(sched, "a", PREFIX, 2)
        _, step = await complete(sched, "b", PREFIX, 2, params=SamplingParams(prompt_logprobs=0))
        return step.cached_tokens, len(sched.running)
    assert run(model, body)[0] == 0


def test_a_shared_block_survives_one_sessions_rollback_and_close(model):
    ref = generate(model, PREFIX + [70], 12)

    async def body(sched):
        a, _ = await sched.open("a", PREFIX + [70], SamplingParams(), max_new_tokens=20)
        b, step = await sched.open("b", PREFIX + [70], SamplingParams(), max_new_tokens=20)
        assert step.cached_tokens == 36
        shared = list(b.seq.table.blocks[:9])
        assert shared == a.seq.table.blocks[:9]
        # a verifies a draft that is all wrong (rolled back), then leaves.
        wrong = [(t + 1) % 100 for t in ref[1:4]]
        v = await sched.verify(a, a.length, Tree.chain(wrong), None)
        assert v.out.result.num_accepted == 0
        sched.close(a)
        assert all(blk in sched.pool.cache.key_of for blk in shared)
        out = [step.out.committed[0]]
        async for t in sched.decode(b, 11):
            out.append(t.out.committed[0])
        sched.close(b)
        return out
    assert run(model, body) == ref


def test_same_prompts_at_once_compute_the_shared_blocks_once(model):
    async def body(sched):
        res = await asyncio.gather(*(complete(sched, str(i), PREFIX + [80 + i], 4) for i in range(3)))
        return res, sched
    res, sched = run(model, body)
    for i, (out, _) in enumerate(res):
        assert out == generate(model, PREFIX + [80 + i], 4)
    assert sorted(step.cached_tokens for _, step in res) == [0, 36, 36]


def test_pool_pressure_evicts_cached_blocks_instead_of_refusing(model):
    """A pool of 24 blocks: each request reserves 12 (46 tokens + 2 new); after a few distinct
    prompts the free list is empty and only evicting cached blocks lets the next one run."""
    prompts = [[p] * 46 for p in range(10, 16)]

    async def body(sched):
        outs = [await complete(sched, str(i), p, 2) for i, p in enumerate(prompts)]
        return outs, sched.pool.cache.evictions
    outs, evictions = run(model, body, blocks=25)
    assert evictions > 0
    assert [o for o, _ in outs] == [generate(model, p, 2) for p in prompts]


def test_kda_hits_resume_from_state_checkpoints(kimi):
    prompt = [(7 * i) % 120 + 3 for i in range(41)]
    prompts = [prompt + [5], prompt + [6, 6], prompt + [5]]

    async def body(sched):
        return [await complete(sched, str(i), p, 10) for i, p in enumerate(prompts)]
    got = run(kimi, body)
    for p, (out, _) in zip(prompts, got):
        assert out == generate(kimi, p, 10)
    # The prefill ends a chunk on the prompt's last full block before its last token (40) and
    # checkpoints the state there; later prompts resume from it.
    assert [s.cached_tokens for _, s in got] == [0, 40, 40]
    # No checkpoint slots: K/V alone cannot resume a recurrence, so no hit at all.
    assert [s.cached_tokens for _, s in run(kimi, body, checkpoints=0)] == [0, 0, 0]


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer(model):
    """Blocks fill with generated tokens as they are committed (decode and verify), so the next
    turn's prompt (first prompt + answer + new message) hits past the first prompt."""
    first = PREFIX[:22]

    async def body(sched):
        s, step = await sched.open("t1", first, SamplingParams(), max_new_tokens=40)
        answer = [step.out.committed[0]]
        ref = generate(model, first, 20)
        v = await sched.verify(s, s.length, Tree.chain(ref[1:5]), None)     # verified tokens publish too
        answer += v.out.committed
        async for t in sched.decode(s, 20 - len(answer)):
            answer.append(t.out.committed[0])
        sched.close(s)
        assert answer == ref
        second = first + answer + [90, 91, 92]
        out, step2 = await complete(sched, "t2", second, 5)
        return second, out, step2.cached_tokens
    second, out, cached = run(model, body)
    assert out == generate(model, second, 5)
    # 22 + 20 committed, 41 of them in the pool when the first turn closed: 10 full blocks.
    assert cached == 40


def test_undrafted_sessions_store_taps_once_a_drafted_hit_missed_them(model):
    """auto runs many requests without a draft. Storing the last draft's tap rows costs those
    requests time, so they store them (never returning them) only once a drafted request's hit
    was cut short for lack of rows: unique traffic pays nothing, and a shared prefix run
    undrafted gives a drafted request every row it reads from the second drafted hit on."""
    taps = dict(hidden_layers=(0, 1), hidden_last=10)
    other = [p + 1 for p in PREFIX]

    async def body(sched):
        await complete(sched, "drafted", [90, 91, 92, 93, 94], 2, **taps)      # declares the taps
        drafted_rows = sched.pool.cache.feature_bytes
        _, plain = await complete(sched, "plain", PREFIX + [60], 2)
        stored_before = sched.pool.cache.feature_bytes - drafted_rows
        _, short = await complete(sched, "short", PREFIX + [61], 2, **taps)    # rows missing: a shorter hit
        _, plain2 = await complete(sched, "plain2", other + [60], 2)           # now stores the rows
        _, later = await complete(sched, "later", other + [61], 2, **taps)
        return stored_before, plain, short, plain2, later
    stored_before, plain, short, plain2, later = run(model, body)
    assert plain.out.hidden is None and plain2.out.hidden is None     # nothing shipped to a caller without a draft
    # The plain session stored no rows.
    assert stored_before == 0
    assert short.cached_tokens == 28 and later.cached_tokens == 36

    async def cold_body(sched):
        return (await complete(sched, "x", other + [61], 2, **taps))[1]
    cold = run(model, cold_body, cache=False)
    assert torch.allclose(later.out.hidden[-10:], cold.out.hidden[-10:], atol=1e-5)


def test_undrafted_sessions_stop_storing_taps_when_no_drafted_hit_needs_them(model, monkeypatch):
    """The demand lapses STORE_TAPS_S after the last drafted hit that missed rows."""
    import target_service.scheduler as scheduler_mod
    taps = dict(hidden_layers=(0, 1), hidden_last=10)
    monkeypatch.setattr(scheduler_mod, "STORE_TAPS_S", 0.0)

    async def body(sched):
        await complete(sched, "drafted", [90, 91, 92, 93, 94], 2, **taps)
        await complete(sched, "plain", PREFIX + [60], 2)
        await complete(sched, "short", PREFIX + [61], 2, **taps)     # missed rows, but the demand lapses at once
        before = sched.pool.cache.feature_bytes
        await complete(sched, "plain2", [p + 1 for p in PREFIX] + [60], 2)
        return before, sched.pool.cache.feature_bytes
    before, after = run(model, body)
    assert after == before


def test_a_batch_invariant_second_turn_is_the_same_with_its_first_turn_cached_or_not(model):
    """A batch-invariant target shares only the blocks its prefills wrote: a decode computes a
    token's K/V in another attention call than a prefill span, so a second turn taking the first
    turn's answer from the cache would compute other bits than one that finds the cache cold.
    Each turn's logits (every lm_head row) are compared bit for bit, cache warm against cold."""
    bf16 = load_model(tiny_target_dir(), dtype="bfloat16")
    first = PREFIX[:22]
    logits = []
    orig = bf16.lm_head.forward

    def hook(x):
        out = orig(x)
        logits.append(out.detach().reshape(-1, out.shape[-1]).clone())
        return out

    async def turns(sched, warm: bool):
        if warm:
            s, step = await sched.open("t1", first, SamplingParams(), max_new_tokens=40)
            answer = [step.out.committed[0]]
            v = await sched.verify(s, s.length, Tree.chain([answer[0]] * 4), None)
            answer += v.out.committed
            async for t in sched.decode(s, 20 - len(answer)):
                answer.append(t.out.committed[0])
            sched.close(s)
        else:
            answer = warm_answer
        logits.clear()
        second = first + answer + [90, 91, 92]
        out, step = await complete(sched, "t2", second, 6)
        return answer, out, step.cached_tokens, list(logits)

    bf16.lm_head.forward = hook
    try:
        warm_answer, warm_out, warm_cached, warm_logits = run(
            bf16, lambda sched: turns(sched, True), attention="torch-exact")
        _, cold_out, cold_cached, cold_logits = run(bf16, lambda sched: turns(sched, False), attention="torch-exact")
    finally:
        bf16.lm_head.forward = orig
    # The first prompt's 5 full blocks only: the answer's blocks were written by decodes.
    assert (warm_cached, cold_cached) == (20, 0)
    assert warm_out == cold_out
    assert len(warm_logits) == len(cold_logits)
    assert all(torch.equal(a, b) for a, b in zip(warm_logits, cold_logits))
