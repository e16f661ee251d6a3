"""What tracing costs (issue 55): tok/s of one stream through target + draft + gateway, with
tracing off and with every request traced (--otlp-traces-sample-ratio 1) into an OTLP receiver
in this process that keeps nothing. The two stacks run one after the other, alternating run by
run so that a machine's drift falls on both; the report is each side's median.

    python -m splitspec_tools.bench.tracing_cost [--model-path models/splitspec-code-target] [--runs 5]

Needs splitspec[otel] and opentelemetry-proto (the test extra)."""
from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import start_service
from splitspec.v1 import gateway_pb2_grpc

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):",
           "for i in range(10):\n    print(i)\n", "def quicksort(xs):"]


def sink(port: int = 0):
    """An OTLP/gRPC TraceService that answers every export and keeps nothing; (server, endpoint)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        spans = 0

        def Export(self, request, context):
            Sink.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"http://127.0.0.1:{bound}", Sink


@contextlib.contextmanager
def stack(model: Path, extra: list[str], log_dir: Path):
    procs = []
    try:
        target = start_service("target", ["--model-path", str(model), "--log-level", "warning", *extra], log_dir=log_dir)
        procs.append(target)
        draft = start_service("draft", ["--method", "ngram", "--target-model-path", str(model), "--log-level",
                                        "warning", *extra], log_dir=log_dir)
        procs.append(draft)
        for p in procs:
            p.wait_healthy(600)
        gw = start_service("gateway", ["--target", target.address, "--draft", draft.address, "--log-level", "warning",
                                       *extra], log_dir=log_dir)
        procs.append(gw)
        gw.wait_healthy(600)
        yield gw.address
    finally:
        for p in reversed(procs):
            p.stop()


def one_stream(address: str, requests: int, max_new_tokens: int) -> float:
    """tok/s of `requests` requests one after the other (one stream)."""
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationStub(channel)
        tokens, t0 = 0, time.perf_counter()
        for i in range(requests):
            req = build_request(PROMPTS[i % len(PROMPTS)], max_new_tokens=max_new_tokens, ignore_eos=True)
            for resp in stub.Generate(req, timeout=600):
                tokens += len(resp.chunk.token_ids)
        return tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", type=Path, default=Path("models/splitspec-code-target"))
    p.add_argument("--runs", type=int, default=5, help="runs per side, alternating off / on")
    p.add_argument("--requests", type=int, default=6, help="requests per run (one stream)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    server, endpoint, kept = sink()
    log_dir = Path(tempfile.mkdtemp(prefix="tracing-cost-"))
    off, on = [], []
    try:
        with stack(args.model_path, [], log_dir / "off") as plain, \
                stack(args.model_path, ["--otlp-traces-endpoint", endpoint, "--otlp-traces-sample-ratio", "1"],
                      log_dir / "on") as traced:
            for addr in (plain, traced):            # warm both (first-request costs out of the runs)
                one_stream(addr, 2, 16)
            for _ in range(args.runs):
                off.append(one_stream(plain, args.requests, args.max_new_tokens))
                on.append(one_stream(traced, args.requests, args.max_new_tokens))
    finally:
        server.stop(0)
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"command: {' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}")
    print(f"machine: {platform.node()} {platform.machine()} {platform.processor() or ''} python {platform.python_version()}")
    print(f"off tok/s per run: {[round(x, 1) for x in off]}")
    print(f"on  tok/s per run: {[round(x, 1) for x in on]}   spans received: {kept.spans}")
    print(f"median off {m_off:.1f} tok/s, on {m_on:.1f} tok/s: tracing costs {100 * (1 - m_on / m_off):+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
