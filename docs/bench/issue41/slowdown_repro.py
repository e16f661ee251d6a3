"""Repro: after one grammar-constrained *speculative* request, every later target-only request of
the same target process decoded ~2.7x slower (2-core CPU host), constrained or not. Fixed by 730772a
(grammar bitmasks unpacked with numpy, the tree rewrite on the engine thread) and c5fd511 (wire:
writable tensors copied with numpy); at 61c259c the same script prints 4.76 / 5.06 / 5.35 ms.

    .venv/bin/python docs/bench/issue41/slowdown_repro.py           # ~1 min

Starts a target and a gateway (no draft: ngram is the gateway's own prompt lookup), measures the
decode ms/token of 6 unconstrained target-only requests, sends one constrained request (target-only
first, then ngram), and measures again. What we saw on the 2-core Xeon (2026-12-05, at 6b5e944):

    start:                        none ITL median  4.85 ms
    after constrained none:       none ITL median  5.23 ms      (no Verify: no change)
    after constrained ngram:      none ITL median 13.76 ms      (stays so for the process's life)

The target's own busy_ms per forward goes up alike (4.8 -> 13.6 ms), so the forwards themselves are
slower, with no session left open. With --disable-radix-cache: the same. Our reading (not proven):
`scheduler.verify` runs `grammar.rewrite_tree` on the asyncio thread, whose `Guide._bool` unpacks the
bitmask with torch ops big enough ([rows, 256, 32]) to enter an OpenMP parallel region there; that
thread then owns a second OpenMP team, libgomp manages more threads than the 2 CPUs and throttles its
spin-wait, and every small parallel region of the engine thread's forwards pays a futex wake. The
engine alone with OMP_WAIT_POLICY=PASSIVE decodes at ~12.8 ms/token from the start, the same slow
regime. A standalone check (torch only): one such bitmask unpack on a second, still-alive thread
slows a loop of small ops on the main thread by ~25 %, back to normal once that thread exits.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from splitspec_tools.bench.prompts import default_prompts
from splitspec_tools.bench.structured import StructuredRunner, make_job
from splitspec.engine.sample import SamplingParams
from splitspec_tools.ops.launch import start_service
from splitspec.v1 import common_pb2, target_pb2_grpc

TARGET = "models/splitspec-code-target"


def main() -> None:
    logs = Path("/tmp/slowdown-repro-logs")
    target = start_service("target", ["--model-path", TARGET, "--device", "cpu", "--log-level", "warning",
                                      "--torch-threads", "0", "--verify-torch-threads", "1", *sys.argv[1:]],
                           log_dir=logs)
    target.wait_healthy(300)
    gateway = start_service("gateway", ["--target", target.address, "--log-level", "warning"], log_dir=logs)
    gateway.wait_healthy(300)

    def info() -> str:
        with grpc.insecure_channel(target.address) as ch:
            i = target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        return f"active sessions {i.active_sessions}, forwards {i.forward_passes}, busy_ms {i.busy_ms:.0f}"

    try:
        tok = Tokenizer.from_file(f"{TARGET}/tokenizer.json")
        jobs = []
        for i, p in enumerate(default_prompts(6)):
            job, text = make_job(i, p.id, p.text, "flat")
            job.ids = tok.encode(text).ids[-400:]
            jobs.append(job)
        none = StructuredRunner(gateway.address, "none", 8, "greedy", 60)

        def itl(tag: str) -> None:
            v = [none.send(j.ids, 48, SamplingParams(), None, ignore_eos=True).sample.itl_s * 1e3 for j in jobs]
            print(f"{tag:<30} none ITL median {statistics.median(v):5.2f} ms; {info()}", flush=True)

        itl("start:")
        for method in ("none", "ngram"):
            out = StructuredRunner(gateway.address, method, 8, "greedy", 60).send(
                jobs[0].ids, 128, SamplingParams(), jobs[0].constraint())
            print(f"  constrained {method}: {len(out.sample.tokens)} tokens, finish {out.finish_reason}")
            time.sleep(1.0)
            itl(f"after constrained {method}:")
    finally:
        gateway.stop()
        target.stop()


if __name__ == "__main__":
    main()
