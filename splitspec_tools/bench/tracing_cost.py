"""What tracing costs (issue 55): tok/s of one stream through target + n-gram draft + gateway, with
tracing off and with every request traced (--otlp-traces-sample-ratio 1) into an OTLP receiver in
this process that keeps nothing. Both stacks run at once, the runs alternating off / on so that a
machine's drift falls on both; the report is each side's median.

    python -m splitspec_tools.bench.tracing_cost [--model-path models/splitspec-code-target] [--runs 5]

Needs splitspec[otel] and opentelemetry-proto (the test extra)."""
from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc

from . import stack as stacks
from .client import Gateway, sampling, tok_s
from .harness import machine_line, median, metadata

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):",
           "for i in range(10):\n    print(i)\n", "def quicksort(xs):"]


def sink():
    """An OTLP/gRPC TraceService that answers every export and counts the spans: (server, endpoint, counter)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        spans = 0

        def Export(self, request, context):
            Sink.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}", Sink


def one_stream(gw: Gateway, requests: int, max_new_tokens: int) -> float:
    """tok/s of `requests` requests one after the other (one stream)."""
    samples, wall = gw.batch([gw.request(PROMPTS[i % len(PROMPTS)], max_new_tokens, sampling(0, 1, 0))
                              for i in range(requests)], streams=1)
    return tok_s(samples, wall)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", type=Path, default=Path("models/splitspec-code-target"))
    p.add_argument("--runs", type=int, default=5, help="runs per side, alternating off / on")
    p.add_argument("--requests", type=int, default=6, help="requests per run (one stream)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    stacks.add_flags(p.add_argument)
    args = p.parse_args(argv)
    meta = metadata("python -m splitspec_tools.bench.tracing_cost", argv)
    server, endpoint, kept = sink()
    stack = stacks.Stack(args, args.model_path, 8, Path(tempfile.mkdtemp(prefix="tracing-cost-")))
    off, on = [], []
    try:
        # Target, n-gram draft and gateway with their own defaults (no thread flags); requests name no
        # method: the gateway's default, as a client sends them.
        quiet = ["--log-level", "warning"]
        plain = Gateway(stack.bare(None, quiet, "off-")[0].address)
        traced = Gateway(stack.bare(None, [*quiet, "--otlp-traces-endpoint", endpoint, "--otlp-traces-sample-ratio",
                                           "1"], "on-")[0].address)
        for gw in (plain, traced):            # warm both (first-request costs out of the runs)
            one_stream(gw, 2, 16)
        for _ in range(args.runs):
            off.append(one_stream(plain, args.requests, args.max_new_tokens))
            on.append(one_stream(traced, args.requests, args.max_new_tokens))
    finally:
        stack.stop()
        server.stop(0)
    print(f"command: {meta['command']} | git {meta['git_revision']} | {machine_line(meta)}")
    print(f"off tok/s per run: {[round(x, 1) for x in off]}")
    print(f"on  tok/s per run: {[round(x, 1) for x in on]}   spans received: {kept.spans}")
    print(f"median off {median(off):.1f} tok/s, on {median(on):.1f} tok/s: tracing costs "
          f"{100 * (1 - median(on) / median(off)):+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
