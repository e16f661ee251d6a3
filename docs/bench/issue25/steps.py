"""Issue 25: round trip, model, queue and wire time of each step kind, measured against running
target and draft services directly (no gateway), so the hop itself is what is timed.

    python docs/bench/issue25/steps.py --target 127.0.0.1:50051 --draft 127.0.0.1:50052 \
        --streams 1,8 --prompts 8 --tokens 64 [--root /path/to/checkout]

Per session: target Open (prompt features come back), draft Open (with them), then DFlash steps
(Propose -> Verify, the committed tokens' features owed to the next Propose) until --tokens are
committed, then a target-only Decode run of 16 tokens with return_hidden. Each kind's round
trip is timed by this client; the services report the forward time (`forward_ms` / `draft_ms`)
and the time the step queued (`queue_ms`); wire = round trip - forward - queue (serialisation,
both gRPC stacks, the loopback socket, the services' asyncio loops). Medians per kind, and
hidden-state bytes per kind. --root picks the checkout whose gateway client (and protos) run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[3]))
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="sessions per streams level")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=64, help="committed tokens per session (DFlash steps)")
    ap.add_argument("--decode", type=int, default=16, help="target-only tokens after them")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, a.root)
    print(json.dumps(asyncio.run(run(a)), indent=1))


async def run(a) -> dict:
    from gateway.backends import DraftClient, TargetClient
    from splitspec.v1 import common_pb2
    target, draft = TargetClient(a.target), DraftClient(a.draft)
    from gateway.backends import BackendError
    for _ in range(240):                     # until both serve (UNAVAILABLE while loading)
        try:
            tinfo, dinfo = await target.get_info(wait_s=60), await draft.get_info(wait_s=60)
            break
        except BackendError:
            await asyncio.sleep(0.5)
    layer_ids = list(dinfo.target_layer_ids)
    want_dtype = getattr(dinfo, "hidden_dtype", 0)      # absent before issue 25: the target's dtype
    out = {"target_dtype": tinfo.dtype, "draft_dtype": dinfo.dtype, "hidden_dtype": want_dtype, "levels": {}}
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(2, tinfo.vocab_size) for _ in range(a.prompt_tokens)] for _ in range(a.prompts)]

    async def session(i, rec):
        sampling = common_pb2.SamplingParams(temperature=0.0)
        async with target.session() as ts, draft.session() as ds:
            t = time.perf_counter()
            opened = await ts.open(f"s{i}", prompts[i], sampling, hidden_layer_ids=layer_ids,
                                   max_new_tokens=a.tokens + a.decode + 16, hidden_dtype=want_dtype)
            rec("target_open", t, opened.forward_ms, opened.queue_ms, len(opened.hidden.data))
            t = time.perf_counter()
            await ds.open(f"s{i}", prompts[i], opened.hidden, common_pb2.SpeculativeParams(method="dflash"), sampling)
            rec("draft_open", t, 0.0, 0.0, len(opened.hidden.data))
            length, owed_ids, owed = opened.length, [opened.first_token_id], None
            done = 1
            while done < a.tokens:
                t = time.perf_counter()
                prop = await ds.propose(length, owed_ids, owed)
                rec("propose", t, prop.draft_ms, prop.queue_ms, len(owed.data) if owed is not None else 0,
                    batch=prop.batch_size)
                t = time.perf_counter()
                ver = await ts.verify(done, length, prop.tree)
                rec("verify", t, ver.forward_ms, ver.queue_ms, len(ver.hidden.data), batch=ver.batch_size)
                owed_ids, owed, length = list(ver.committed_token_ids), ver.hidden, ver.length
                done += len(ver.committed_token_ids)
            t = time.perf_counter()
            async for tok in ts.decode(a.decode, return_hidden=True):
                rec("decode_token", t, tok.forward_ms, tok.queue_ms, len(tok.hidden.data), batch=tok.batch_size)
                t = time.perf_counter()

    for streams in [int(s) for s in a.streams.split(",") if s]:
        rows: dict[str, list] = {}

        def rec(kind, t, fwd, queue, nbytes, batch=1):
            rt = (time.perf_counter() - t) * 1e3
            rows.setdefault(kind, []).append((rt, fwd, queue, rt - fwd - queue, nbytes, batch))

        sem = asyncio.Semaphore(streams)

        async def one(i):
            async with sem:
                await session(i, rec)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(a.prompts)))
        wall = time.perf_counter() - t0
        med = lambda xs: round(statistics.median(xs), 3)
        out["levels"][streams] = {"wall_s": round(wall, 2), **{
            kind: {"n": len(r), "round_trip_ms": med([x[0] for x in r]), "model_ms": med([x[1] for x in r]),
                   "queue_ms": med([x[2] for x in r]), "wire_ms": med([x[3] for x in r]),
                   "hidden_bytes": med([x[4] for x in r]), "batch": med([x[5] for x in r])}
            for kind, r in rows.items()}}
    await target.close()
    await draft.close()
    return out


if __name__ == "__main__":
    main()
