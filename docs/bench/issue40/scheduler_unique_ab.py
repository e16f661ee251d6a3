"""Issue 40: the prefix cache's own cost on prompts that share nothing, in process (no services, no
network): the target's scheduler over 8 unique 1,600-token prompts at once (32 new tokens each),
cache on vs off, with and without a draft's taps, interleaved, 3 repeats; prints on/off ratios
of the median TTFT and of the total time.

    python docs/bench/issue40/scheduler_unique_ab.py
"""
import asyncio
import random
import statistics
import time

from splitspec.engine.loop import EngineLoop
from splitspec.engine.sample import SamplingParams
from splitspec.models.loader import load_model
from target_service.torch_verifier import TorchVerifier
from target_service.scheduler import Scheduler
from target_service.pools import make_pool
model = load_model("models/splitspec-code-target")
def run(cache, taps, seed):
    r = random.Random(seed)
    prompts = [[r.randrange(3, 8000) for _ in range(1600)] for _ in range(8)]
    async def main():
        engine = EngineLoop()
        pool = make_pool(model, budget_bytes=4096 * 2**20, block_size=16, max_sessions=64, prefix_cache=cache, feature_budget_bytes=256 * 2**20)
        sched = Scheduler(model, verifier=TorchVerifier(), engine=engine, pool=pool, max_running=64, max_queued=64, max_batched_tokens=512, chunked_prefill_size=128, max_context=2048)
        await sched.warmup()
        t = time.perf_counter()
        async def one(i, p):
            s, step = await sched.open(str(i), p, SamplingParams(), max_new_tokens=40, hidden_layers=(1, 3, 5, 7) if taps else (), hidden_last=255 if taps else 0)
            ttft = time.perf_counter() - t
            async for _ in sched.decode(s, 32):
                pass
            sched.close(s)
            return ttft
        ttfts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        total = time.perf_counter() - t
        engine.stop()
        return statistics.median(ttfts), total
    return asyncio.run(main())
res = {}
for rep in range(3):
    for taps in (False, True):
        for cache in ((True, False) if rep % 2 == 0 else (False, True)):
            res.setdefault((taps, cache), []).append(run(cache, taps, rep))
for taps in (False, True):
    on, off = res[(taps, True)], res[(taps, False)]
    print("taps" if taps else "plain", "ttft on/off", [round(a[0] / b[0], 3) for a, b in zip(on, off)], "total on/off", [round(a[1] / b[1], 3) for a, b in zip(on, off)])
