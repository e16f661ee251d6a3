"""Paged KV memory: one pool of fixed-size blocks shared by every sequence, and a block table
per sequence (the vLLM / nano-vllm layout). Token i of a sequence lives in slot
`table[i // block_size] * block_size + i % block_size` of the flat slot axis.

Growing a sequence takes blocks off the free list; rollback and close hand whole blocks back.
Nothing is copied to grow. Block 0 is never handed out: it stays zero so that padded gathers
(shorter rows in a batch) read finite numbers that the mask then hides; the rest of the pool
is `torch.empty`, so untouched blocks cost no resident memory on CPU.

With a prefix cache (`pool.cache`, splitspec/engine/prefix_cache.py) published blocks may be
held by several tables; one nobody holds stays cached and counts as free until it is evicted.

Which free block goes next (`allocate`), cheapest first:
1. a touched free block (freed by a table, or evicted earlier): last freed, first reused;
2. the least recently used cached block nobody holds, evicted, while more than `cache_reserve`
   of them are cached;
3. a never-touched block, lowest id first;
4. the least recently used cached block nobody holds, evicted (the pool is touched whole).
On CPU a never-touched block costs resident memory for good (the process never gives it back)
and a page fault per 4 KiB on first write; a cached block costs only a hit that might come. Taking
never-touched blocks before cached ones (as first built) made a cache-on target's RSS walk with
the traffic's volume, not its concurrency, toward the whole --kv-cache-budget-mb (issue 54: 0.97 to
2.26 GB in 10 minutes). Evicting every cached block before touching a new one would bound the
cache by how far the live sessions' blocks fall below their peak, which is nothing under steady
load: a conversation's next turn, a tenant's system prompt after a pause, would miss. So the
cache keeps `cache_reserve` blocks of its own in touched memory; the touched blocks never exceed
the most blocks held at once plus the reserve (a fixed, stated bound), and among the cached
blocks LRU decides as before. On a device whose pool is resident from allocation (CUDA) every
block counts as touched, so the cache keeps the whole pool and is evicted only when no free block
is left."""
from __future__ import annotations

import threading

import torch


class PoolExhausted(Exception):
    """The pool has fewer free blocks than a sequence needs now."""


class KVPool:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device="cpu",
                 v_head_dim: int | None = None):
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the zero block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        # An MLA target caches a latent row and a rope key slice of another width in k / v.
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self.v = torch.empty(shape[:-1] + (v_dim,), dtype=dtype, device=device)
        self.k[:, :block_size].zero_()
        self.v[:, :block_size].zero_()
        # Free blocks come in two kinds. `_free`: touched ones, a stack popped from the end, so a
        # freed block is the next one reused. Never-touched ones: ids [_untouched, num_blocks),
        # handed out lowest first, so the touched ones stay one run of ids [1, _untouched).
        # A pool not on the CPU is resident (mapped) whole from here on: all its blocks count as
        # touched, low ids first.
        if torch.device(device).type == "cpu":
            self._free, self._untouched = [], 1
        else:
            self._free, self._untouched = list(range(num_blocks - 1, 0, -1)), num_blocks
        # Blocks come and go on the engine thread, but a closing session hands its blocks back
        # from the server's thread at once.
        self._lock = threading.Lock()
        self.cache = None       # a PrefixCache, when prefix caching is on
        # Unheld cached blocks the pool keeps before it evicts one rather than touch a new block
        # (the order above); 0 with no cache.
        self.cache_reserve = 0
        # Per-session fixed-size state (a recurrent target's KDA state), one slot per table; None
        # for attention-only models.
        self.states = None

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_budget(cls, budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                    block_size: int = 16, dtype: torch.dtype = torch.float32, device="cpu") -> "KVPool":
        per_block = cls.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * block_size
        blocks = budget_bytes // per_block
        if blocks < 2:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds {blocks} blocks of {block_size} tokens "
                             f"({per_block} bytes each); at least 2 are needed (--kv-cache-budget-mb)")
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, num_blocks=blocks,
                   block_size=block_size, dtype=dtype, device=device)

    @property
    def capacity_blocks(self) -> int:
        """Blocks a sequence may ever hold (all but the zero block)."""
        return self.num_blocks - 1

    @property
    def lock(self) -> threading.Lock:
        """Held while the free list or the prefix cache changes (the engine looks up hits under it)."""
        return self._lock

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence could take now: free ones (touched or not) and the cached blocks nobody holds."""
        return len(self._free) + self.untouched_blocks + (len(self.cache.idle) if self.cache is not None else 0)

    @property
    def untouched_blocks(self) -> int:
        """Blocks never handed out on a CPU pool (no resident memory yet); 0 elsewhere."""
        return self.num_blocks - self._untouched

    @property
    def touched_blocks(self) -> int:
        """Blocks ever handed out (on a CPU pool, the ones holding resident memory), the zero block aside."""
        return self._untouched - 1

    @property
    def used_blocks(self) -> int:
        return self.capacity_blocks - self.free_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.k[:, :self.block_size].nbytes + self.v[:, :self.block_size].nbytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n blocks, cheapest first (the module docstring): touched free blocks, then cached
        blocks nobody holds beyond the reserve (least recently used first), then never-touched
        ones, then the reserve. PoolExhausted, and no change, when fewer than n are free."""
        with self._lock:
            idle = len(self.cache.idle) if self.cache is not None else 0
            if n > len(self._free) + idle + self.untouched_blocks:
                raise PoolExhausted(f"the KV pool has {len(self._free) + idle + self.untouched_blocks} free blocks "
                                    f"of {self.block_size} tokens; {n} are needed (--kv-cache-budget-mb)")
            take = min(n, len(self._free))
            out = self._free[len(self._free) - take:][::-1]
            del self._free[len(self._free) - take:]
            if len(out) < n and idle > self.cache_reserve:
                out += self.cache.evict(min(n - len(out), idle - self.cache_reserve))
            fresh = min(n - len(out), self.untouched_blocks)
            if fresh:
                out += range(self._untouched, self._untouched + fresh)
                self._untouched += fresh
            if len(out) < n:
                out += self.cache.evict(n - len(out))
        return out

    def copy_slots(self, frm: torch.Tensor, to: torch.Tensor) -> None:
        """K/V of slots `frm` into slots `to`, every layer (gathered first, so overlap is safe).
        One method so a tensor-parallel rank 0 can replay the same copies on its workers."""
        for t in (self.k, self.v):
            t[:, to] = t[:, frm]

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            if self.cache is not None:
                self._free.extend(self.cache.release(blocks))    # published blocks stay cached
            else:
                self._free.extend(reversed(blocks))


