"""`splitspec loadtest`: N concurrent streams against a running gateway for T seconds (and at
most --max-requests requests), with random sampling parameters, random lengths and random
client cancels. Reports completed / cancelled / failed requests, p50 / p99 latency, tokens/s,
and, for every service given (--gateway, --target, --draft; loopback only, same machine), its
resident memory at the start and at the end and its open sessions after the run.

    splitspec loadtest --gateway 127.0.0.1:50050 --target 127.0.0.1:50051 --draft 127.0.0.1:50052 \
        --streams 64 --duration-s 300

A mixed soak (issue 54): --schema-share P sends that share of the requests as JSON-schema
constrained answers (eos honoured) whose prompts all start with one --shared-prefix-tokens
prefix, so the target's prefix cache hits and its grammars run beside the random streams;
--memory-every-s S samples every service's resident memory every S seconds (memory_series).

    splitspec loadtest --target 127.0.0.1:50051 --streams 24 --duration-s 900 --schema-share 0.25 \
        --memory-every-s 30 --json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from splitspec.flags import ListFlag, apply_env, check_ranges


# -- resident memory of a local service, found by its listening port --------------------------
def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:   # 0A: LISTEN
                inodes.add(inode)
    return inodes


def pid_listening_on(address: str) -> int | None:
    """The pid of the local process listening on address's port (Linux /proc), or None."""
    try:
        port = int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    wanted = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not wanted:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return int(pid)
        except OSError:
            continue
    return None


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_sessions(kind: str, address: str) -> int | None:
    """active_sessions from a target's or draft's GetInfo."""
    import grpc

    from splitspec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
    stub_cls = target_pb2_grpc.TargetStub if kind == "target" else draft_pb2_grpc.DraftStub
    try:
        with grpc.insecure_channel(address) as ch:
            return stub_cls(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=5).active_sessions
    except grpc.RpcError:
        return None


