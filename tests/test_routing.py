"""Prefix-affinity routing over target replicas (issue 40, item 5): gateway/routing.py on its
own, and through Backends.pick_target with lazy (never dialled) channels."""
from __future__ import annotations

import asyncio
import functools

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.routing import BLOCK_SIZE, PrefixRouter, prefix_key
from gateway.server import Backends, build_parser, config_from_args
from splitspec.v1 import target_pb2

REPLICAS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051", "10.0.0.4:50051"]


def prompt(seed: int, n: int = 80) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def key(seed: int, salt: str = "") -> bytes:
    return prefix_key(prompt(seed), salt)


# ---- the key ----------------------------------------------------------------------------------

def test_key_covers_the_first_blocks_and_the_salt():
    p = prompt(1, 200)
    assert prefix_key(p) == prefix_key(p[:64] + [5, 6, 7])        # past the first 4 blocks: same key
    assert prefix_key(p) != prefix_key(p[:63] + [p[63] + 1])       # a token inside them: another
    assert prefix_key(p) != prefix_key(p, "tenant-a") != prefix_key(p, "tenant-b")
    assert prefix_key(p[:20]) == prefix_key(p[:31])                # only full blocks count
    assert prefix_key(p[:BLOCK_SIZE - 1]) is None                  # nothing cacheable: spread instead
    assert prefix_key([]) is None
    assert isinstance(prefix_key(p), bytes)                        # hashlib, stable across processes


def test_key_is_stable_across_processes():
    # A fixed value: a gateway restart (or a second gateway) must route as the first one did.
    assert prefix_key(range(16)).hex() == "8c65a46052a3700de313ac829e133705"
    assert prefix_key(range(16), "s").hex() == "1f522e734361eba62fdafc524ec61946"


# ---- the router -------------------------------------------------------------------------------

def test_same_prefix_goes_to_the_same_replica():
    r = PrefixRouter(REPLICAS)
    for seed in range(50):
        first = r.pick(key(seed))
        assert all(r.pick(key(seed)) == first for _ in range(5))
        assert PrefixRouter(reversed(REPLICAS)).pick(key(seed)) == first   # order of --target does not matter


def test_the_salt_is_part_of_the_key():
    r = PrefixRouter(REPLICAS)
    p = prompt(7)
    homes = {r.pick(prefix_key(p, f"tenant-{i}")) for i in range(40)}
    assert len(homes) > 1            # same prompt, other namespaces: not all pinned to one replica


def test_bounded_load_spills_to_another_replica():
    r = PrefixRouter(REPLICAS[:2], load_factor=1.25, balance_abs=0)
    k = key(3)
    home = r.pick(k)
    placed = []
    for _ in range(20):              # 20 concurrent requests with one hot prefix
        name = r.pick(k)
        r.acquire(name)
        placed.append(name)
        assert r.inflight[name] <= math.ceil(1.25 * sum(r.inflight.values()) / 2)    # ceil(c * m / n)
    counts = Counter(placed)
    assert placed[0] == home and set(counts) == set(REPLICAS[:2])
    assert counts[home] >= counts[next(n for n in counts if n != home)]    # affinity still favours home
    assert max(counts.values()) <= 13                                       # ceil(1.25 * 20 / 2)
    for name in placed:              # as they end, the hot prefix goes home again
        r.release(name)
    assert r.pick(k) == home and sum(r.inflight.values()) == 0


def test_small_imbalances_keep_the_prefix_on_its_replica():
    """The bound applies only past `balance_abs` more requests than the least loaded replica."""
    r = PrefixRouter(REPLICAS[:2], load_factor=1.25, balance_abs=6)
    k = key(3)
    placed = []
    for _ in range(10):
        name = r.pick(k)
        r.acquire(name)
        placed.append(name)
    # Home takes the first 6 (over the bound of ceil(1.25 * m / 2) from the 3rd on, but fewer than
    # 6 ahead of the other); the 7th would put it 6 ahead: it goes to the other, and so on.
    assert placed[:6] == [placed[0]] * 6 and placed[6] != placed[0]
    assert max(r.inflight.values()) - min(r.inflight.values()) <= 6


