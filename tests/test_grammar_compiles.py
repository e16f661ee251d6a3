"""Grammar compiles are bounded (issue 54, item 5): the timeout counts compile time, not time
queued for a worker; a compile that times out does not keep its worker (a replacement starts,
so a valid schema after two slow ones still compiles); the queue is bounded."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from service_helpers import VOCAB, tiny_target_dir
from splitspec.v1 import common_pb2
from splitspec.grammar import CompilePool, GrammarBusy, GrammarError, Grammars

pytest.importorskip("xgrammar")


def schema(**extra) -> common_pb2.Constraint:
    return common_pb2.Constraint(json_schema=json.dumps({"type": "object", **extra}))


def slowed(grammars: Grammars, gate: threading.Event, *, sleep_s: float = 0.0):
    """Compiles of a schema with a "slow" title wait for `gate` (or sleep sleep_s) first."""
    real = grammars._compile

    def compile_(key):
        if "slow" in key[1]:
            if sleep_s:
                time.sleep(sleep_s)
            else:
                gate.wait(60)
        return real(key)
    grammars._compile = compile_


def test_a_valid_schema_after_two_slow_ones_still_compiles():
    """Two compiles that never end in time, on a 2-worker pool: both are refused naming the
    field, and a valid schema sent next compiles (their workers were replaced). Once the slow
    ones end, their threads leave and their grammars are cached."""
    gate = threading.Event()
    g = Grammars(tiny_target_dir(), VOCAB, [0], threads=2)
    g.timeout_s = 0.3
    slowed(g, gate)

    async def main():
        slow = [asyncio.ensure_future(g.compile_async(schema(title=f"slow {i}"))) for i in range(2)]
        for task in slow:
            with pytest.raises(GrammarError, match="sampling.constraint.json_schema took more than"):
                await task
        g.timeout_s = 60.0
        assert await g.compile_async(schema(title="fine")) is not None
        gate.set()
        while g._pool.abandoned:
            await asyncio.sleep(0.01)
    asyncio.run(main())
    assert len(g.cache) == 3


def test_time_waiting_for_a_worker_does_not_count():
    """One worker, two compiles that each take most of the timeout: the second waits for the
    first, longer in all than the timeout, and still compiles."""
    g = Grammars(tiny_target_dir(), VOCAB, [0], threads=1)
    g.timeout_s = 2.0
    slowed(g, threading.Event(), sleep_s=1.2)

    async def main():
        return await asyncio.gather(*(g.compile_async(schema(title=f"slow {i}")) for i in range(2)))
    assert all(r is not None for r in asyncio.run(main()))


def test_the_queue_is_bounded():
    gate = threading.Event()
    pool = CompilePool(1, queue_size=1)

    async def main():
        running = asyncio.ensure_future(pool.run(lambda: gate.wait(60), 60, RuntimeError))
        await asyncio.sleep(0)
        while pool._jobs.qsize():           # the worker has taken it
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(pool.run(lambda: "second", 60, RuntimeError))
        await asyncio.sleep(0)
        with pytest.raises(GrammarBusy, match="1 grammar compiles are already waiting"):
            await pool.run(lambda: "third", 60, RuntimeError)
        gate.set()
        return await running, await queued
    assert asyncio.run(main()) == (True, "second")