class BlockTable:
    """The blocks of one sequence and how many of its tokens have K/V stored (`length`)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0
        self.state: int | None = None       # slot in pool.states, taken on first use

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def ensure(self, tokens: int) -> None:
        """Hold blocks for `tokens` tokens (PoolExhausted, and no change, if the pool is short)."""
        if self.pool.states is not None and self.state is None:
            self.state = self.pool.states.allocate()
        need = self.pool.blocks_for(tokens) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.pool.allocate(need))

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slot ids of token indices [start, end) (blocks must be held)."""
        bs = self.pool.block_size
        idx = torch.arange(start, end)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return (table[idx // bs] * bs + idx % bs).to(self.pool.k.device)

    def adopt(self, blocks: list[int]) -> None:
        """Append cached blocks (already shared by the caller) whose K/V this sequence would
        compute next: they hold its tokens [length, length + len(blocks) * block_size)."""
        if self.length != len(self.blocks) * self.pool.block_size:
            raise ValueError(f"adopt at length {self.length}: cached blocks start on a block boundary")
        self.blocks.extend(blocks)
        self.length = len(self.blocks) * self.pool.block_size

    def truncate(self, n: int) -> None:
        """Keep the first n tokens and give back every block past them."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"truncate({n}) outside the {self.capacity} tokens this sequence holds blocks for")
        self.length = n
        keep = self.pool.blocks_for(n)
        if keep < len(self.blocks):
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    def free(self) -> None:
        self.pool.release(self.blocks)
        self.blocks, self.length = [], 0
        if self.state is not None:
            self.pool.states.release(self.state)
            self.state = None

    def move(self, src: list[int], dst_start: int) -> None:
        """Copy the K/V of token indices `src` to `dst_start, dst_start + 1, ...` in every layer
        (compacting an accepted tree path); gathers before writing, so overlap is safe."""
        if not src:
            return
        s = self.slots(0, self.capacity)
        self.pool.copy_slots(s[torch.tensor(src, device=s.device)], s[dst_start:dst_start + len(src)])

    def fork(self) -> "BlockTable":
        """A new table holding a copy of this one's K/V (and recurrent state): a branch that can
        grow apart from it. Blocks for the whole capacity are taken, so the copy grows in place."""
        t = BlockTable(self.pool)
        t.ensure(self.capacity)
        if self.length:
            self.pool.copy_slots(self.slots(0, self.length), t.slots(0, self.length))
        t.length = self.length
        if self.state is not None:
            self.pool.states.copy(self.state, t.state)
        return t

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This sequence's K/V as [layers, 1, kv_heads, length, head_dim] (for inspection and tests)."""
        s = self.slots(0, self.length)
        return tuple(t[:, s].permute(0, 2, 1, 3)[:, None] for t in (self.pool.k, self.pool.v))