def test_a_large_load_factor_keeps_the_prefix_together():
    r = PrefixRouter(REPLICAS[:2], load_factor=100)
    k = key(3)
    for _ in range(20):
        r.acquire(r.pick(k))
    assert sorted(r.inflight.values()) == [0, 20]


def test_unhealthy_and_excluded_replicas_are_skipped():
    r = PrefixRouter(REPLICAS)
    k = key(11)
    order = r.ring_order(k)
    assert r.pick(k) == order[0]
    assert r.pick(k, healthy=lambda n: n != order[0]) == order[1]
    assert r.pick(k, exclude={order[0]}) == order[1]
    assert r.pick(k, exclude={order[0]}, healthy=lambda n: n != order[1]) == order[2]
    # Nothing healthy: the first one not tried anyway (it answers UNAVAILABLE; failover goes on).
    assert r.pick(k, exclude={order[0]}, healthy=lambda n: False) == order[1]
    assert r.pick(k, exclude=set(REPLICAS)) is None


def test_removing_a_replica_moves_only_its_keys():
    three, two = PrefixRouter(REPLICAS[:3]), PrefixRouter(REPLICAS[:2])
    keys = [key(s) for s in range(600)]
    before = {k: three.pick(k) for k in keys}
    moved = [k for k in keys if two.pick(k) != before[k]]
    assert moved and all(before[k] == REPLICAS[2] for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == REPLICAS[2])
    # Adding it back restores them (the ring is a function of the names, not of history).
    assert all(PrefixRouter(REPLICAS[:3]).pick(k) == before[k] for k in keys)


def test_prefixes_spread_roughly_evenly():
    r = PrefixRouter(REPLICAS)
    counts = Counter(r.pick(key(s)) for s in range(4000))
    assert set(counts) == set(REPLICAS)
    assert all(600 <= c <= 1400 for c in counts.values()), counts     # 1000 each, loosely


def test_load_factor_below_one_is_refused():
    with pytest.raises(ValueError):
        PrefixRouter(REPLICAS, load_factor=0.9)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), excluded=st.sets(st.integers(0, 5)), sick=st.sets(st.integers(0, 5)),
       loads=st.lists(st.integers(0, 9), min_size=6, max_size=6), salt=st.text(max_size=8),
       ids=st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=80))
def test_pick_never_returns_an_excluded_replica(n, excluded, sick, loads, salt, ids):
    names = REPLICAS[:4] + ["10.0.0.5:50051", "10.0.0.6:50051"]
    r = PrefixRouter(names[:n])
    for i in range(n):
        r.inflight[names[i]] = loads[i]
    skip = {names[i] for i in excluded if i < n}
    healthy = {names[i] for i in range(n) if i not in sick}
    got = r.pick(prefix_key(ids, salt), exclude=skip, healthy=healthy.__contains__)
    if len(skip) == n:
        assert got is None
        return
    assert got in r.names and got not in skip
    if healthy - skip:               # healthy first
        assert got in healthy
        least = min(r.inflight[m] for m in healthy - skip)
        under = [m for m in healthy - skip
                 if r.inflight[m] < r.bound(len(healthy)) or r.inflight[m] - least < r.balance_abs]
        if under:                    # and within the bound (or the balance slack) whenever one is
            assert got in under


# ---- through Backends -------------------------------------------------------------------------

