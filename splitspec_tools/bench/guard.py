"""`splitspec bench-guard`: what a hostile body costs the gateway's HTTP front (issue 63). A body
that is one unterminated JSON string (`"` then `\\"` repeated, the shape the old pre-parse regex
took quadratic time on) of --body-mb megabytes is posted --repeats times, bare and as an
unterminated prompt; a second client probes /health in a loop meanwhile. Reported: each body's
answer (status, latency), the probes answered while a body was in flight and their latencies,
probes on the idle gateway for comparison, and the old regex's time on the same shape at a few
KB (in process) for the before.

The services: the bundled target (or --target-model-path) and a gateway with --http-port, no
draft. The figures are wall times on whatever else the machine runs: say how loaded it was.

    splitspec bench-guard --body-mb 1 --repeats 5
"""
from __future__ import annotations

import http.client
import re
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from . import stack as stack_mod
from .harness import ROOT, columns, entry, fmt, header, log, metadata

# The pattern the guard cut strings out with before issue 63: each unterminated `"` starts a
# scan to the end of the body, so its time grows with the square of the body.
OLD_PATTERN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
SHAPES = {"bare": b"", "prompt": b'{"prompt": '}


def add_flags(a) -> None:
    a("--target-model-path", default=None, help="target model folder or .gguf (default: the bundled target)")
    a("--body-mb", type=float, default=1.0, help="size of each hostile body")
    a("--repeats", type=int, default=5, help="bodies of each shape")
    a("--idle-probes", type=int, default=20, help="health probes on the idle gateway")
    a("--old-pattern-kb", default="4,8,16", help="body sizes (KB) the old regex is timed on, in process")
    a("--out", default="bench-out/guard", help="folder for results.json, results.md and the service logs")
    stack_mod.add_flags(a)


def body(shape: bytes, size: int) -> bytes:
    return shape + b'"' + b'\\"' * max(0, (size - len(shape) - 1) // 2)


class Client:
    """One keep-alive HTTP connection to the gateway, without Nagle's algorithm: http.client sends
    headers and body as separate writes, and the server's delayed ACK would add 40 ms to each."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(self, method: str, path: str, raw: bytes | None = None) -> tuple[int, float]:
        """(status, seconds until the whole answer was read)."""
        t0 = time.perf_counter()
        self.conn.request(method, path, body=raw, headers={"content-type": "application/json"} if raw else {})
        resp = self.conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()


class Prober(threading.Thread):
    """GET /health in a loop until stopped: (start time, status, seconds) of each probe."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.client, self.stopping, self.probes = Client(port), threading.Event(), []

    def run(self) -> None:
        while not self.stopping.is_set():
            start = time.perf_counter()
            status, seconds = self.client.request("GET", "/health")
            self.probes.append((start, status, seconds))

    def stop(self) -> list:
        self.stopping.set()
        self.join(60)
        self.client.close()
        return self.probes


def hostile(port: int, shape: str, raw: bytes, repeats: int) -> list[dict]:
    rows = []
    for i in range(repeats):
        prober, client = Prober(port), Client(port)
        prober.start()
        while not prober.probes:            # the prober is answering before the body goes out
            time.sleep(0.001)
        start = time.perf_counter()
        status, seconds = client.request("POST", "/v1/completions", raw)
        probes = [p for p in prober.stop() if start <= p[0] <= start + seconds]
        client.close()
        latencies = [p[2] * 1e3 for p in probes]
        rows.append({"shape": shape, "repeat": i, "bytes": len(raw), "status": status, "seconds": seconds,
                     "probes": len(probes), "probes_ok": sum(p[1] == 200 for p in probes),
                     "probe_median_ms": statistics.median(latencies) if latencies else None,
                     "probe_max_ms": max(latencies) if latencies else None})
        log(f"{shape} {len(raw)} bytes: {status} in {seconds * 1e3:.1f} ms; {len(probes)} health probes meanwhile"
            + (f", max {max(latencies):.1f} ms" if latencies else ""))
    return rows


def old_pattern(sizes_kb: list[int]) -> list[dict]:
    out = []
    for kb in sizes_kb:
        raw = body(b"", kb * 1024)
        t0 = time.perf_counter()
        OLD_PATTERN.sub(b"", raw)
        out.append({"kb": kb, "seconds": time.perf_counter() - t0})
        log(f"old pattern, {kb} KB: {out[-1]['seconds']:.3f} s")
    return out


def bench(a, argv: list[str]) -> dict:
    from splitspec_tools.ops.launch import free_port
    meta = metadata("splitspec bench-guard", argv)
    target_path, _ = stack_mod.models(a.target_model_path, "none")
    logs = Path(a.out) / "logs" if a.out else Path(tempfile.mkdtemp())
    port = free_port()
    services = stack_mod.Stack(a, target_path, 8, logs)
    try:
        target = services.target()
        services.wait(target)
        services.wait(services.gateway(target.address, None, ["--http-port", str(port)]))
        idle = Client(port)
        idle_ms = [idle.request("GET", "/health")[1] * 1e3 for _ in range(a.idle_probes)]
        idle.close()
        size = int(a.body_mb * (1 << 20))
        rows = [r for shape, head in SHAPES.items() for r in hostile(port, shape, body(head, size), a.repeats)]
    finally:
        services.stop()
    shown = target_path.relative_to(ROOT) if target_path.is_relative_to(ROOT) else target_path
    return {"meta": meta, "run": {"target": str(shown), "body_bytes": size, "repeats": a.repeats},
            "idle_probe_ms": {"median": statistics.median(idle_ms), "max": max(idle_ms)}, "rows": rows,
            "old_pattern": old_pattern([int(x) for x in a.old_pattern_kb.split(",") if x.strip()])}


COLUMNS = [("shape", "shape", "{}"), ("bytes", "bytes", "{}"), ("status", "status", "{}"),
           ("answer ms", lambda r: fmt(r["seconds"] * 1e3, "{:.1f}")), ("probes meanwhile", "probes", "{}"),
           ("probes 200", "probes_ok", "{}"), ("probe median ms", "probe_median_ms", "{:.1f}"),
           ("probe max ms", "probe_max_ms", "{:.1f}")]


def markdown(r: dict) -> str:
    idle = r["idle_probe_ms"]
    lines = header("splitspec bench-guard", r["meta"], f"target `{r['run']['target']}`, gateway without a draft",
                   f"health probes on the idle gateway: median {idle['median']:.1f} ms, max {idle['max']:.1f} ms")
    old = ", ".join(f"{o['kb']} KB {o['seconds']:.3f} s" for o in r["old_pattern"])
    return "\n".join(lines + columns(COLUMNS, r["rows"])
                     + ["", f"The guard's old string pattern on the bare shape, in process: {old}.", ""])


main, cli_main = entry("splitspec bench-guard", __doc__, add_flags, bench, markdown)
