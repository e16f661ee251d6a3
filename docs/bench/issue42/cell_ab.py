"""One `splitspec bench-auto` cell, looked at closely: several methods take turns on one gateway
(services started by hand, as `bench-auto --launch hand` does), and each repeat prints what the
cell's table hides: the CPU seconds each service spent per 1,024 tokens (from /proc), the
target features on the wire, how many requests opened a draft session, the steps by method, and
for `auto` each request's tok/s against the same request with the first method.

    python docs/bench/issue42/cell_ab.py --methods none,auto --temperature 1 --streams 16 --n 32 --repeats 6
    python docs/bench/issue42/cell_ab.py --methods none,auto --repeats 2      # T=0, one stream, short
    python docs/bench/issue42/cell_ab.py --methods none,none --repeats 8      # A/A: the cell's noise floor

A method named twice is run twice under two labels (none, none#2): an A/A comparison of the same
requests (same seeds, so at any temperature the same tokens), which reads what the host's noise
alone does to a cell's ratio.

The first repeat runs on a fresh gateway. Issue 42 used it to find what a re-measuring DFlash
session cost a batch, and why a fresh gateway drafted nothing for its first requests.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import uuid
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from splitspec_tools.bench.auto import (build_parser, drafter_tau, fit, make_prompts, method_share, request, run_batch,
                                  start_hand)
from splitspec_tools.defaults import DEFAULT_TARGET, model_dir
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc


def cpu_seconds(svc) -> dict[str, float]:
    out = {}
    for p in svc.procs:
        fields = Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[p.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,ngram,auto", help="first one is the baseline")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--kind", default="short", choices=["short", "long"])
    ap.add_argument("--n", type=int, default=16, help="requests per method and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm", type=int, default=0,
                    help="first send this many auto requests at one stream (as bench-auto's one-stream cell does "
                         "before the 8-stream one), unmeasured")
    a = ap.parse_args()
    args = build_parser().parse_args([])
    tok = Tokenizer.from_file(str(model_dir(None, DEFAULT_TARGET) / "tokenizer.json"))
    svc = start_hand(args, Path(tempfile.mkdtemp(prefix="cell-ab-")))
    try:
        stub = gateway_pb2_grpc.GenerationStub(grpc.insecure_channel(svc.gateway))
        info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=60)
        prompts = [fit(p, a.new, info.max_context) for p in make_prompts(tok, info.max_context, args)[a.kind]]
        methods = []
        for m in a.methods.split(","):
            methods.append(m if m not in methods else f"{m}#{sum(x.split('#')[0] == m for x in methods) + 1}")
        rates: dict[str, list[float]] = {m: [] for m in methods}
        if a.warm:
            run_batch(stub, [request(prompts[i % len(prompts)], "auto", a.new, a.temperature, 10 ** 6 + i,
                                     salt=uuid.uuid4().hex) for i in range(a.warm)], 1, 600)
        for rep in range(a.repeats):
            per: dict[str, list[float]] = {}
            for m in (methods if rep % 2 == 0 else methods[::-1]):
                salt = uuid.uuid4().hex
                method = m.split("#")[0]          # none#2: none again, under its own label
                reqs = [request(prompts[i % len(prompts)], method, a.new, a.temperature, 1000 * rep + i, salt=salt)
                        for i in range(a.n)]
                before = cpu_seconds(svc)
                res, wall = run_batch(stub, reqs, a.streams, 600)
                tokens = sum(len(x.tokens) for x in res)
                after = cpu_seconds(svc)
                rates[m].append(tokens / wall)
                per[m] = [len(x.tokens) / (x.end - x.start) for x in res]
                cpu = {k: round((after[k] - before[k]) / (tokens / 1024), 3) for k in after}
                ttft = statistics.median(x.ttft for x in res) * 1e3
                tail = statistics.median((x.end - x.start - x.ttft) / max(1, len(x.tokens) - 1) for x in res) * 1e3
                per_tok = {k: round(sum(getattr(x.stats, k) for x in res) / tokens, 2) for k in ("verify_ms", "wire_ms", "queue_ms")}
                print(f"rep {rep} {m:6s} {tokens / wall:7.1f} tok/s  ttft {ttft:.1f} ms  then {tail:.2f} ms/token {per_tok}  cpu s/1k tokens {cpu}  "
                      f"features {sum(x.stats.hidden_state_bytes for x in res) / 1e6:.1f} MB  "
                      f"draft sessions {sum(1 for x in res if x.stats.draft_ms > 0)}  "
                      f"decode runs {sum(x.stats.decode_runs for x in res)} "
                      f"(+{sum(x.stats.decode_extensions for x in res)} extended)  steps {method_share(res)}  "
                      f"τ ngram {drafter_tau(res, 'ngram')} dflash {drafter_tau(res, 'dflash')}", flush=True)
            base = methods[0]
            if "auto" in per and base != "auto":
                print(f"  per request auto ÷ {base}:", " ".join(f"{x / y:.2f}" for x, y in zip(per["auto"], per[base])))
        base = rates[methods[0]]
        for m in methods:
            ratios = [x / y for x, y in zip(rates[m], base)]
            print(f"{m:6s} median {statistics.median(rates[m]):7.1f} tok/s  ÷ {methods[0]}: "
                  + " ".join(f"{r:.2f}" for r in ratios) + f"  median {statistics.median(ratios):.2f}")
    finally:
        svc.stop()


if __name__ == "__main__":
    main()