def in_loop(test):
    """Run the test inside an event loop: Backends makes grpc.aio channels, which need one (an
    earlier test may have left the main thread without a default loop)."""
    @functools.wraps(test)
    def run(*a, **kw):
        async def main():
            return test(*a, **kw)
        return asyncio.run(main())
    return run


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
@in_loop
def test_backends_pick_target(policy):
    cfg = GatewayConfig(targets=("127.0.0.1:1", "127.0.0.1:2"), routing_policy=policy)
    b = Backends(cfg)                # channels are lazy: nothing is dialled
    keys = [key(s) for s in range(20)]
    homes = [b.pick_target(key=k) for k in keys]
    again = [b.pick_target(key=k) for k in keys]
    if policy == "prefix":
        assert again == homes and len(set(map(id, homes))) == 2
        first = homes[0]
        with b.serving(first):       # a request there: the next one with this prefix still goes there
            assert b.pick_target(key=keys[0]) is first
            assert b.router.inflight[first.address] == 1
        assert b.router.inflight[first.address] == 0
        # Failover: the one tried is excluded, then nothing is left.
        other = b.pick_target(exclude={id(first)}, key=keys[0])
        assert other is not first and other is not None
        assert b.pick_target(exclude={id(first), id(other)}, key=keys[0]) is None
        # Unhealthy: skipped while another is healthy.
        b.target_health(first).healthy = False      # as mark_failed leaves it, without its probe loop
        assert b.pick_target(key=keys[0]) is other
    else:
        assert [c.address for c in homes[:4]] == ["127.0.0.1:1", "127.0.0.1:2"] * 2


@in_loop
def test_the_key_follows_the_block_size_the_target_reports():
    b = Backends(GatewayConfig(targets=("127.0.0.1:1", "127.0.0.1:2")))
    p = prompt(1, n=200)
    assert b.routing_key(p, "s") == prefix_key(p, "s", block_size=BLOCK_SIZE)     # no GetInfo yet
    b.info = target_pb2.TargetInfo(kv_block_size=0)                              # an old target
    assert b.routing_key(p, "s") == prefix_key(p, "s", block_size=BLOCK_SIZE)
    b.info = target_pb2.TargetInfo(kv_block_size=32)
    assert b.routing_key(p, "s") == prefix_key(p, "s", block_size=32) != prefix_key(p, "s")
    # Four blocks of 32: a change at token 100 moves the key, one past 128 does not; a prompt
    # shorter than one block has nothing the target could reuse.
    assert b.routing_key(p) != b.routing_key(p[:100] + [p[100] + 1] + p[101:])
    assert b.routing_key(p) == b.routing_key(p[:128] + [7])
    assert b.routing_key(p[:20]) is None and prefix_key(p[:20]) is not None


@in_loop
def test_one_target_is_picked_as_before():
    b = Backends(GatewayConfig(targets=("dns:///target:50051",)))
    t = b.targets[0]
    assert b.pick_target(key=key(1)) is t and b.pick_target() is t
    assert b.pick_target(exclude={id(t)}, key=key(1)) is None       # then failover retries the name


@in_loop
def test_a_target_given_twice_stays_two_clients():
    b = Backends(GatewayConfig(targets=("127.0.0.1:1", "127.0.0.1:1")))
    first = b.pick_target(key=key(1))
    second = b.pick_target(exclude={id(first)}, key=key(1))
    assert second is not None and second is not first


def test_flags_and_environment(monkeypatch):
    args = build_parser().parse_args(["--target", "a:1,b:1"])
    cfg = config_from_args(args)
    assert (cfg.routing_policy, cfg.routing_load_factor) == ("prefix", 1.25)
    monkeypatch.setenv("SPLITSPEC_ROUTING_POLICY", "round_robin")
    monkeypatch.setenv("SPLITSPEC_ROUTING_LOAD_FACTOR", "2")
    cfg = config_from_args(build_parser().parse_args(["--target", "a:1"]))
    assert (cfg.routing_policy, cfg.routing_load_factor) == ("round_robin", 2.0)
    with pytest.raises(SystemExit):
        config_from_args(build_parser().parse_args(["--target", "a:1", "--routing-load-factor", "0.5"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--target", "a:1", "--routing-policy", "random"])
