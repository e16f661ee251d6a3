"""The target's Scheduler in process, for the tests that drive it directly (no gRPC): a small
KV pool, an engine thread, and the body of the test run on the scheduler in an event loop."""
from __future__ import annotations

import asyncio

from splitspec.engine.kv_pool import KVPool
from splitspec.engine.loop import EngineLoop
from target_service.scheduler import Scheduler
from target_service.torch_verifier import TorchVerifier

SMALL = {"max_running": 4, "max_queued": 16, "max_batched_tokens": 64, "chunked_prefill_size": 8, "max_context": 256}


def kv_pool(model, blocks: int = 256, block_size: int = 4) -> KVPool:
    cfg = model.cfg
    return KVPool(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                  num_blocks=blocks, block_size=block_size)


def run_scheduler(model, body, *, pool=None, blocks: int = 256, **kw):
    """`await body(sched)` on a Scheduler over `model` with the torch verifier, and its result;
    the engine thread stops after. `pool`: the KV pool (default: a plain one of `blocks` blocks
    of 4 tokens); `kw`: Scheduler arguments over SMALL."""
    async def main():
        engine = EngineLoop()
        try:
            sched = Scheduler(model, verifier=TorchVerifier(), engine=engine,
                              pool=pool if pool is not None else kv_pool(model, blocks), **{**SMALL, **kw})
            return await body(sched)
        finally:
            engine.stop()
    return asyncio.run(main())
