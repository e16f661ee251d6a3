"""Which free block the KV pool hands out next (splitspec/engine/kv_pool.py, issue 54 item 8):
touched free blocks first (last freed, first reused), then the least recently used cached block
nobody holds while more than the cache's reserve are cached, then never-touched ones, then the
reserve; so on a CPU the memory a pool touches never exceeds the most blocks held at once plus
the reserve, and a pool resident from allocation (not on the CPU) keeps its cached blocks until
no free block is left."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.engine.kv_pool import BlockTable, KVPool, PoolExhausted
from splitspec.engine.prefix_cache import PrefixCache, block_keys, namespace_key
from test_prefault import resident

BS = 4
ROOT = namespace_key("m", "")


def make(blocks=17, cache=True, device="cpu", reserve=0) -> KVPool:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=blocks, block_size=BS, device=device)
    if cache:
        pool.cache = PrefixCache(BS)
        pool.cache_reserve = reserve
    return pool


def open_table(pool: KVPool, prompt: int, nblocks: int) -> BlockTable:
    """A session on prompt `prompt` (its token ids all equal to it): hits what is cached of it,
    takes the rest, and publishes every block (as the scheduler does once they are committed)."""
    keys = block_keys(ROOT, [prompt] * (nblocks * BS), BS)
    t = BlockTable(pool)
    if pool.cache is not None:
        with pool.lock:
            hit = pool.cache.longest(keys, 0, nblocks)
            pool.cache.share(hit)
        t.adopt(hit)
    t.ensure(nblocks * BS)
    if pool.cache is not None:
        with pool.lock:
            for b, k in zip(t.blocks, keys):
                if b not in pool.cache.key_of:
                    pool.cache.publish(b, k)
    return t


def test_blocks_come_touched_free_first_then_least_recently_used_cached_then_untouched():
    pool = make(blocks=9)                   # 8 usable
    a = open_table(pool, 1, 3)              # nothing touched yet: blocks 1 2 3
    assert a.blocks == [1, 2, 3] and pool.touched_blocks == 3
    b = BlockTable(pool)
    b.ensure(2 * BS)                        # private (never published): 4 5
    b.free()
    a.free()                                # published: cached, the tail first in LRU order
    assert pool._free == [5, 4] and list(pool.cache.idle) == [3, 2, 1]
    c = BlockTable(pool)
    c.ensure(3 * BS)                        # the two touched free blocks (last freed first), then the tail
    assert c.blocks == [4, 5, 3] and pool.touched_blocks == 5 and pool.cache.evictions == 1
    c.ensure(6 * BS)                        # the rest of the cache, then never-touched 6
    assert c.blocks[3:] == [2, 1, 6] and pool.touched_blocks == 6 and pool.cache.cached_blocks == 0
    assert pool.free_blocks == 2 and pool.used_blocks == 6


def test_the_cache_keeps_its_reserve_before_new_blocks_are_touched():
    pool = make(blocks=13, reserve=2)       # 12 usable
    for prompt in range(3):                 # 2 blocks each, cached when closed
        open_table(pool, prompt, 2).free()
    # The second prompt found only the reserve cached (1 2) and touched 3 4; the third found more
    # and evicted prompt 0's blocks, tail first.
    assert pool.touched_blocks == 4 and pool.cache.evictions == 2 and list(pool.cache.idle) == [4, 3, 1, 2]
    c = BlockTable(pool)
    c.ensure(8 * BS)                        # cached past the reserve (4 3), then never-touched 5..10
    assert c.blocks == [4, 3, *range(5, 11)] and list(pool.cache.idle) == [1, 2]
    c.ensure(10 * BS)                       # never-touched 11 12 before the reserve
    assert pool.touched_blocks == 12 and list(pool.cache.idle) == [1, 2]
    c.ensure(11 * BS)                       # the pool is touched whole: the reserve, LRU first
    assert c.blocks[-1] == 1 and list(pool.cache.idle) == [2] and pool.free_blocks == 1


def test_a_pool_off_the_cpu_keeps_its_cache_until_no_free_block_is_left():
    """Resident from allocation (CUDA): every block counts as touched, so the cache is evicted
    only when the free list runs dry, as before issue 54."""
    pool = make(blocks=9, device="meta")
    assert pool.touched_blocks == 8 and pool.untouched_blocks == 0
    open_table(pool, 1, 3).free()
    c = BlockTable(pool)
    c.ensure(5 * BS)
    assert pool.cache.cached_blocks == 3 and pool.cache.evictions == 0
    c.ensure(6 * BS)
    assert pool.cache.cached_blocks == 2 and pool.cache.evictions == 1


def test_an_allocation_that_does_not_fit_changes_nothing():
    pool = make(blocks=9)
    open_table(pool, 1, 3).free()
    held = open_table(pool, 2, 2)
    before = (list(pool._free), list(pool.cache.idle), pool.touched_blocks)
    with pytest.raises(PoolExhausted):
        BlockTable(pool).ensure(7 * BS)
    assert (list(pool._free), list(pool.cache.idle), pool.touched_blocks) == before
    assert pool.free_blocks == 6 and len(held.blocks) == 2


def test_unique_prompts_through_a_cached_pool_touch_only_their_peak():
    """The issue's case: sessions of prompts that share nothing, a few at a time, through a big
    pool with the cache on. Before, every session took never-touched blocks while cached ones
    waited, so the resident memory walked over the whole pool; now only the peak and the cache's
    reserve are touched, and the pages past them stay unmapped (mincore)."""
    pool = KVPool(num_layers=1, num_kv_heads=8, head_dim=64, num_blocks=2048, block_size=16)   # 32 KiB a block
    pool.cache, pool.cache_reserve = PrefixCache(16), 16
    # Pages already mapped before the pool touched any: glibc may serve the tensor from heap pages
    # an earlier test used, or put its next chunk's header on the tensor's last page.
    before = resident(pool.k, 0, 30 * 16, 2048 * 16)
    live = []
    for prompt in range(200):
        if len(live) == 4:
            live.pop(0).free()
        t = BlockTable(pool)
        t.ensure(3 * 16)
        pool.k[:, t.slots(0, 48)] = 1.0            # the forward writes its K/V
        keys = block_keys(ROOT, [prompt] * 48, 16)
        with pool.lock:
            for b, k in zip(t.blocks, keys):
                pool.cache.publish(b, k)
        live.append(t)
    # The peak (4 sessions x 3 blocks) and the cache's reserve; every other block handed out was
    # one of those, evicted from the cache.
    assert pool.touched_blocks == 12 + 16 and pool.cache.evictions == 200 * 3 - 28
    # No page past the touched blocks was mapped by the pool (block 29 may share a page with 28).
    after = resident(pool.k, 0, 30 * 16, 2048 * 16)
    assert not any(a and not b for a, b in zip(after, before))
    assert sum(before) < len(before) // 2        # (the check means something: most pages were free)


@settings(max_examples=60, deadline=None)
@given(cache=st.booleans(), reserve=st.integers(0, 5),
       ops=st.lists(st.one_of(st.tuples(st.just("open"), st.integers(0, 4), st.integers(1, 4)),
                              st.tuples(st.just("close"), st.integers(0, 7)),
                              st.tuples(st.just("truncate"), st.integers(0, 7), st.integers(0, 16))),
                    min_size=1, max_size=40))
def test_touched_blocks_grow_only_when_no_touched_block_is_free(cache, reserve, ops):
    """Any sequence of sessions opening (on prompts that may share blocks), closing and rolling
    back: the touched blocks grow only in an allocation that leaves no touched block free and no
    more than the reserve cached unheld, so they never exceed the most blocks held at once plus
    the reserve; and every block is held, cached unheld, free or untouched, exactly once."""
    pool = make(blocks=17, cache=cache, reserve=reserve)
    reserve = reserve if cache else 0
    live: list[BlockTable] = []
    peak = 0
    for op in ops:
        touched = pool.touched_blocks
        try:
            if op[0] == "open":
                live.append(open_table(pool, op[1], op[2]))
            elif op[0] == "close" and live:
                live.pop(op[1] % len(live)).free()
            elif op[0] == "truncate" and live:
                t = live[op[1] % len(live)]
                t.truncate(min(op[2], t.length))
        except PoolExhausted:
            pass
        held = {b for t in live for b in t.blocks}
        peak = max(peak, len(held))
        idle = set(pool.cache.idle) if cache else set()
        if pool.touched_blocks > touched:
            assert not pool._free and len(idle) <= reserve
        assert pool.touched_blocks <= peak + reserve
        untouched = set(range(pool.touched_blocks + 1, pool.num_blocks))
        free = set(pool._free)
        assert len(pool._free) == len(free) and max(free | {0}) <= pool.touched_blocks
        assert len(held) + len(idle) + len(free) + len(untouched) == pool.capacity_blocks
        assert held | idle | free | untouched == set(range(1, pool.num_blocks))
    for t in live:
        t.free()
    assert pool.used_blocks == 0
