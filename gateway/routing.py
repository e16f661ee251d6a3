"""Which target replica a request goes to: prefix affinity with bounded loads.

A target keeps the KV of full prompt blocks (TargetInfo.kv_block_size tokens) in its prefix cache, so a request whose
prompt starts like an earlier one is cheaper on the replica that served the earlier one. The
gateway therefore hashes the start of the prompt (with the request's cache_salt, which
namespaces the cache) to a point on a consistent-hash ring of the replicas and walks clockwise
to the first replica that is usable. Consistent hashing keeps the mapping stable when replicas
come and go (only the keys of the replica that left move); the load bound of "Consistent
Hashing with Bounded Loads" (Mirrokni, Thorup, Zadimoghaddam, 2016) keeps a hot prefix from
piling every request onto one replica: a replica already holding its share of the in-flight
requests is passed over for the next one on the ring. As in SGLang's cache-aware router, the
bound only applies once the replica holds `balance_abs` more requests than the least loaded
one: at small loads a cache hit is worth more than an even split (8 conversations on 2
replicas would otherwise often move one away from its cache).
"""
from __future__ import annotations

import bisect
import hashlib
import math
import struct
from typing import Callable, Iterable

BLOCK_SIZE = 16         # the prefix-cache block of a target that does not report its own (kv_block_size 0)
KEY_BLOCKS = 4          # the first 4 blocks (64 tokens at 16): the shared part (system prompt, template) decides
VNODES = 64             # points per replica: smooths the share of each replica to a few percent
LOAD_FACTOR = 1.25      # c of the paper: a replica may hold up to c times the mean load
BALANCE_ABS = 32        # ... once it holds this many more than the least loaded (SGLang's balance_abs_threshold)


def _hash64(data: bytes) -> int:
    # Not hash(): it is salted per process, and gateways (and restarts) must agree.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(prompt_ids: Iterable[int], cache_salt: str = "", *, blocks: int = KEY_BLOCKS,
               block_size: int = BLOCK_SIZE) -> bytes | None:
    """The routing key of a prompt: its first `blocks` full blocks and the salt, or None when
    the prompt has no full block (no replica can hold a reusable prefix of it, so it is better
    spread than pinned)."""
    ids = list(prompt_ids)
    full = min(len(ids) // block_size, blocks) * block_size
    if not full:
        return None
    salt = cache_salt.encode()
    # Length-prefixed salt: ("ab", [..]) and ("a", [b..]) must not collide.
    return hashlib.blake2b(struct.pack("<I", len(salt)) + salt + struct.pack(f"<{full}q", *ids[:full]),
                           digest_size=16).digest()


class PrefixRouter:
    """Replicas by name on a hash ring, with the number of requests in flight on each."""

    def __init__(self, names: Iterable[str], *, load_factor: float = LOAD_FACTOR, vnodes: int = VNODES,
                 balance_abs: int = BALANCE_ABS):
        self.names = list(dict.fromkeys(names))
        if load_factor < 1:
            raise ValueError(f"load factor {load_factor} < 1: no placement could stay within the bound")
        self.load_factor = load_factor
        self.balance_abs = balance_abs
        ring = sorted((_hash64(f"{n}#{v}".encode()), n) for n in self.names for v in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]
        self.inflight = dict.fromkeys(self.names, 0)

    def acquire(self, name: str) -> None:
        self.inflight[name] += 1

    def release(self, name: str) -> None:
        self.inflight[name] = max(0, self.inflight[name] - 1)

    def ring_order(self, key: bytes) -> list[str]:
        """Every replica once, clockwise from the key's point: the key's preference order."""
        order: dict[str, None] = {}
        start = bisect.bisect(self._points, _hash64(key))
        for i in range(len(self._owners)):
            order.setdefault(self._owners[(start + i) % len(self._owners)])
            if len(order) == len(self.names):
                break
        return list(order)

    def bound(self, healthy: int) -> int:
        """Most requests one replica may hold, the new one included."""
        total = sum(self.inflight.values()) + 1
        return math.ceil(self.load_factor * total / max(1, healthy))

    def pick(self, key: bytes, *, exclude: Iterable[str] = (),
             healthy: Callable[[str], bool] = lambda name: True) -> str | None:
        """The first replica on the ring from `key` that is healthy, not excluded and under the
        load bound. When all of those are at the bound (only possible with exclusions), the
        least loaded of them; when none is healthy, the first one not excluded (it answers
        UNAVAILABLE, and failover moves on); None when every replica is excluded."""
        skip = set(exclude)
        candidates = [n for n in self.ring_order(key) if n not in skip]
        if not candidates:
            return None
        ok = [n for n in candidates if healthy(n)]
        if not ok:
            return candidates[0]
        cap = self.bound(sum(1 for n in self.names if healthy(n)))
        least = min(self.inflight[n] for n in ok)
        for n in ok:
            if self.inflight[n] < cap or self.inflight[n] - least < self.balance_abs:
                return n
        return min(ok, key=lambda n: self.inflight[n])     # min keeps ring order among ties