def wait_sessions_closed(services: dict[str, tuple[str, str]], timeout_s: float = 10.0) -> dict[str, int | None]:
    """Open sessions on each target/draft, polled until all are 0 or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {name: open_sessions(kind, addr) for name, (kind, addr) in services.items()
                  if kind in ("target", "draft")}
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


# -- the load -----------------------------------------------------------------------------------
# The constrained requests of a mixed soak: a small record, so answers finish within a few dozen tokens.
SOAK_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "ok": {"type": "boolean"}},
               "required": ["name", "count", "ok"], "additionalProperties": False}

@dataclass
class Report:
    streams: int
    duration_s: float
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)   # "CODE: message" -> count
    tokens: int = 0
    tokens_per_s: float = 0.0
    p50_latency_s: float = 0.0
    p99_latency_s: float = 0.0
    p50_ttft_s: float = 0.0
    draft_fallbacks: int = 0
    target_failovers: int = 0
    memory_mb: dict[str, dict[str, float | None]] = field(default_factory=dict)   # service -> start/warm/end
    memory_series: dict[str, list[list[float]]] = field(default_factory=dict)   # service -> [[s, MB], ...]
    schema_requests: int = 0        # of the requests, JSON-schema constrained on the shared prefix
    open_sessions_after: dict[str, int | None] = field(default_factory=dict)

    def summary(self) -> str:
        mem = ", ".join(_memory_line(k, v) for k, v in self.memory_mb.items())
        lines = [f"{self.streams} streams x {self.duration_s:.0f} s: {self.requests} requests, {self.completed} "
                 f"completed, {self.cancelled} cancelled (by the load generator), {self.failed} failed",
                 f"latency p50 {self.p50_latency_s:.3f} s, p99 {self.p99_latency_s:.3f} s; ttft p50 "
                 f"{self.p50_ttft_s:.3f} s; {self.tokens} tokens, {self.tokens_per_s:.1f} tokens/s",
                 f"draft fallbacks {self.draft_fallbacks}, target failovers {self.target_failovers}",
                 f"resident memory: {mem or 'n/a'}",
                 f"open sessions after the run: {self.open_sessions_after or 'n/a'}"]
        for name, series in self.memory_series.items():
            lines.append(f"{name} RSS over time (s: MB): " + ", ".join(f"{t:.0f}: {mb:.0f}" for t, mb in series))
        if self.failures:
            lines.append("failures: " + "; ".join(f"{n} x {k}" for k, n in self.failures.items()))
        return "\n".join(lines)


def _memory_line(name: str, m: dict) -> str:
    line = f"{name} {m.get('start') or 0:.0f}->{m.get('end') or 0:.0f} MB"
    if m.get("warm") and m.get("end"):
        line += f" ({m['warm']:.0f} MB after warm-up, {100 * (m['end'] / m['warm'] - 1):+.1f}% since)"
    return line


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def run_load(gateway: str, *, streams: int = 16, duration_s: float = 20.0, max_requests: int = 0,
             max_new_tokens: int = 32, cancel_prob: float = 0.1, methods=("",), prompt_len=(4, 32),
             vocab: int = 0, seed: int = 0, timeout_s: float = 120.0, warmup_s: float = 0.0,
             services: dict[str, tuple[str, str]] | None = None, memory_every_s: float = 0.0,
             schema_share: float = 0.0, shared_prefix_tokens: int = 256) -> Report:
    """Run the load. `services` maps a name to (kind, address), kind in gateway/target/draft,
    for memory and session figures; `vocab` 0 asks the gateway's GetModelInfo. schema_share:
    the share of requests sent JSON-schema constrained after one shared prompt prefix of
    shared_prefix_tokens; memory_every_s > 0: RSS samples every so many seconds."""
    import grpc

    from splitspec_tools.client import build_request
    from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    services = dict(services or {})
    services.setdefault("gateway", ("gateway", gateway))
    pids = {name: pid_listening_on(addr) for name, (_, addr) in services.items()}
    report = Report(streams=streams, duration_s=duration_s)
    report.memory_mb = {name: {"start": rss_mb(pid)} for name, pid in pids.items()}
    channel = grpc.insecure_channel(gateway)
    stub = gateway_pb2_grpc.GenerationStub(channel)
    info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=30)
    vocab = vocab or info.vocab_size
    max_new_tokens = min(max_new_tokens, info.max_new_tokens_cap or max_new_tokens)
    lock = threading.Lock()
    latencies, ttfts = [], []
    prefix_rng = random.Random(seed - 1)
    shared_prefix = [prefix_rng.randrange(3, vocab) for _ in range(shared_prefix_tokens)]
    schema = common_pb2.Constraint(json_schema=json.dumps(SOAK_SCHEMA), strict=True)
    t0 = time.monotonic()
    end = t0 + duration_s

    def take_slot() -> bool:
        with lock:
            if time.monotonic() >= end or (max_requests and report.requests >= max_requests):
                return False
            report.requests += 1
            return True

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while take_slot():
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
            kw = {}
            if rng.random() < 0.5:
                kw.update(temperature=rng.choice([0.5, 0.8, 1.0]), seed=rng.randrange(1 << 30))
                if rng.random() < 0.5:
                    kw["top_p"] = rng.choice([0.8, 0.95])
                if rng.random() < 0.3:
                    kw["top_k"] = rng.choice([5, 50])
            constrained = rng.random() < schema_share
            if constrained:
                prompt = shared_prefix + prompt
            req = build_request(prompt, max_new_tokens=rng.randint(1, max_new_tokens),
                                ignore_eos=not constrained and rng.random() < 0.5, method=rng.choice(list(methods)), **kw)
            if constrained:
                req.sampling.constraint.CopyFrom(schema)
            cancel_after = rng.randint(1, 4) if rng.random() < cancel_prob else None
            started = time.monotonic()
            call = stub.Generate(req, timeout=timeout_s)
            chunks = tokens = 0
            first = None
            outcome, stats = None, None
            try:
                for resp in call:
                    if resp.HasField("chunk"):
                        chunks += 1
                        tokens += len(resp.chunk.token_ids)
                        first = first or time.monotonic()
                        if cancel_after is not None and chunks >= cancel_after:
                            call.cancel()
                            outcome = "cancelled"
                            break
                    else:
                        stats = resp.complete.stats
                outcome = outcome or "completed"
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
                    outcome = "cancelled"
                else:
                    outcome = f"{exc.code().name}: {(exc.details() or '')[:120]}"
            now = time.monotonic()
            with lock:
                report.schema_requests += constrained
                report.tokens += tokens
                if outcome == "completed":
                    report.completed += 1
                    latencies.append(now - started)
                    if first is not None:
                        ttfts.append(first - started)
                    if stats is not None:
                        report.draft_fallbacks += stats.draft_fallbacks
                        report.target_failovers += stats.target_failovers
                elif outcome == "cancelled":
                    report.cancelled += 1
                else:
                    report.failed += 1
                    report.failures[outcome] = report.failures.get(outcome, 0) + 1

    def sample_warm() -> None:
        # Memory "after warm-up": pools, allocator caches and gRPC buffers have reached their
        # working size, so growth from here to the end is what a leak would show.
        time.sleep(warmup_s)
        for name, pid in pids.items():
            report.memory_mb[name]["warm"] = rss_mb(pid)

    done = threading.Event()

    def sample_series() -> None:
        while True:
            t = round(time.monotonic() - t0, 1)
            for name, pid in pids.items():
                mb = rss_mb(pid)
                if mb is not None:
                    report.memory_series.setdefault(name, []).append([t, round(mb, 1)])
            if done.wait(memory_every_s):
                return

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    if 0 < warmup_s < duration_s:
        threading.Thread(target=sample_warm, daemon=True).start()
    sampler = threading.Thread(target=sample_series, daemon=True) if memory_every_s > 0 else None
    if sampler is not None:
        sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    if sampler is not None:
        sampler.join()
    elapsed = time.monotonic() - t0
    channel.close()
    report.duration_s = elapsed
    report.tokens_per_s = report.tokens / elapsed if elapsed > 0 else 0.0
    report.p50_latency_s, report.p99_latency_s = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
    report.p50_ttft_s = _percentile(ttfts, 0.5)
    report.open_sessions_after = wait_sessions_closed(services)
    for name, pid in pids.items():
        report.memory_mb[name]["end"] = rss_mb(pid)
    return report


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="splitspec loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--gateway", default="127.0.0.1:50050", help="gateway address host:port")
    a("--target", action=ListFlag, default=[], help="target address(es) to report memory and open sessions of "
      "(loopback; repeatable or comma-separated)")
    a("--draft", action=ListFlag, default=[], help="draft address(es) to report memory and open sessions of")
    a("--streams", type=int, default=16, help="concurrent streams")
    a("--duration-s", type=float, default=20.0, help="how long to keep starting requests")
    a("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    a("--max-new-tokens", type=int, default=32, help="largest max_new_tokens of a request (each draws 1..this)")
    a("--cancel-prob", type=float, default=0.1, help="share of requests the client cancels after a few chunks")
    a("--methods", default="", help="comma-separated speculative methods to draw from (empty: the gateway's default)")
    a("--seed", type=int, default=0, help="seed of the random prompts and parameters")
    a("--timeout-s", type=float, default=120.0, help="deadline of each request")
    a("--warmup-s", type=float, default=30.0,
      help="when to take the 'after warm-up' memory sample that growth is measured from (0: none)")
    a("--memory-every-s", type=float, default=0.0,
      help="sample every service's resident memory this often into memory_series (0: start, warm-up and end only)")
    a("--schema-share", type=float, default=0.0,
      help="share of requests sent JSON-schema constrained (eos honoured) after one shared prompt prefix")
    a("--shared-prefix-tokens", type=int, default=256, help="tokens of the constrained requests' shared prefix")
    a("--json", action="store_true", help="print the report as JSON")
    return apply_env(p)


def main(args: argparse.Namespace) -> int:
    check_ranges(args, positive=("streams", "duration_s"), program="splitspec loadtest")
    if not 0 <= args.cancel_prob <= 1:
        raise SystemExit("splitspec loadtest: --cancel-prob must be in [0, 1]")
    if not 0 <= args.schema_share <= 1:
        raise SystemExit("splitspec loadtest: --schema-share must be in [0, 1]")
    services = {f"target{i}" if len(args.target) > 1 else "target": ("target", a) for i, a in enumerate(args.target)}
    services.update({f"draft{i}" if len(args.draft) > 1 else "draft": ("draft", a) for i, a in enumerate(args.draft)})
    methods = tuple(m.strip() for m in args.methods.split(",")) if args.methods else ("",)
    report = run_load(args.gateway, streams=args.streams, duration_s=args.duration_s, max_requests=args.max_requests,
                      max_new_tokens=args.max_new_tokens, cancel_prob=args.cancel_prob, methods=methods,
                      seed=args.seed, timeout_s=args.timeout_s, warmup_s=args.warmup_s, services=services,
                      memory_every_s=args.memory_every_s, schema_share=args.schema_share,
                      shared_prefix_tokens=args.shared_prefix_tokens)
    print(json.dumps(asdict(report), indent=2) if args.json else report.summary())
    return 0 if report.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
