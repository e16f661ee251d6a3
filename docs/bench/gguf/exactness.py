"""Greedy speculative equals target-only? For each prompt: target-only greedy decoding of N
tokens, then the same prompt verified in chains of width W whose drafts are that very
continuation (a perfect drafter: every verify row is compared), through the engine the target
service runs. A prompt mismatches when any committed token differs. Prints the rate per
(dtype, attention) with the command and machine. --verify-threads runs the speculative side on
another intra-op thread count than the target-only side (--threads): what a target that switched
threads for its verifies would compute.

    python docs/bench/gguf/exactness.py --prompts 200 --dtypes bfloat16,float32 --attention torch,torch-exact
    python docs/bench/gguf/exactness.py --prompts 24 --dtypes bfloat16 --attention torch-exact --threads 2 --verify-threads 1
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from splitspec_tools.bench.prompts import chat_prompts, humaneval_prompts
from splitspec_tools.defaults import real_target
from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence, load_model, load_tokenizer
from splitspec.models.loader import model_folder


def mismatches(model, prompts, new_tokens: int, width: int, attention: str, threads: int,
               verify_threads: int) -> list[str]:
    bad = []
    for pid, ids in prompts:
        torch.set_num_threads(threads)
        ref = TargetSequence(model, ids, max_len=len(ids) + new_tokens + width + 2, attention=attention)
        greedy = [ref.prefill().committed[0]]
        while len(greedy) < new_tokens:
            greedy.append(ref.decode().committed[0])
        torch.set_num_threads(verify_threads)
        spec = TargetSequence(model, ids, max_len=len(ids) + new_tokens + width + 2, attention=attention)
        got = [spec.prefill().committed[0]]
        while len(got) < new_tokens:
            chain = greedy[len(got):len(got) + width - 1]
            if not chain:
                break
            got += spec.verify(Tree.chain(chain)).committed
            if got[:len(got)] != greedy[:len(got)]:
                break
        if got[:new_tokens] != greedy[:len(got[:new_tokens])]:
            bad.append(pid)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    ap.add_argument("--prompts", type=int, default=200, help="HumanEval's 164 first, then chat prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--attention", default="torch,torch-exact")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verify-threads", type=int, default=0, help="the speculative side's threads (0: --threads)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    path = model_folder(a.model_path or real_target())
    tok = load_tokenizer(path)
    ps = humaneval_prompts(path, a.prompts)
    if len(ps) < a.prompts:
        ps += chat_prompts(path, a.prompts - len(ps))
    prompts = [(p.id, tok.encode(p.text).ids) for p in ps]
    print(f"command: python {' '.join(sys.argv)}\nmachine: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {a.threads} thread(s) (verify: {a.verify_threads or a.threads}); {len(prompts)} prompts x {a.new_tokens} tokens, "
          f"verify width {a.width}", flush=True)
    for dt in a.dtypes.split(","):
        model = load_model(path, dtype=dt)
        for att in a.attention.split(","):
            t = time.perf_counter()
            bad = mismatches(model, prompts, a.new_tokens, a.width, att, a.threads, a.verify_threads or a.threads)
            print(f"{dt:9s} {att:12s} mismatching prompts {len(bad)}/{len(prompts)} "
                  f"({100 * len(bad) / len(prompts):.1f}%) in {time.perf_counter() - t:.0f} s; first: {bad[:5]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
