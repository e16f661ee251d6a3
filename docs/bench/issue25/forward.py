"""Issue 25: in-process cost of each step kind, two checkouts side by side.

    python docs/bench/issue25/forward.py --rounds 5 OLD_ROOT NEW_ROOT

For each round, each checkout runs in a fresh process (its own code imported first on the path;
the bundled models of this checkout), one intra-op thread, ~400-token contexts, and times:
target decode (1 row and 8 rows in one forward), target verify of an 8-wide chain (1 row and
8 rows), a 512-token prefill chunk, and a DFlash2 Propose (1 session and 8 in one forward).
Each round's figure is the median over the step's repetitions of the thread's CPU time
(`time.thread_time`); the table gives the median over rounds and the best round (on a shared
host other tenants slow some rounds down by 30-50%, even in CPU time, so the best round is
the steadier estimate of what the step itself costs). Checkouts take turns, so drift in the
host hits both alike.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
MODELS = HERE.parents[3] / "models"

CHILD = r'''
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
models = sys.argv[2]
from splitspec.models.loader import load_model
from target_service.engine import TargetSequence
from target_service.pools import make_pool
from target_service.runner import Decode, Prefill, Verify, run_batch
from target_service.torch_verifier import TorchVerifier
from splitspec.engine.tree import Tree
from draft_service.architectures import load_draft
from draft_service.dflash import new_pool
from draft_service.proposer import DFlashProposer, propose_batch

g = torch.Generator().manual_seed(0)
m = load_model(models + "/splitspec-code-target")
out = {}

def timed(f, reps):
    ts = []
    for i in range(reps + 5):
        t = time.thread_time()
        f()
        if i >= 5:
            ts.append((time.thread_time() - t) * 1e3)
    return statistics.median(ts)

pool = make_pool(m, num_blocks=8 * 80 + 2)
verifier = TorchVerifier()
seqs = []
for _ in range(8):
    s = TargetSequence(m, torch.randint(2, 8000, (400,), generator=g).tolist(), max_len=1200, pool=pool)
    s.prefill()
    seqs.append(s)
chain = Tree.chain([5, 6, 7, 8, 9, 10, 11])
def step(kind, rows):
    def f():
        if kind == "decode":
            steps = [Decode(s.seq) for s in seqs[:rows]]
        else:
            steps = [Verify(s.seq, chain) for s in seqs[:rows]]
        res = run_batch(m, pool, verifier, steps)
        assert not any(isinstance(r, Exception) for r in res), res
        if kind == "verify":   # keep contexts near 400 tokens
            for s in seqs[:rows]:
                n = len(res[0].committed)
                s.seq.tokens[-n:] = []
                s.seq.table.truncate(s.seq.table.length - n)
    return f
out["decode x1"] = timed(step("decode", 1), 40)
out["verify8 x1"] = timed(step("verify", 1), 30)
out["decode x8"] = timed(step("decode", 8), 20)
out["verify8 x8"] = timed(step("verify", 8), 15)
prompt = torch.randint(2, 8000, (512,), generator=g).tolist()
def prefill():
    s = TargetSequence(m, prompt, max_len=600, pool=pool)
    run_batch(m, pool, verifier, [Prefill(s.seq, 512)])
    s.seq.table.free()
out["prefill 512"] = timed(prefill, 6)

d = load_draft(models + "/splitspec-code-draft", models + "/splitspec-code-target")
F = d.cfg.target_feature_size
dpool = new_pool(d, 9 * 260)
props = []
for _ in range(8):
    p = DFlashProposer(d, max_len=4000, pool=dpool)
    p.open(torch.randint(2, 8000, (400,), generator=g).tolist(), torch.randn(400, F, generator=g))
    props.append(p)
def propose(n):
    def f():
        items = [(p, len(p.tokens) + 3, [5, 6, 7], torch.randn(len(p.tokens) + 2 - p.cache.length, F)) for p in props[:n]]
        res = propose_batch(d, items)
        assert not any(isinstance(r, Exception) for r in res), res
    return f
out["propose x1"] = timed(propose(1), 30)
out["propose x8"] = timed(propose(8), 15)
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+", help="checkouts to compare (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"$ python {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}")
    runs: dict[str, list[dict]] = {r: [] for r in args.roots}
    for i in range(args.rounds):
        for root in args.roots:
            res = subprocess.run([sys.executable, "-c", CHILD, str(Path(root).resolve()), str(MODELS)],
                                 capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
            if res.returncode:
                sys.exit(f"{root}: {res.stderr[-2000:]}")
            runs[root].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {i + 1} {root}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[root][-1].items()), flush=True)
    base = args.roots[0]
    keys = list(runs[base][0])
    med = {r: {k: statistics.median(x[k] for x in runs[r]) for k in keys} for r in args.roots}
    best = {r: {k: min(x[k] for x in runs[r]) for k in keys} for r in args.roots}
    last = args.roots[-1]
    print("\n| step (ms of CPU: median of rounds / best round) | " + " | ".join(args.roots)
          + " | ÷ first (median) | ÷ first (best) |")
    print("|---|" + "---|" * len(args.roots) + "---|---|")
    for k in keys:
        cells = " | ".join(f"{med[r][k]:.2f} / {best[r][k]:.2f}" for r in args.roots)
        print(f"| {k} | {cells} | {med[last][k] / med[base][k]:.2f} | {best[last][k] / best[base][k]:.2f} |")


if __name__ == "__main__":
    main()
