"""A failed step never hangs anything (issue 54, item 1): a fault in one session's own work
(its sampling / grammar, its tree rewrite, its prompt lookup) fails that session alone; a
fault in the shared forward fails the sessions in that forward. Either way the waiters get
StepFailed (INTERNAL), their KV blocks go back to the pool, the engine serves on, and the
gateway resumes the requests so that every answer equals target-only."""
from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from scheduler_helpers import run_scheduler
from service_helpers import collect, gateway_stub, running_gateway, target_info, tiny_target_dir
from splitspec_tools.client import build_request
from splitspec.engine.sample import SamplingParams
from splitspec.engine.tree import Tree
from splitspec_tools.ops.launch import free_port
from target_service import server as target_server
from target_service.engine import generate
from splitspec.models.loader import load_model
from target_service.scheduler import StepFailed

STREAMS, N = 8, 24


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_target_dir())


def prompt_for(i: int) -> list[int]:
    rng = random.Random(200 + i)
    base = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 8))]
    return base * 2         # repeats: prompt lookup finds matches


def run(model, body):
    return run_scheduler(model, body, blocks=512, max_running=STREAMS, max_batched_tokens=256,
                         chunked_prefill_size=64)


class FaultyGuide:
    """A grammar that breaks: its mask (sampling) or its tree walk (the tree rewrite) raises."""
    done = False

    def __init__(self, vocab: int, where: str):
        self.vocab, self.where = vocab, where

    def allowed(self):
        if self.where == "sampling":
            raise RuntimeError("injected grammar fault")
        return torch.ones(self.vocab, dtype=torch.bool)

    def valid_nodes(self, tree):
        raise RuntimeError("injected tree-walk fault")

    def advance(self, tokens):
        pass


async def decode_all(sched, session, first: int, lookahead: int = 0) -> list[int]:
    out = [first]
    async for step in sched.decode(session, N - 1, lookahead):
        out += step.out.committed
    return out[:N]


@pytest.mark.parametrize("where", ["sampling", "tree rewrite", "prompt lookup"])
def test_a_fault_in_one_sessions_step_fails_it_alone(model, monkeypatch, where):
    """8 streams; one session's own work raises: that one gets StepFailed naming the cause and
    its blocks are back in the pool at once; the other 7 equal target-only."""
    refs = [generate(model, prompt_for(i), N) for i in range(STREAMS)]

    async def body(sched):
        free_at_start = sched.pool.free_blocks
        bad_session = None
        if where == "prompt lookup":
            real_plan = sched.lookahead.plan

            def plan(look, *a, **kw):
                if bad_session is not None and look is bad_session.look:
                    raise RuntimeError("injected lookup fault")
                return real_plan(look, *a, **kw)
            monkeypatch.setattr(sched.lookahead, "plan", plan)

        async def good(i):
            session, step = await sched.open(str(i), prompt_for(i), SamplingParams(), max_new_tokens=N)
            try:
                return await decode_all(sched, session, step.out.committed[0], lookahead=4)
            finally:
                sched.close(session)

        async def bad():
            nonlocal bad_session
            session, step = await sched.open("bad", prompt_for(99), SamplingParams(), max_new_tokens=N)
            bad_session = session
            try:
                with pytest.raises(StepFailed) as err:
                    if where == "tree rewrite":
                        session.seq.guide = FaultyGuide(sched.cfg.vocab_size, where)
                        await sched.verify(session, session.length, Tree.chain([5, 6]), None)
                    else:
                        if where == "sampling":
                            session.seq.guide = FaultyGuide(sched.cfg.vocab_size, where)
                        await decode_all(sched, session, step.out.committed[0], lookahead=4)
                assert where in str(err.value) and "injected" in str(err.value)
                assert session.state == "closed"          # out of the scheduler before its handler closes it
            finally:
                sched.close(session)

        results = await asyncio.wait_for(asyncio.gather(bad(), *(good(i) for i in range(STREAMS - 1))), 120)
        assert sched.pool.free_blocks == free_at_start and not sched.running
        return results[1:]
    outs = run(model, body)
    assert outs == refs[:STREAMS - 1]


