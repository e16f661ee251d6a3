"""The target's scheduler without gRPC: concurrent sessions run in shared batched forwards and
each still equals the in-process reference; admission queues instead of refusing; closing
frees the slot and the blocks; chunked prefill."""
from __future__ import annotations

import asyncio
import threading

import pytest

from scheduler_helpers import kv_pool, run_scheduler
from service_helpers import tiny_target_dir
from splitspec.engine.sample import SamplingParams
from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence, generate
from splitspec.models.loader import load_model
from target_service.runner import Decode, Verify
from target_service.scheduler import AdmissionError, ContextError


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_target_dir())


make_pool = kv_pool


def run(model, body, blocks=256, **kw):
    return run_scheduler(model, body, blocks=blocks, **kw)


def test_concurrent_sessions_share_forwards_and_match_the_reference(model):
    prompts = {1: [5, 6, 7], 2: [9, 10], 3: [40, 41, 42, 43], 4: list(range(50, 90))}

    async def one(sched, seed, prompt):
        params = SamplingParams(temperature=1.0, seed=seed)
        session, step = await sched.open(str(seed), prompt, params, max_new_tokens=20)
        out, sizes = [step.out.committed[0]], []
        async for s in sched.decode(session, 19):
            out.append(s.out.committed[0])
            sizes.append(s.batch_size)
        sched.close(session)
        return out, sizes

    async def body(sched):
        res = await asyncio.gather(*(one(sched, s, p) for s, p in prompts.items()))
        return res, sched.rows / sched.forwards
    results, mean_batch = run(model, body)
    for (seed, prompt), (out, _) in zip(prompts.items(), results):
        assert out == generate(model, prompt, 20, params=SamplingParams(temperature=1.0, seed=seed))
    assert max(max(sizes) for _, sizes in results) >= 2 and mean_batch > 1.5   # steps really shared forwards


def test_verify_commits_and_blocks_come_back(model):
    async def body(sched):
        session, step = await sched.open("v", [5, 6, 7], SamplingParams(), max_new_tokens=10)
        assert sched.active_sessions == 1 and sched.kv_bytes > 0
        ref = generate(model, [5, 6, 7], 4)
        verified = await sched.verify(session, session.length, Tree.chain(ref[1:3]), None)
        assert verified.out.committed == ref[1:4]          # both drafts accepted + bonus (greedy)
        assert verified.queue_ms >= 0 and verified.batch_size == 1
        sched.close(session)
        assert sched.active_sessions == 0
        assert sched.kv_bytes == 0 and sched.pool.free_blocks == sched.pool.capacity_blocks
    run(model, body)


def test_admission_queues_then_refuses_only_when_the_queue_is_full(model):
    async def body(sched):
        with pytest.raises(ContextError):
            await sched.open("long", [5] * 256, SamplingParams())
        running = [(await sched.open(str(i), [5], SamplingParams(), max_new_tokens=4))[0] for i in range(2)]
        waiter = asyncio.ensure_future(sched.open("third", [5], SamplingParams(), max_new_tokens=4))
        await asyncio.sleep(0.2)
        assert not waiter.done() and len(sched.waiting) == 1       # waits, does not fail
        with pytest.raises(AdmissionError, match="--max-queued-requests 1"):
            await sched.open("fourth", [5], SamplingParams(), max_new_tokens=4)
        sched.close(running[0])                                    # frees the slot at once
        third, step = await asyncio.wait_for(waiter, 30)
        assert step.queue_ms > 100 and len(sched.waiting) == 0
        for s in (running[1], third):
            sched.close(s)
        assert sched.active_sessions == 0
    run(model, body, max_running=2, max_queued=1)


def test_a_request_the_pool_can_never_hold_is_refused(model):
    async def body(sched):
        with pytest.raises(AdmissionError, match="--kv-cache-budget-mb"):
            await sched.open("big", [5], SamplingParams(), max_new_tokens=100)     # 26 blocks > 15
        session, _ = await sched.open("fits", [5], SamplingParams(), max_new_tokens=20)
        sched.close(session)
    run(model, body, blocks=16)


