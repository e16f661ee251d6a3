"""Paged KV memory: one pool of fixed-size blocks shared by every sequence, and a block table
per sequence (the vLLM / nano-vllm layout). Token i of a sequence lives in slot
`table[i // block_size] * block_size + i % block_size` of the flat slot axis.

Growing a sequence takes blocks off the free list; rollback and close hand whole blocks back.
Nothing is copied to grow. Block 0 is never handed out: it stays zero so that padded gathers
(shorter rows in a batch) read finite numbers that the mask then hides; the rest of the pool
is `torch.empty`, so untouched blocks cost no resident memory on CPU.

With a prefix cache (`pool.cache`, splitspec/engine/prefix_cache.py) published blocks may be
held by several tables; one nobody holds stays cached and counts as free until the free list
runs dry and it is evicted."""
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
        # A stack popped from the end: low ids first, and a freed block is the next one reused,
        # so the memory a long run touches stays as small as its peak use.
        self._free = list(range(num_blocks - 1, 0, -1))
        # Blocks come and go on the engine thread, but a closing session hands its blocks back
        # from the server's thread at once.
        self._lock = threading.Lock()
        self.cache = None       # a PrefixCache, when prefix caching is on
        # Per-session fixed-size state (a recurrent target's KDA state), one slot per table; None
        # for attention-only models.
        self.states = None
        self.prefault = None    # a Prefaulter (splitspec/engine/prefault.py) mapping pages ahead of use

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

    def prefault_ahead(self, ahead_bytes: int) -> None:
        """Keep ahead_bytes of blocks past the highest one handed out mapped by a background
        thread (CPU only; see prefault.py for why a prefix-cache pool wants it)."""
        if self.k.device.type != "cpu" or self.prefault is not None:
            return
        from .prefault import Prefaulter
        self.prefault = Prefaulter([self.k, self.v], block_size=self.block_size, num_blocks=self.num_blocks,
                                   ahead=ahead_bytes // max(1, self.bytes_per_block))

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
        """Blocks a sequence could take now: the free list and the cached blocks nobody holds."""
        return len(self._free) + (len(self.cache.idle) if self.cache is not None else 0)

    @property
    def used_blocks(self) -> int:
        return self.capacity_blocks - self.free_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.k[:, :self.block_size].nbytes + self.v[:, :self.block_size].nbytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            short = n - len(self._free)
            if short > 0 and self.cache is not None and len(self.cache.idle) >= short:
                self._free[:0] = self.cache.evict(short)[::-1]     # taken last, after the free list
            if n > len(self._free):
                raise PoolExhausted(f"the KV pool has {len(self._free)} free blocks of {self.block_size} tokens; "
                                    f"{n} are needed (--kv-cache-budget-mb)")
            out = self._free[len(self._free) - n:][::-1]
            del self._free[len(self._free) - n:]
        if self.prefault is not None and out:
            self.prefault.need(max(out))
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
