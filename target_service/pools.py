"""The memory a target model needs per session, built for its family: a paged KV pool for
attention models; for hybrid (KDA / MLA) models a paged pool of MLA latent rows (kv_lora_rank
in `k`, the rope key slice in `v`, one shared row per token and MLA layer) plus a `StatePool`
of per-session KDA state, one slot per running session."""
from __future__ import annotations

import torch

from splitspec.engine.kv_pool import KVPool
from splitspec.engine.prefix_cache import PrefixCache

from splitspec.engine.state_pool import StatePool

DEFAULT_ROLLBACK = "snapshot"
# Of the KV budget, what the prefix cache keeps of its own in touched memory before a new block
# is touched rather than a cached one evicted (kv_pool.py): the 256 MiB the touch-ahead kept
# mapped ahead before issue 54, a conversation's next turn or a tenant's system prompt after a
# pause (65,536 tokens of the bundled code target in bfloat16).
CACHE_RESERVE_BYTES = 256 * 2**20


def make_pool(model, *, block_size: int = 16, num_blocks: int | None = None, budget_bytes: int | None = None,
              max_sessions: int = 1, rollback: str = DEFAULT_ROLLBACK, prefix_cache: bool = False,
              feature_budget_bytes: int = 0, state_checkpoints: int = 0,
              cache_reserve_bytes: int = CACHE_RESERVE_BYTES) -> KVPool:
    """num_blocks, or as many as `budget_bytes` holds (KV only: the state slots come on top, sized
    by max_sessions, and are reported apart). prefix_cache: published blocks are kept and found
    again, with up to feature_budget_bytes of tap rows and, for a recurrent target,
    state_checkpoints extra state slots (checkpoints at block boundaries), and keeps up to
    cache_reserve_bytes of unheld cached blocks before it touches new memory rather than evict."""
    cfg = model.cfg
    p = next(model.parameters())
    dtype, device = p.dtype, p.device
    h = getattr(cfg, "hybrid", None)
    if h is None:
        # A tensor-parallel rank 0 (tp_worker.py) holds only its share of the KV heads.
        kw = dict(num_layers=cfg.num_hidden_layers, num_kv_heads=getattr(model, "local_kv_heads", cfg.num_key_value_heads),
                  head_dim=cfg.head_dim)
    else:
        kw = dict(num_layers=len(h.mla_layers), num_kv_heads=1, head_dim=h.kv_lora_rank,
                  v_head_dim=h.qk_rope_head_dim)
    if num_blocks is None:
        elem = torch.empty((), dtype=dtype).element_size()
        widths = kw["head_dim"] + kw.get("v_head_dim", kw["head_dim"])
        per_block = kw["num_layers"] * kw["num_kv_heads"] * widths * elem * block_size
        if per_block == 0:          # no MLA layer: blocks only count tokens
            per_block = block_size
        num_blocks = budget_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {block_size} tokens "
                             f"({per_block} bytes each); at least 2 are needed (--kv-cache-budget-mb)")
    pool = getattr(model, "pool_class", KVPool)(block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                                                  device=device, **kw)
    if h is not None and h.kda_layers:
        d = h.linear_head_dim
        heads = getattr(model, "local_kda_heads", h.linear_num_heads)     # a tensor-parallel rank: its share
        checkpoints = state_checkpoints if prefix_cache else 0
        pool.states = getattr(model, "state_pool_class", StatePool)(
            num_layers=len(h.kda_layers), num_slots=max_sessions + checkpoints, conv_channels=3 * heads * d,
            conv_kernel=h.conv_kernel, heads=heads, k_dim=d, v_dim=d, device=device)
        pool.states.rollback = rollback
    if prefix_cache:
        slots = pool.states.reserve(checkpoints) if pool.states is not None else []
        pool.cache = PrefixCache(block_size, feature_budget_bytes=feature_budget_bytes, state_slots=slots)
        # Cached blocks nobody holds beyond this reserve are reused before never-touched blocks
        # (kv_pool.py), so the touched memory stays within the most blocks held at once plus the
        # reserve. Nothing maps blocks ahead of use: new sessions meet first touches only while
        # that grows, as without the cache.
        pool.cache_reserve = cache_reserve_bytes // pool.bytes_per_block
    if hasattr(model, "attach_pool"):       # tensor parallel: the workers build the same blocks
        model.attach_pool(pool)
    return pool
