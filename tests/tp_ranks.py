"""Rank bodies for tests/test_tensor_parallel.py, in a module of their own so that a spawned
rank imports torch and the target only (not the test module's services, draft and transformers)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from target_service.engine import forward_sequences
from splitspec.models.loader import load_model
from splitspec.models.dense import rope_cos_sin
from target_service.parallel import load_sharded


def check_sharded(rank: int, world: int, port: int, dense: list[str], hybrid: list[str]) -> None:
    """Each dense checkpoint layer by layer, each hybrid one whole, against the unsharded model
    (raises on a mismatch). One process group for all: spawning ranks is what costs."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    try:
        for path in dense:
            _check(rank, world, path)
        for path in hybrid:
            _check_hybrid(rank, world, path)
    finally:
        dist.destroy_process_group()


def _whole(shard, layout, ids, layers=()):
    """forward_sequences on one rank's shard, its pool sized to the rank's share of the heads
    (what rank 0's driver and the workers declare to make_pool in the service)."""
    shard.local_kv_heads, shard.local_kda_heads = layout.kv_heads, layout.kda_heads
    return forward_sequences(shard, ids, hidden_layers=layers)


def _check(rank: int, world: int, path: str) -> None:
    ref = load_model(path)
    tp, layout = load_sharded(path, world, rank, dtype=torch.float32, device=torch.device("cpu"))
    cfg = ref.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
    with torch.inference_mode():
        # Vocab-parallel embedding: one row plus zeros, so exact.
        assert torch.equal(tp.model.embed_tokens(ids), ref.model.embed_tokens(ids)), path
        x = torch.randn(1, 9, cfg.hidden_size, generator=g)
        cos, sin = rope_cos_sin(ref.inv_freq(x.device), torch.arange(9), x.dtype)
        for mine, theirs in zip(tp.model.layers, ref.model.layers):
            # Column-parallel q/k/v (KV heads split or replicated) + row-parallel o_proj.
            torch.testing.assert_close(mine.self_attn(x, cos, sin), theirs.self_attn(x, cos, sin), rtol=1e-5, atol=1e-5)
            # Column-parallel gate/up + row-parallel down_proj.
            torch.testing.assert_close(mine.mlp(x), theirs.mlp(x), rtol=1e-5, atol=1e-5)
        head = tp.lm_head(x)
        mine = _whole(tp, layout, ids)
        if rank == 0:       # rank 0 gathers every vocabulary range; the others hold none
            torch.testing.assert_close(head, ref.lm_head(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.logits, forward_sequences(ref, ids).logits, rtol=1e-4, atol=1e-4)
        else:
            assert head is None and mine.logits is None


def _check_hybrid(rank: int, world: int, path: str) -> None:
    """A Kimi-family checkpoint: whole-sequence logits and every layer's tap against the unsharded model."""
    ref = load_model(path)
    tp, layout = load_sharded(path, world, rank, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.randint(0, ref.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    layers = list(range(ref.cfg.num_hidden_layers))
    with torch.inference_mode():
        mine, theirs = _whole(tp, layout, ids, layers), forward_sequences(ref, ids, hidden_layers=layers)
    # Every rank holds the full residual stream after each all-reduce: the taps match everywhere.
    torch.testing.assert_close(mine.hidden, theirs.hidden, rtol=1e-4, atol=1e-4)
    if rank == 0:
        torch.testing.assert_close(mine.logits, theirs.logits, rtol=1e-4, atol=1e-4)