def test_a_fault_in_the_shared_forward_fails_its_sessions_and_the_engine_serves_on(model, monkeypatch):
    """The forward itself raises once while 8 sessions decode: every session in it gets
    StepFailed, the pool's free blocks return to where they started, and a new session then
    equals target-only."""
    armed = threading.Event()
    rows_in_failed = []
    real_forward = model.forward_batch

    def forward_batch(input_ids, *a, **kw):
        if armed.is_set():
            armed.clear()
            rows_in_failed.append(int(input_ids.numel()))
            raise RuntimeError("injected forward fault")
        return real_forward(input_ids, *a, **kw)
    monkeypatch.setattr(model, "forward_batch", forward_batch)

    async def body(sched):
        free_at_start = sched.pool.free_blocks
        opened = [await sched.open(str(i), prompt_for(i), SamplingParams(), max_new_tokens=N) for i in range(STREAMS)]
        armed.set()
        results = await asyncio.wait_for(asyncio.gather(
            *(decode_all(sched, s, step.out.committed[0]) for s, step in opened), return_exceptions=True), 120)
        for s, _ in opened:
            sched.close(s)
        assert sched.pool.free_blocks == free_at_start
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, StepFailed) and "the batched forward" in str(r) for r in failed)
        session, step = await sched.open("after", prompt_for(0), SamplingParams(), max_new_tokens=N)
        out = await decode_all(sched, session, step.out.committed[0])
        sched.close(session)
        return len(failed), out
    n_failed, out = run(model, body)
    assert n_failed == rows_in_failed[0] == STREAMS        # all 8 rode that forward, all 8 failed
    assert out == generate(model, prompt_for(0), N)


@pytest.fixture
def faulty_target(monkeypatch):
    """An in-process target whose forward raises once `armed` is set."""
    armed = threading.Event()

    def load(args):
        model, verifier = target_server._load(args)
        real_forward = model.forward_batch

        def forward_batch(*a, **kw):
            if armed.is_set():
                armed.clear()
                raise RuntimeError("injected forward fault")
            return real_forward(*a, **kw)
        model.forward_batch = forward_batch
        return model, verifier

    args = target_server.build_parser().parse_args(
        ["--model-path", str(tiny_target_dir()), "--port", str(free_port())])
    servers = []
    thread = threading.Thread(target=lambda: asyncio.run(target_server.serve(args, load=load, started=servers.append)),
                              daemon=True)
    thread.start()
    yield f"127.0.0.1:{args.port}", armed
    if servers:
        servers[0].request_stop()
    thread.join(30)


def test_the_gateway_resumes_requests_whose_forward_failed(faulty_target, model, tmp_path):
    """8 gateway streams on one target; its forward fails once mid-answer: every request
    completes equal to target-only (the gateway re-opened the failed ones on the same replica,
    which served on), and the target's pool is as free as before."""
    address, armed = faulty_target
    prompts = [prompt_for(i) for i in range(STREAMS)]
    refs = [generate(model, p, N * 2) for p in prompts]
    with running_gateway(address, tmp_path) as gw:
        free_at_start = target_info(address).kv_blocks_free
        ch, stub = gateway_stub(gw.address)
        with ch:
            calls = [stub.Generate(build_request(p, max_new_tokens=N * 2, ignore_eos=True, method="none"), timeout=120)
                     for p in prompts]
            firsts = [list(next(c).chunk.token_ids) for c in calls]        # every request is running
            armed.set()
            with ThreadPoolExecutor(STREAMS) as pool:
                results = list(pool.map(collect, calls))
    assert not armed.is_set()           # the fault fired
    for first, (ids, _, complete), ref in zip(firsts, results, refs):
        assert first + ids == ref
    assert sum(complete.stats.target_failovers for _, _, complete in results) >= 1
    assert target_info(address).kv_blocks_free == free_at_start


def test_a_failing_metrics_hook_is_logged_and_tracing_still_runs(model):
    """The hooks run after delivery: a metrics hook that raises on every forward fails no
    session, does not stop the tracing hook after it, and is logged (its 1st, 2nd, 4th...
    failure, so the log is not flooded)."""
    from structlog.testing import capture_logs
    traced = []

    def broken(*args):
        raise RuntimeError("injected metrics fault")

    async def body(sched):
        sched.on_forward = broken
        sched.on_batch = lambda items, start, end: traced.append([kind for _, kind, _ in items])
        session, step = await sched.open("s", prompt_for(0), SamplingParams(), max_new_tokens=N)
        out = await decode_all(sched, session, step.out.committed[0])
        sched.close(session)
        return out, sched.forwards, dict(sched.hook_failures)

    with capture_logs() as logs:
        out, forwards, failures = run(model, body)
    assert out == generate(model, prompt_for(0), N)
    assert len(traced) == forwards == failures["metrics"] and "tracing" not in failures
    logged = [e["failures"] for e in logs if e["event"] == "forward_hook_failed"]
    assert logged == [n for n in (1, 2, 4, 8, 16, 32) if n <= forwards] and forwards > 4
