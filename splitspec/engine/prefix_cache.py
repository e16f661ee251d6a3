"""Prefix cache over the paged KV pool: full blocks of committed tokens, found again by a
chained hash of their token ids, so a prompt that starts like an earlier one reuses its K/V.

A block's key is sha256(parent key + its token ids); the first block's parent is the
namespace (model and `cache_salt`), so equal keys mean equal prefixes in one namespace and
tenants with different salts never meet. Only full blocks of committed tokens are ever
published (the scheduler's rule), so a tree verify and its rollback only touch a session's
private tail and a shared block is never written.

Reference counts: a published block counts the tables holding it. One whose count falls to
zero keeps its key and waits in LRU order (oldest first, a freed table's tail before its
head, as vLLM frees) until the pool needs a block: the free list is used first, then the
least recently used cached block is evicted. A cached block therefore costs nothing a
request could need: the pool counts it as free.

Two things may ride on a block, each bounded and dropped with it:
- `features`: the target's tap rows for its tokens, so a windowed drafter opened on a hit
  gets exactly the rows it would have got without the cache (never rows nobody computed).
  They live in one arena tensor of block-sized slots, taken whole when the first rows come and
  mapped at once: a clone per block cost DFlash sessions ~6 % on prompts that never hit
  (allocator churn and first touches of fresh pages), a copy into a mapped slot costs nothing
  measurable. A reader gets a copy, so a slot can be reused at any time;
- `checkpoints`: for recurrent (KDA) targets, the state after the block, in a slot of the
  state pool, because K/V alone cannot resume a recurrence mid-stream.

Not thread-safe on its own: the pool calls it under its lock."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch


def namespace_key(*parts: str) -> bytes:
    """The parent key of a sequence's first block: the model and the tenant's salt."""
    h = hashlib.sha256(b"splitspec-prefix-v1")
    for p in parts:
        b = p.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()


def chain(parent: bytes, tokens) -> bytes:
    return hashlib.sha256(parent + array("l", tokens).tobytes()).digest()


def block_keys(root: bytes, tokens: list[int], block_size: int, have: list[bytes] | None = None) -> list[bytes]:
    """Keys of every full block of `tokens`, extending `have` (the keys already computed)."""
    keys = list(have or ())
    parent = keys[-1] if keys else root
    for k in range(len(keys), len(tokens) // block_size):
        parent = chain(parent, tokens[k * block_size:(k + 1) * block_size])
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, block_size: int, *, feature_budget_bytes: int = 0, state_slots: list[int] | None = None):
        self.block_size = block_size
        self.block_of: dict[bytes, int] = {}        # key -> block
        self.key_of: dict[int, bytes] = {}          # block -> key
        self.refs: dict[int, int] = {}              # published block -> tables holding it
        self.idle: OrderedDict[int, None] = OrderedDict()     # published, unreferenced: LRU order
        self.features: OrderedDict[int, tuple] = OrderedDict()  # block -> (tap key, arena slot)
        self.feature_budget = feature_budget_bytes
        self.arena: torch.Tensor | None = None          # [slots, block_size, F] tap rows
        self.free_slots: list[int] = []
        self.free_states = list(state_slots or ())  # state-pool slots set aside for checkpoints
        self.state_slots = len(self.free_states)
        self.checkpoints: OrderedDict[bytes, int] = OrderedDict()   # key of the block it follows -> slot
        self.queries = 0        # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0           # of them, served from the cache
        self.evictions = 0

    # --- what a lookup sees --------------------------------------------------------------
    def longest(self, keys: list[bytes], start: int, stop: int) -> list[int]:
        """Blocks for keys[start:stop] that are cached, up to the first miss."""
        out = []
        for key in keys[start:stop]:
            block = self.block_of.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def has_features(self, block: int, tap) -> bool:
        got = self.features.get(block)
        return got is not None and got[0] == tap

    def features_of(self, block: int, tap) -> torch.Tensor | None:
        """A copy of the block's tap rows [block_size, F], or None when none are stored for `tap`."""
        if not self.has_features(block, tap):
            return None
        self.features.move_to_end(block)
        return self.arena[self.features[block][1]].clone()

    @property
    def feature_bytes(self) -> int:
        return 0 if self.arena is None else len(self.features) * self.arena[0].nbytes

    def checkpoint(self, key: bytes) -> int | None:
        slot = self.checkpoints.get(key)
        if slot is not None:
            self.checkpoints.move_to_end(key)
        return slot

    # --- references ----------------------------------------------------------------------
    def share(self, blocks: list[int]) -> None:
        """A table takes these published blocks (a hit)."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.idle[b]
            self.refs[b] += 1

    def publish(self, block: int, key: bytes) -> bool:
        """A table's own full block of committed tokens becomes findable. False when an equal
        block is already cached (computed twice at once): this one stays private."""
        if key in self.block_of or block in self.key_of:
            return False
        self.block_of[key], self.key_of[block], self.refs[block] = block, key, 1
        return True

    def add_features(self, block: int, tap, rows: torch.Tensor) -> None:
        """Store a copy of rows [block_size, F] with `block` (the oldest stored rows make room)."""
        if block not in self.key_of or self.feature_budget <= 0:
            return
        a = self.arena
        if a is None or a.shape[1:] != rows.shape or a.dtype != rows.dtype or a.device != rows.device:
            if not self._new_arena(rows):
                return
        self._drop_features(block)      # another draft's taps: the newest wins
        if not self.free_slots:
            self._drop_features(next(iter(self.features)))
        slot = self.free_slots.pop()
        self.arena[slot].copy_(rows)
        self.features[block] = (tap, slot)

    def _new_arena(self, rows: torch.Tensor) -> bool:
        """An arena for rows of this shape; rows of another shape (a draft with other taps) go."""
        slots = self.feature_budget // max(1, rows.nelement() * rows.element_size())
        self.features.clear()
        self.arena, self.free_slots = None, []
        if slots == 0:
            return False
        self.arena = torch.empty((slots, *rows.shape), dtype=rows.dtype, device=rows.device)
        if self.arena.device.type == "cpu":
            from .prefault import populate
            populate(self.arena.view(1, slots, -1), 0, slots)
        self.free_slots = list(range(slots - 1, -1, -1))
        return True

    def take_checkpoint_slot(self, key: bytes) -> int | None:
        """A slot to save the state after block `key` in (the oldest checkpoint's when all are
        taken); None when no slots were set aside or this key already has one."""
        if not self.state_slots or key in self.checkpoints:
            return None
        slot = self.free_states.pop() if self.free_states else self.checkpoints.popitem(last=False)[1]
        self.checkpoints[key] = slot
        return slot

    def release(self, blocks: list[int]) -> list[int]:
        """A table lets go of `blocks`: published ones wait in LRU order (the table's tail first);
        the private ones are returned, to go back on the free list."""
        private = []
        for b in reversed(blocks):
            if b in self.key_of:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self.idle[b] = None
            else:
                private.append(b)
        return private

    def evict(self, n: int) -> list[int]:
        """Up to n unreferenced cached blocks, least recently used first, forgotten."""
        out = []
        while self.idle and len(out) < n:
            b, _ = self.idle.popitem(last=False)
            key = self.key_of.pop(b)
            del self.block_of[key], self.refs[b]
            self._drop_features(b)
            slot = self.checkpoints.pop(key, None)
            if slot is not None:
                self.free_states.append(slot)
            self.evictions += 1
            out.append(b)
        return out

    def _drop_features(self, block: int) -> None:
        got = self.features.pop(block, None)
        if got is not None:
            self.free_slots.append(got[1])

    @property
    def cached_blocks(self) -> int:
        return len(self.key_of)