def test_pool_reservation_makes_sessions_wait_not_fail(model):
    async def body(sched):
        a, _ = await sched.open("a", [5], SamplingParams(), max_new_tokens=40)      # 11 of 15 blocks
        waiter = asyncio.ensure_future(sched.open("b", [6], SamplingParams(), max_new_tokens=40))
        await asyncio.sleep(0.2)
        assert not waiter.done() and len(sched.waiting) == 1
        sched.close(a)
        b, _ = await asyncio.wait_for(waiter, 30)
        sched.close(b)
    run(model, body, blocks=16)


def test_cancelled_waiter_leaves_the_queue(model):
    async def body(sched):
        a, _ = await sched.open("a", [5], SamplingParams(), max_new_tokens=4)
        waiter = asyncio.ensure_future(sched.open("b", [6], SamplingParams(), max_new_tokens=4))
        await asyncio.sleep(0.1)
        waiter.cancel()
        await asyncio.sleep(0.1)
        assert len(sched.waiting) == 0 and sched.active_sessions == 1
        sched.close(a)
    run(model, body, max_running=1)


def test_chunked_prefill_under_a_running_decoder_gives_the_same_token_and_cache(model):
    prompt = list(range(100, 170))                 # 70 tokens: 9 chunks of <= 8 while another decodes

    async def body(sched):
        dec, _ = await sched.open("dec", [5, 6], SamplingParams(), max_new_tokens=60)
        stream = sched.decode(dec, 40)
        first = await stream.__anext__()
        long_, step = await sched.open("long", prompt, SamplingParams(), hidden_layers=(0, 1), max_new_tokens=4)
        rest = [s async for s in stream]
        k, v = long_.seq.table.dense()
        sched.close(dec)
        sched.close(long_)
        return step, k, v, [first, *rest]
    step, k, v, decoded = run(model, body)
    ref = TargetSequence(model, prompt, hidden_layers=(0, 1))
    out = ref.prefill()
    assert step.out.committed == out.committed
    assert (step.out.hidden - out.hidden).abs().max() < 1e-5
    assert (k - ref.cache.k).abs().max() < 1e-5 and (v - ref.cache.v).abs().max() < 1e-5
    # The decoder kept running while the prompt prefilled: it shared forwards with the chunks.
    assert max(s.batch_size for s in decoded) == 2
    assert max(s.batch_tokens for s in decoded) <= 64


