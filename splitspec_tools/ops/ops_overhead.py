"""What metrics + TLS cost one stream (issue 18: at most 3% of tokens/s).

    python -m splitspec_tools.ops.ops_overhead --rounds 10 --max-new-tokens 128

Starts two `splitspec up` stacks side by side with the bundled code pair (named, as up's own
default target is SmolLM2 when it is installed, so the figure stays comparable): OFF (plaintext, no
metrics) and ON (mTLS between every service and the client with `splitspec certs`
certificates, Prometheus metrics on all three services, scraped every second while it runs).
Then one greedy request at a time, alternating OFF / ON (interleaved, so machine noise hits
both alike), and reports the median tokens/s of each and the overhead = 1 - ON / OFF."""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "class LRUCache:\n    def __init__(self, capacity):", "import os\n\ndef walk(path):",
           "def parse_args(argv=None):", "def merge_sort(items):"]


def up(extra: list[str], gateway_port: int, log_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "splitspec_tools.cli", "up", "--gateway-port", str(gateway_port), "--http-port", "0",
           "--log-dir", str(log_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_dir / "up.err", "wb"),
                            start_new_session=True)


def models(args) -> list[str]:
    """`up`'s model flags: the pair asked for, else the bundled code pair by name."""
    from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir
    target, draft = model_dir(args.model_path, DEFAULT_TARGET), model_dir(args.draft_model_path, DEFAULT_DRAFT)
    if target is None or draft is None:
        raise SystemExit(f"the bundled pair ({DEFAULT_TARGET}, {DEFAULT_DRAFT}) is not here: "
                         "pass --model-path and --draft-model-path")
    return ["--model-path", str(target), "--draft-model-path", str(draft)]


def wait_serving(address: str, credentials, proc, timeout_s: float = 600) -> None:
    from grpc_health.v1 import health_pb2

    from splitspec_tools.ops.launch import health_status
    deadline = time.monotonic() + timeout_s
    while health_status(address, credentials=credentials) != health_pb2.HealthCheckResponse.SERVING:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the stack at {address} did not come up")
        time.sleep(0.5)


def one(address: str, credentials, prompt: str, n: int, method: str) -> tuple[float, dict]:
    """tokens/s of one greedy request, and its stats (verify steps are equal on both stacks:
    the same work; the time split shows where a difference comes from)."""
    from splitspec_tools.client import build_request, stream
    t = time.perf_counter()
    tokens, steps = 0, 0
    for resp in stream(address, build_request(prompt, max_new_tokens=n, temperature=0, ignore_eos=True,
                                              method=method), 600, credentials=credentials):
        if resp.HasField("chunk"):
            tokens += len(resp.chunk.token_ids)
        else:
            st = resp.complete.stats
            steps = {"verify_steps": st.verify_steps, "draft_ms": round(st.draft_ms, 1),
                     "verify_ms": round(st.verify_ms, 1), "wire_ms": round(st.wire_ms, 1),
                     "queue_ms": round(st.queue_ms, 1)}
    return tokens / (time.perf_counter() - t), steps


def scraper(ports: list[int], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        for port in ports:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except OSError:
                pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--method", default="dflash",
                   help="a fixed speculative method, so both stacks do the same steps (auto adapts to timing)")
    p.add_argument("--target-torch-threads", type=int, default=None,
                   help="passed to both `up`s (default: up's); 1 steadies timings on a machine others share")
    p.add_argument("--model-path", default=None, help="target model folder (default: the bundled code target)")
    p.add_argument("--draft-model-path", default=None, help="draft model folder (default: the bundled code draft)")
    p.add_argument("--out", default=None, help="write the raw numbers as JSON here")
    args = p.parse_args(argv)

    from splitspec_tools.ops.certs import write_dev_certs
    from splitspec_tools.ops.launch import free_port
    from splitspec.security import channel_credentials
    work = Path(tempfile.mkdtemp(prefix="splitspec-ops-overhead-"))
    certs = work / "certs"
    write_dev_certs(certs)
    creds = channel_credentials(str(certs / "client.pem"), str(certs / "client-key.pem"), str(certs / "ca.pem"))
    off_port, on_port, metrics = free_port(), free_port(), free_port()
    # metrics, metrics + 1, metrics + 2 must be free too; pick a base well away from the ephemeral range
    metrics = 20000 + metrics % 10000
    (work / "off").mkdir()
    (work / "on").mkdir()
    common = models(args)
    if args.target_torch_threads is not None:
        common += ["--target-torch-threads", str(args.target_torch_threads)]
    stacks = {"off": (up(common, off_port, work / "off"), f"127.0.0.1:{off_port}", None),
              "on": (up([*common, "--tls-dir", str(certs), "--metrics-port", str(metrics)], on_port, work / "on"),
                     f"127.0.0.1:{on_port}", creds)}
    stop = threading.Event()
    try:
        for proc, address, cr in stacks.values():
            wait_serving(address, cr, proc)
        threading.Thread(target=scraper, args=([metrics, metrics + 1, metrics + 2], stop), daemon=True).start()
        for name, (_, address, cr) in stacks.items():      # warm-up, not counted
            one(address, cr, PROMPTS[0], 16, args.method)
        rates = {"off": [], "on": []}
        steps = {"off": [], "on": []}
        for r in range(args.rounds):
            prompt = PROMPTS[r % len(PROMPTS)]
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for name in order:
                _, address, cr = stacks[name]
                rate, n = one(address, cr, prompt, args.max_new_tokens, args.method)
                rates[name].append(rate)
                steps[name].append(n)
            print(f"round {r + 1}: off {rates['off'][-1]:.1f} tok/s {steps['off'][-1]}, "
                  f"on {rates['on'][-1]:.1f} tok/s {steps['on'][-1]}", file=sys.stderr)
    finally:
        stop.set()
        for proc, _, _ in stacks.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)        # `up` stops its services on SIGTERM
        for proc, _, _ in stacks.values():
            proc.wait(60)
    med = {k: statistics.median(v) for k, v in rates.items()}
    overhead = 1 - med["on"] / med["off"]
    # Paired: each round's ON over the OFF run next to it, so slow drifts of a shared machine cancel.
    paired = 1 - statistics.median(on / off for on, off in zip(rates["on"], rates["off"]))
    result = {"paired_overhead": paired, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "method": args.method,
              "tok_s": rates, "stats": steps,
              "median_tok_s": med, "overhead": overhead}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"median tok/s: off {med['off']:.1f}, on (mTLS + metrics) {med['on']:.1f}; overhead {overhead:+.1%} "
          f"(median of paired rounds: {paired:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
