"""The KV pool's block order against the prefix cache's hit rate (issue 54 item 8), replayed
through the real KVPool and PrefixCache without a model: sessions open (take the longest
cached prefix, then blocks for the rest of the prompt and the answer), publish their full blocks
and close, S of them live at once (a slot frees, the next request opens). A hit ends at the last
full block before the prompt's last token, as in the scheduler. Hit rate and resident KV depend
on the order blocks are handed out only, not on timing, so this is exact for the order; sizes are
the bundled code target's (16-token blocks, 4 KiB a token in bfloat16, the 4 GiB default budget).

    python docs/bench/issue54/pool_order.py

Orders: `reserve 0` (every unheld cached block reused before a new block is touched), `reserve
256 MiB` (the default, target_service/pools.py: CACHE_RESERVE_BYTES), `old order` (never-touched
blocks before any cached one, as before issue 54: an unbounded reserve)."""
from __future__ import annotations

import random
from collections import deque

from splitspec.engine.kv_pool import BlockTable, KVPool
from splitspec.engine.prefix_cache import PrefixCache, block_keys, namespace_key

BS, TOKEN_BYTES, BUDGET = 16, 4096, 4 * 2**30
MIB = 2**20
ROOT = namespace_key("code-target", "")


def replay(requests, slots: int, reserve_blocks: int) -> tuple[float, float]:
    """requests: (prompt, answer) token lists, in arrival order. (hit rate, resident KV MiB)."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=BUDGET // (BS * TOKEN_BYTES), block_size=BS,
                  device="meta")     # no memory: the order is all that is replayed
    pool._free, pool._untouched = [], 1          # ... counted as a CPU pool's
    pool.cache, pool.cache_reserve = PrefixCache(BS), reserve_blocks
    live: deque = deque()
    hits = queries = 0
    for prompt, answer in requests:
        if len(live) == slots:
            live.popleft().free()
        keys = block_keys(ROOT, prompt + answer, BS)
        t = BlockTable(pool)
        with pool.lock:
            hit = pool.cache.longest(keys, 0, (len(prompt) - 1) // BS)
            pool.cache.share(hit)
        t.adopt(hit)
        t.ensure(len(prompt) + len(answer))
        t.length = len(prompt) + len(answer)
        with pool.lock:
            for b, k in zip(t.blocks, keys):
                if b not in pool.cache.key_of:
                    pool.cache.publish(b, k)
        hits, queries = hits + len(hit) * BS, queries + len(prompt)
        live.append(t)
    return hits / queries, pool.touched_blocks * BS * TOKEN_BYTES / MIB


def toks(rng, n):
    return [rng.randrange(3, 8192) for _ in range(n)]


def multiturn(conversations, turns, context, message, answer, unique_between=0, seed=0):
    """Round robin over the conversations, turn by turn (the bench's multiturn); unique_between
    prompts that share nothing arrive between two turns (other traffic: the reuse distance)."""
    rng = random.Random(seed)
    transcripts = [toks(rng, context) for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for k in range(conversations):
            prompt = transcripts[k] + toks(rng, message)
            ans = toks(rng, answer)
            out.append((prompt, ans))
            transcripts[k] = prompt + ans
            out += [(toks(rng, rng.randint(4, 32)), toks(rng, rng.randint(1, 32))) for _ in range(unique_between)]
    return out


def soak(n, shared_prefix=256, share=0.25, seed=0):
    """The loadtest mix: random prompts of 4..32 tokens and up to 32 new; a quarter after one
    shared 256-token prefix."""
    rng = random.Random(seed)
    prefix = toks(rng, shared_prefix)
    out = []
    for _ in range(n):
        p = toks(rng, rng.randint(4, 32))
        out.append(((prefix + p) if rng.random() < share else p, toks(rng, rng.randint(1, 32))))
    return out


WORKLOADS = {
    "multiturn 8 x 4, 8 slots (bench-prefix's default)": (multiturn(8, 4, 1024, 64, 64), 8),
    "multiturn 64 x 6, 8 slots": (multiturn(64, 6, 512, 64, 64), 8),
    "multiturn 64 x 6, 8 slots, 24 unique prompts between turns": (multiturn(64, 6, 512, 64, 64, 24), 8),
    "multiturn 256 x 4, 24 slots, 24 unique prompts between turns": (multiturn(256, 4, 512, 64, 64, 24), 24),
    "soak mix, 20,000 requests, 24 slots": (soak(20000), 24),
}
ORDERS = {"reserve 0": 0, "reserve 256 MiB": 256 * MIB // (BS * TOKEN_BYTES), "old order": 1 << 40}

if __name__ == "__main__":
    print("| workload | " + " | ".join(f"{o}: hit rate, KV MiB" for o in ORDERS) + " |")
    print("|---|" + "---|" * len(ORDERS))
    for name, (reqs, slots) in WORKLOADS.items():
        cells = [replay(reqs, slots, r) for r in ORDERS.values()]
        print(f"| {name} | " + " | ".join(f"{h:.3f}, {mb:.0f}" for h, mb in cells) + " |")
