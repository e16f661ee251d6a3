"""Usage: python docs/bench/auto/colocate.py [SETTING,SETTING...] [ROUNDS]

Co-located services: torch threads and OpenMP wait policy, measured side by side.
For each setting: start target + draft + gateway, warm up, then target-only and auto at 1 and 16
streams (T=0, 128 new tokens), alternating settings across rounds."""
import sys, time, json, statistics
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from splitspec_tools.ops.launch import start_service
from splitspec_tools.client import build_request, stream
from splitspec_tools.bench.prompts import default_prompts
from tokenizers import Tokenizer

T = str(ROOT / "models/splitspec-code-target"); D = str(ROOT / "models/splitspec-code-draft")
tok = Tokenizer.from_file(T + "/tokenizer.json")
prompts = [tok.encode(p.text).ids[-512:] for p in default_prompts(16)]
SETTINGS = {
    "t0/v1/d1 omp-default": dict(t=0, v=1, d=1, env={}),
    "t0/v1/d1 omp-passive": dict(t=0, v=1, d=1, env={"OMP_WAIT_POLICY": "PASSIVE"}),
    "t1/v1/d1 omp-passive": dict(t=1, v=1, d=1, env={"OMP_WAIT_POLICY": "PASSIVE"}),
    "t0/v0/d1 omp-passive": dict(t=0, v=0, d=1, env={"OMP_WAIT_POLICY": "PASSIVE"}),
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SETTINGS)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
WORK = [("none", 1), ("auto", 1), ("none", 16), ("auto", 16)]
res = {n: {f"{m}x{c}": [] for m, c in WORK} for n in names}

def run(addr, method, conc):
    def one(p):
        for r in stream(addr, build_request(p, max_new_tokens=128, temperature=0, ignore_eos=True, method=method)):
            if r.HasField("complete"): return r.complete.usage.completion_tokens
    jobs = prompts[:8] if conc == 1 else prompts
    t = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        n = sum(ex.map(one, jobs))
    return n / (time.perf_counter() - t)

for r in range(rounds):
    for name in names:
        s = SETTINGS[name]; logd = Path(f"bench-out/colocate-logs/{r}-{name.replace('/', '_').replace(' ', '_')}")
        tgt = start_service("target", ["--model-path", T, "--torch-threads", str(s["t"]), "--verify-torch-threads", str(s["v"]), "--log-level", "warning"], log_dir=logd, env=s["env"])
        drf = start_service("draft", ["--method", "dflash", "--model-path", D, "--target-model-path", T, "--torch-threads", str(s["d"]), "--log-level", "warning"], log_dir=logd, env=s["env"])
        tgt.wait_healthy(300); drf.wait_healthy(300)
        gw = start_service("gateway", ["--target", tgt.address, "--draft", drf.address, "--log-level", "warning"], log_dir=logd)
        gw.wait_healthy(120)
        try:
            run(gw.address, "auto", 4); run(gw.address, "none", 4)   # warm-up
            for m, c in WORK:
                v = run(gw.address, m, c); res[name][f"{m}x{c}"].append(v)
                print(f"round {r} {name:24s} {m}x{c}: {v:.1f} tok/s", flush=True)
        finally:
            for p in (gw, drf, tgt): p.stop()
print(json.dumps({n: {k: round(statistics.median(v), 1) for k, v in w.items()} for n, w in res.items()}, indent=1))
