"""Issue 25: start-up to SERVING of the target and draft services on the bundled models.

    python docs/bench/issue25/startup.py --rounds 3

Each round starts the target service, then the draft service, each alone, and times from the
process start to grpc.health.v1 SERVING, then stops them. The first round runs after the OS page
cache was dropped when this process may do so (root): a cold start (Python, torch, the
weights read from disk); the later rounds are warm starts. The services compile nothing (the
eager fused forward measured best on this CPU; docs/benchmarks.md), so a warm start is what an
operator sees after a restart. Prints the command, the machine and one line per start.
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from splitspec_tools.ops.launch import start_service  # noqa: E402

MODELS = ROOT / "models"


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(f"$ python {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    services = {"target": ["--model-path", str(MODELS / "splitspec-code-target")],
                "draft": ["--model-path", str(MODELS / "splitspec-code-draft"),
                          "--target-model-path", str(MODELS / "splitspec-code-target")]}
    with tempfile.TemporaryDirectory() as logs:
        for r in range(a.rounds):
            kind = ("cold (page cache dropped)" if drop_caches() else "first") if r == 0 else "warm"
            for name, args in services.items():
                t = time.perf_counter()
                proc = start_service(name, args, log_dir=Path(logs))
                try:
                    proc.wait_healthy(300)
                    print(f"round {r + 1} {kind}: {name} SERVING after {time.perf_counter() - t:.2f} s", flush=True)
                finally:
                    proc.stop()


if __name__ == "__main__":
    main()
