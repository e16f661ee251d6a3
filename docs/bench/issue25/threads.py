"""Issue 25: method dflash vs target-only at 1 and 8 streams with target and draft started by hand,
per thread setting and code revision, settings interleaved, repeated; plus each step kind's time
(steps.py) against the same services.

    python docs/bench/issue25/threads.py --out /tmp/i25/threads --rounds 2 \
        --setting new-defaults=.: --setting "new-up=.:--torch-threads 0 --verify-torch-threads 1|--torch-threads 1" \
        --setting old-defaults=/tmp/old:

A setting is NAME=ROOT:TARGET_FLAGS|DRAFT_FLAGS: the checkout the two services run from (an older
revision: `git worktree add /tmp/old <rev>`) and their extra flags. The bench (this checkout's
`splitspec bench`, which starts only a gateway in front of them) and steps.py run from here.
Writes OUT/<name>-<round>/ (bench results.json/md, steps.json, service logs) and OUT/summary.json.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]
MODELS = ROOT / "models"


def start(root: Path, module: str, args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=root, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def run_setting(name: str, root: Path, tflags: list[str], dflags: list[str], out: Path, a, port: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tport, dport = port, port + 1
    target = start(root, "target_service.server", ["--model-path", str(MODELS / "splitspec-code-target"),
                                                   "--port", str(tport), *tflags], out / "target.log")
    draft = start(root, "draft_service.server", ["--model-path", str(MODELS / "splitspec-code-draft"),
                                                 "--target-model-path", str(MODELS / "splitspec-code-target"),
                                                 "--port", str(dport), *dflags], out / "draft.log")
    try:
        bench = [sys.executable, "-m", "splitspec_tools.cli", "bench", "--target", f"127.0.0.1:{tport}",
                 "--draft", f"127.0.0.1:{dport}", "--configs", "target,dflash-grpc", "--temperatures", "0",
                 "--num-prompts", str(a.prompts), "--max-new-tokens", str(a.tokens), "--concurrency", a.concurrency,
                 "--sweep-configs", "target,dflash-grpc", "--sweep-requests", "8", "--sweep-repeats",
                 str(a.sweep_repeats), "--warmup", "1", "--step-time-prompts", "0", "--no-plots",
                 "--out", str(out / "bench")]
        subprocess.run(bench, cwd=ROOT, check=True, timeout=a.timeout_s, stdout=open(out / "bench.log", "w"),
                       stderr=subprocess.STDOUT)
        steps = [sys.executable, str(HERE.parent / "steps.py"), "--target", f"127.0.0.1:{tport}", "--draft",
                 f"127.0.0.1:{dport}", "--streams", "1,8", "--prompts", "8", "--tokens", str(a.tokens)]
        res = subprocess.run(steps, cwd=ROOT, check=True, timeout=a.timeout_s, capture_output=True, text=True)
        (out / "steps.json").write_text(res.stdout)
    finally:
        for p in (target, draft):
            p.terminate()
        for p in (target, draft):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return summarize(out)


def summarize(out: Path) -> dict:
    r = json.loads((out / "bench" / "results.json").read_text())
    s = {"meta": r.get("meta")}
    for c in r.get("configs", []):
        if c.get("temperature", 0) == 0:
            s[f"one_stream_{c.get('config', c.get('name'))}"] = c.get("tokens_per_s")
    for p in r.get("concurrency") or []:
        s[f"sweep_{p['config']}_{p['streams']}"] = round(p["tokens_per_s"], 1)
        if p.get("greedy_matches") is not None:
            s[f"matches_{p['config']}_{p['streams']}"] = f"{p['greedy_matches']}/{p['requests']}"
    steps = json.loads((out / "steps.json").read_text())
    for lvl, d in steps["levels"].items():
        for kind in ("propose", "verify", "decode_token"):
            if kind in d:
                s[f"{kind}_{lvl}"] = {k: d[kind][k] for k in ("round_trip_ms", "model_ms", "queue_ms", "wire_ms", "batch")}
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setting", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sweep-repeats", type=int, default=1)
    ap.add_argument("--concurrency", default="1,8", help="the sweep's stream counts (the main table is one stream)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="each bench / steps run of a setting")
    ap.add_argument("--out", default="/tmp/i25/threads")
    ap.add_argument("--port", type=int, default=51300)
    a = ap.parse_args()
    settings = []
    for spec in a.setting:
        name, rest = spec.split("=", 1)
        root, flags = rest.split(":", 1)
        tflags, _, dflags = flags.partition("|")
        settings.append((name, (ROOT / root).resolve(), shlex.split(tflags), shlex.split(dflags)))
    summary: dict = {}
    for rnd in range(a.rounds):
        for i, (name, root, tflags, dflags) in enumerate(settings):
            t = time.time()
            print(f"round {rnd} {name}: {root} target {tflags} draft {dflags}", flush=True)
            try:
                s = run_setting(name, root, tflags, dflags, Path(a.out) / f"{name}-{rnd}", a, a.port + 10 * i)
            except Exception as exc:  # noqa: BLE001 - keep the other settings' runs
                print(f"  failed: {exc}", flush=True)
                continue
            summary.setdefault(name, []).append(s)
            print(f"  {time.time() - t:.0f} s", json.dumps({k: v for k, v in s.items() if k != 'meta'})[:900], flush=True)
            Path(a.out, "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
