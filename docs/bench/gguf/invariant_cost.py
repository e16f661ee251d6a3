"""What batch-invariant forwards cost: the target's forward time for one decode step, one
verify of a width-8 chain and one decode step of 16 sessions together, with attention "torch"
and "torch-exact" (`--batch-invariant`) taking turns, medians of --reps, on prompts of
~--prompt-tokens tokens. Prints the command and the machine.

    python docs/bench/gguf/invariant_cost.py --dtype bfloat16 --reps 30
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from splitspec_tools.defaults import real_target
from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence, load_model
from target_service.pools import make_pool
from target_service.runner import Decode, Verify, run_batch
from target_service.torch_verifier import TorchVerifier


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", default="128,2000")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_model(a.model_path or real_target(), dtype=a.dtype)
    print(f"command: python {' '.join(sys.argv)}\nmachine: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, dtype {a.dtype}")
    modes = ("torch", "torch-exact")
    for plen in (int(x) for x in a.prompt_tokens.split(",")):
        g = torch.Generator().manual_seed(plen)
        prompts = [torch.randint(100, 40000, (plen,), generator=g).tolist() for _ in range(16)]
        pool = make_pool(model, num_blocks=16 * (-(-(plen + 64) // 16)) + 16, block_size=16)
        seqs = {m: [TargetSequence(model, p, max_len=plen + 64, pool=pool, attention=m) for p in prompts[:8]]
                for m in modes}
        for m in modes:
            for s in seqs[m]:
                s.prefill()
        times = {(m, k): [] for m in modes for k in ("decode x1", "verify-8 x1", "decode x8")}
        for rep in range(a.reps):
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                s0 = seqs[m][0]
                for kind, steps in (("decode x1", [Decode(s0.seq)]),
                                    ("verify-8 x1", [Verify(s0.seq, Tree.chain([5] * 7))]),
                                    ("decode x8", [Decode(s.seq) for s in seqs[m]])):
                    saved = [(len(s.seq.tokens), s.seq.table.length) for s in seqs[m]]
                    t = time.perf_counter()
                    run_batch(model, pool, TorchVerifier(), steps, m)
                    times[(m, kind)].append((time.perf_counter() - t) * 1e3)
                    # Roll back what the step appended, so every repetition sees the same lengths.
                    for s, (ntok, length) in zip(seqs[m], saved):
                        del s.seq.tokens[ntok:]
                        s.seq.table.length = length
        for kind in ("decode x1", "verify-8 x1", "decode x8"):
            base, exact = (statistics.median(times[(m, kind)]) for m in modes)
            print(f"prompt {plen:5d} {kind:12s} torch {base:7.2f} ms  torch-exact {exact:7.2f} ms  "
                  f"ratio {exact / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
