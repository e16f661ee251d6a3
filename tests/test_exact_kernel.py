"""The native batch-invariant attention (splitspec/engine/csrc/exact_attention.cpp): every decode
and verify token of a forward in one call a layer. It attends what the per-token SDPA calls
attend (same keys, same result to rounding), and a token's bits depend only on its own keys:
not on the other rows in the call, their order, or the thread count."""
from __future__ import annotations

import pytest
import torch

from splitspec.engine.attention import Row, exact_kernel, paged_attention, plan_attention
from splitspec.engine.kv_pool import BlockTable, KVPool

pytestmark = pytest.mark.skipif(exact_kernel() is None, reason="the native kernel could not be built here "
                                "(no compiler or ninja); the per-token SDPA path serves")
HQ, HKV, D, BS = 6, 2, 32, 16


def _pool(dtype, seed=0):
    pool = KVPool(num_layers=1, num_kv_heads=HKV, head_dim=D, num_blocks=64, block_size=BS, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g).to(dtype))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g).to(dtype))
    return pool


def _rows(pool, shapes):
    """Rows of (context, new tokens, tree mask or None) on tables of their own."""
    rows = []
    for c, q, mask in shapes:
        t = BlockTable(pool)
        t.ensure(c + q)
        t.length = c
        rows.append(Row(t, q, mask))
    return rows


TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_attends_what_the_per_token_calls_attend(dtype):
    pool = _pool(dtype)
    shapes = [(37, 1, None), (5, 1, None), (40, 4, TREE), (16, 5, None)]
    q = torch.randn(sum(s[1] for s in shapes), HQ, D).to(dtype)
    rows = _rows(pool, shapes)
    fast = paged_attention(q, pool.k[0], pool.v[0], plan_attention(rows, "cpu", exact=True, kernel=True))
    slow = paged_attention(q, pool.k[0], pool.v[0], plan_attention(rows, "cpu", exact=True, kernel=False))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fast.float(), slow.float(), rtol=tol, atol=tol)


def test_a_tokens_bits_depend_only_on_its_own_keys():
    pool = _pool(torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(2)
    q_alone = torch.randn(1, HQ, D, generator=g).bfloat16()
    rows = _rows(pool, [(70, 1, None)])
    alone = paged_attention(q_alone, pool.k[0], pool.v[0], plan_attention(rows, "cpu", exact=True))
    for others in ([(3, 1, None)], [(9, 4, TREE), (100, 1, None)], [(1, 1, None)] * 20):
        # The same token and keys, with other rows before it in the call.
        extra = _rows(pool, others)
        plan = plan_attention(extra + rows, "cpu", exact=True)
        n = sum(s[1] for s in others)
        q = torch.cat([torch.randn(n, HQ, D, generator=g).bfloat16(), q_alone])
        assert torch.equal(paged_attention(q, pool.k[0], pool.v[0], plan)[-1:], alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(q_alone, pool.k[0], pool.v[0], plan_attention(rows, "cpu", exact=True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)


def test_a_chain_node_reads_the_keys_of_the_decode_it_stands_for():
    """Node i of a verified chain is the token a decode at that position attends: same bits."""
    pool = _pool(torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, HQ, D, generator=g).bfloat16()
    row = _rows(pool, [(30, 5, torch.ones(5, 5, dtype=torch.bool).tril())])[0]     # a verified chain
    verify = paged_attention(q, pool.k[0], pool.v[0], plan_attention([row], "cpu", exact=True))
    table = row.table
    for i in range(5):
        table.length = 30 + i
        dec = paged_attention(q[i:i + 1], pool.k[0], pool.v[0], plan_attention([Row(table, 1)], "cpu", exact=True))
        assert torch.equal(dec, verify[i:i + 1]), i
