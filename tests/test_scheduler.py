"""The engine loop without gRPC: sessions submit steps to one worker; concurrent sessions
interleave and each still equals the in-process reference; admission and KV accounting."""
from __future__ import annotations

import asyncio

import pytest

from service_helpers import tiny_target_dir
from target_service.engine import generate
from target_service.flashinfer_backend import TorchVerifier
from target_service.loader import load_model
from splitspec.engine.sample import SamplingParams
from target_service.scheduler import AdmissionError, ContextError, EngineLoop, Scheduler
from splitspec.engine.tree import Tree


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_target_dir())


def run(model, body, **kw):
    async def main():
        engine = EngineLoop()
        try:
            sched = Scheduler(model, verifier=TorchVerifier(), engine=engine, **{
                "max_sessions": 4, "kv_budget_bytes": 1 << 30, "max_context": 256, **kw})
            return await body(sched)
        finally:
            engine.stop()
    return asyncio.run(main())


def test_concurrent_sessions_interleave_and_match_the_reference(model):
    prompts = {1: [5, 6, 7], 2: [9, 10], 3: [40, 41, 42, 43]}

    async def one(sched, seed, prompt):
        params = SamplingParams(temperature=1.0, seed=seed)
        session, step = await sched.open(str(seed), prompt, params, max_new_tokens=20)
        out = [step.out.committed[0]]
        async for s in sched.decode(session, 19):
            out.append(s.out.committed[0])
            await asyncio.sleep(0)
        sched.close(session)
        return out

    async def body(sched):
        return await asyncio.gather(*(one(sched, s, p) for s, p in prompts.items()))
    results = run(model, body)
    for (seed, prompt), out in zip(prompts.items(), results):
        assert out == generate(model, prompt, 20, params=SamplingParams(temperature=1.0, seed=seed))


def test_verify_commits_and_kv_accounting(model):
    async def body(sched):
        session, step = await sched.open("v", [5, 6, 7], SamplingParams(), max_new_tokens=10)
        assert sched.active_sessions == 1 and sched.kv_bytes == session.kv_bytes > 0
        ref = generate(model, [5, 6, 7], 4)
        verified = await sched.verify(session, session.length, Tree.chain(ref[1:3]), None)
        assert verified.out.committed == ref[1:4]          # both drafts accepted + bonus (greedy)
        sched.close(session)
        assert sched.active_sessions == 0 and sched.kv_bytes == 0
    run(model, body)


def test_admission(model):
    async def body(sched):
        with pytest.raises(ContextError):
            await sched.open("long", [5] * 256, SamplingParams())
        sessions = [(await sched.open(str(i), [5], SamplingParams(), max_new_tokens=4))[0] for i in range(2)]
        with pytest.raises(AdmissionError, match="--max-sessions"):
            await sched.open("extra", [5], SamplingParams(), max_new_tokens=4)
        for s in sessions:
            sched.close(s)
        assert sched.active_sessions == 0
    run(model, body, max_sessions=2)
