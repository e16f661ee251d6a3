"""The draft trainer's producer, old revision against new, interleaved in one run: tokens/s of
regeneration (prompt + the target's own continuation, features of every position) and of the
replay feature pass, on the default target as `train-draft` runs it (bfloat16 weights, one
torch thread, --gen-batch 32, --prompt-len 128, --seq-len 512 scaled down by --seq-len here).

    python docs/bench/issue39/producer_ab.py --old /tmp/splitspec-old --rounds 3

--old is a checkout of the revision before (git worktree add /tmp/splitspec-old <rev>); each
measurement runs in a fresh interpreter whose sys.path starts with that checkout."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads(1)
from splitspec_tools.train.draft_data import load_target, regenerate, features_of, windows, corpus_streams
from pathlib import Path
model = load_target({target!r}, dtype="bfloat16")
g = torch.Generator().manual_seed(0)
stream = torch.randint(0, model.cfg.vocab_size, (200_000,), generator=g, dtype=torch.int32)
layers = (1, 4, 7) if model.cfg.num_hidden_layers >= 8 else (0, model.cfg.num_hidden_layers - 1)
prompts = windows(stream, {rows}, {prompt_len}, g)
temps = torch.tensor([0.0, 1.0] * ({rows} // 2))
t0 = time.perf_counter()
toks, feats = regenerate(model, prompts, {seq_len}, temps, 1.0, g, layers)
regen = time.perf_counter() - t0
t0 = time.perf_counter()
f2 = features_of(model, toks, layers)
replay = time.perf_counter() - t0
n = toks.numel()
print(json.dumps({{"regen_tok_s": n / regen, "replay_tok_s": n / replay,
                  "greedy_rows_match_features": float((f2[0] - feats[0]).abs().max())}}))
"""


def run(root: str, a) -> dict:
    code = CHILD.format(root=root, target=a.target, rows=a.rows, prompt_len=a.prompt_len, seq_len=a.seq_len)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True)
    p.add_argument("--target", default=str(ROOT / "models/splitspec-code-target"))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print("command:", " ".join(sys.argv), "| machine:", platform.processor() or platform.machine(),
          f"{__import__('os').cpu_count()} cores")
    res = {"old": [], "new": []}
    for r in range(a.rounds):
        for name, root in (("old", a.old), ("new", str(ROOT))):
            res[name].append(run(root, a))
            print(r, name, res[name][-1], flush=True)
    for key in ("regen_tok_s", "replay_tok_s"):
        o = statistics.median(x[key] for x in res["old"])
        n = statistics.median(x[key] for x in res["new"])
        print(f"{key}: old {o:.0f}  new {n:.0f}  new/old {n / o:.2f}x")


if __name__ == "__main__":
    main()