def test_kv_memory_in_use_is_the_tokens_rounded_up_to_a_block(model):
    """Blocks are taken as tokens arrive, not reserved up front: a session's KV in use is its
    cached tokens rounded up to one block, whatever max_new_tokens it reserved."""
    async def body(sched):
        sessions = []
        for i, (prompt_len, n) in enumerate([(3, 5), (9, 0), (17, 12), (30, 1)]):
            s, _ = await sched.open(str(i), list(range(5, 5 + prompt_len)), SamplingParams(), max_new_tokens=200)
            if n:
                async for _ in sched.decode(s, n):
                    pass
            sessions.append(s)
        bs = sched.pool.block_size
        cached = [s.seq.table.length for s in sessions]
        assert cached == [s.length - 1 for s in sessions]
        assert sched.pool.used_blocks == sum(-(-c // bs) for c in cached)
        per_token = sched.pool.bytes_per_block // bs
        assert sched.kv_bytes - sum(c * per_token for c in cached) < len(sessions) * sched.pool.bytes_per_block
        assert sched.reserved_blocks == sum(s.reserve_blocks for s in sessions) > sched.pool.used_blocks
        for s in sessions:
            sched.close(s)
    run(model, body)


def test_a_decode_stream_stopped_mid_step_leaves_the_engine_serving(model):
    """The consumer of a Decode goes away while its next step is in the forward (a cancelled
    client): the result is dropped, and the engine keeps serving everyone else."""
    async def body(sched):
        for i in range(20):
            s, _ = await sched.open(f"s{i}", [5, 6, 7], SamplingParams(), max_new_tokens=60)
            stream = sched.decode(s, 50)
            await stream.__anext__()          # the engine is already running the next token
            await stream.aclose()
            await asyncio.sleep(0.02)         # that step ends before the server gets to close
            sched.close(s)

        async def after():
            other, _ = await sched.open("after", [5, 6, 7], SamplingParams(), max_new_tokens=10)
            out = [st.out.committed[0] async for st in sched.decode(other, 5)]
            sched.close(other)
            return out
        return await asyncio.wait_for(after(), 60)
    assert run(model, body) == generate(model, [5, 6, 7], 6)[1:]


def test_an_extended_decode_run_stays_in_every_forward(model):
    """`extend` while a run streams: the run yields the extra tokens in order (the same as one
    longer run) and the session never leaves the batch, so beside another decoder every one of
    its steps shares a forward; once the run is over, `extend` says so and changes nothing."""
    async def body(sched):
        a, _ = await sched.open("a", [9, 10], SamplingParams(), max_new_tokens=80)
        b, _ = await sched.open("b", [5, 6, 7], SamplingParams(), max_new_tokens=40)
        # The engine thread waits here until both runs are pending, so the first forward holds
        # both however the machine schedules the two tasks.
        gate = threading.Event()
        sched.engine.post("hold", lambda: gate.wait(30))
        other = asyncio.ensure_future(_drain(sched.decode(a, 60)))
        stream = sched.decode(b, 10)
        first = asyncio.ensure_future(stream.__anext__())
        while a.work is None or b.work is None:
            await asyncio.sleep(0)
        gate.set()
        st = await first
        extended = sched.extend(b, 10)
        out, sizes = [st.out.committed[0]], [st.batch_size]
        async for st in stream:
            out.append(st.out.committed[0])
            sizes.append(st.batch_size)
        await other
        over = sched.extend(b, 5)
        with pytest.raises(ValueError, match="decode.n"):
            sched.extend(b, 0)
        return out, sizes, extended, over
    out, sizes, extended, over = run(model, body)
    assert extended is True and over is False
    assert out == generate(model, [5, 6, 7], 21)[1:]
    assert sizes == [2] * 20


async def _drain(stream):
    return [st async for st in stream]


def test_a_forward_reports_its_verify_rows_and_gives_the_draft_threads_only_when_drafting_sessions_dominate(model):
    """Each step reports how many rows of its forward verified (the gateway prices a lone
    verify among decoders from it); and the target lends threads to a co-located draft
    (--verify-torch-threads) only for forwards whose verifies come from sessions drafting with
    it, when those are at least half of the sessions: one n-gram verify among decoders once
    halved the whole batch's threads."""
    async def body(sched):
        a, _ = await sched.open("a", [9, 10, 11], SamplingParams(), max_new_tokens=40)
        b, _ = await sched.open("b", [5, 6, 7], SamplingParams(), max_new_tokens=40, hidden_layers=[0])
        gate = threading.Event()
        sched.engine.post("hold", lambda: gate.wait(30))
        stream = sched.decode(a, 2)
        first = asyncio.ensure_future(stream.__anext__())
        ref = generate(model, [5, 6, 7], 4)
        verify = asyncio.ensure_future(sched.verify(b, b.length, Tree.chain(ref[1:3]), None))
        while a.work is None or b.work is None:
            await asyncio.sleep(0)
        gate.set()
        tok, verified = await first, await verify
        async for _ in stream:
            pass
        steps = [Verify(b.seq, Tree.chain([1, 2]))]
        busy = {"one drafting session": sched._draft_busy(steps)}
        c, _ = await sched.open("c", [3, 4], SamplingParams(), max_new_tokens=8, hidden_layers=[0])
        busy["two of three"] = sched._draft_busy(steps)
        busy["decodes only"] = sched._draft_busy([Decode(b.seq), Decode(c.seq)])
        busy["a plain verify"] = sched._draft_busy([Verify(a.seq, Tree.chain([1, 2]))])
        return tok, verified, busy
    tok, verified, busy = run(model, body)
    assert (tok.batch_size, tok.verify_rows) == (2, 1) and (verified.batch_size, verified.verify_rows) == (2, 1)
    assert verified.batch_tokens == 1 + 3
    assert busy == {"one drafting session": False, "two of three": True, "decodes only": False,
                    "a plain verify": False}
