"""τ of a DFlash / DFlash2 token tree whose spine (the drafter's own chain) is laid first, against
a tree chosen by score alone (DDTree's best-first heap: the greedy path is still in it, to the
depth its score earns), and against the chain. Same prompts, same draft, one stream, in process.

    python docs/bench/trees/spine.py --draft models/splitspec-code-draft --nodes 15 --topk 4
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

import draft_service.proposer as proposer
from draft_service.architectures import load_draft
from splitspec_tools.bench.trees import prompts_of_length, run_generation
from splitspec.engine.sample import SamplingParams
from splitspec_tools.train.draft_data import target_tokenizer
from splitspec.models.loader import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--draft", action="append")
ap.add_argument("--target", default="models/splitspec-code-target")
ap.add_argument("--prompts", type=int, default=6)
ap.add_argument("--lengths", default="64,512")
ap.add_argument("--max-new", type=int, default=64)
ap.add_argument("--nodes", default="15,31")
ap.add_argument("--topk", type=int, default=4)
ap.add_argument("--temperatures", default="0,1.0")
args = ap.parse_args()
torch.set_num_threads(1)
print("command: python " + " ".join(sys.argv), f"\nmachine: {platform.processor() or platform.machine()}, "
      f"torch {torch.__version__}", flush=True)

orig_tree, orig_tree2 = proposer.dflash_tree, proposer.dflash2_tree
mode = {"spine": True}


def with_spine(fn):
    """The proposer lays no spine for greedy drafts; "spine first" lays the greedy walk (the
    best-first chain of topk 1, as deep as the tree may go) before the rest, as it did before."""
    def build(*a, **kw):
        if mode["spine"] and not kw["spine"]:
            kw["spine"] = fn(*a, **{**kw, "budget": kw["max_depth"], "topk": 1}).token_ids
        elif not mode["spine"]:
            kw["spine"] = []
        return fn(*a, **kw)
    return build


proposer.dflash_tree, proposer.dflash2_tree = with_spine(orig_tree), with_spine(orig_tree2)
model = load_model(args.target)
tok = target_tokenizer(args.target)
for path in args.draft or ["models/splitspec-code-draft"]:
    draft = load_draft(path, args.target)
    for length in [int(x) for x in args.lengths.split(",")]:
        prompts = prompts_of_length(tok, args.prompts, length)
        for t in [float(x) for x in args.temperatures.split(",")]:
            tau = {}
            for name, width, topk, spine in [("chain", 8, 1, True)] + [
                    (f"{n} nodes {'spine first' if s else 'best-first'}", n + 1, args.topk, s)
                    for n in [int(x) for x in args.nodes.split(",")] for s in (True, False)]:
                mode["spine"] = spine
                committed = steps = 0
                for i, prompt in enumerate(prompts):
                    params = SamplingParams(temperature=t, top_p=0.95 if t > 0 else 1.0,
                                            seed=i if t > 0 else None).validate()
                    out, st, _ = run_generation(model, draft, prompt, params=params, draft_params=None,
                                                width=width, topk=topk, max_new=args.max_new)
                    committed, steps = committed + st.committed, steps + st.verify_steps
                tau[name] = committed / steps
            chain = tau.pop("chain")
            print(f"{path} | {length} | T={t:g} | chain {chain:.2f} | " +
                  " | ".join(f"{k} {v:.2f} ({v / chain:.2f}x)" for k, v in tau.items()), flush=True)
