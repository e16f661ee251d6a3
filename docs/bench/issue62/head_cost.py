"""The draft head's cost with the whole vocabulary and with a reduced one, on a real target.

    PYTHONPATH=. nice python docs/bench/issue62/head_cost.py --target <SmolLM2 .gguf> \\
        --vocab smollm2-vocab.safetensors [more maps] --rows 7 --repeats 60

Times `DFlashDraft.logits` (the head matmul over the B - 1 = 7 mask slots of one Propose, and for
a reduced head also the scatter back onto the target's vocabulary) and `draft_logits` (the
matmul alone), interleaved call by call so that the shared machine's noise hits all alike;
prints the median and the quartiles of each in wall time and in this process's CPU time (which
other processes on the cores inflate less), one thread."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from draft_service import vocab
from draft_service.dflash import new_draft
from target_service.engine import load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--vocab", required=True, nargs="+", help="maps made by `splitspec draft-vocab`")
    p.add_argument("--rows", type=int, default=7)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.target)
    V = target.cfg.vocab_size
    h = torch.randn(args.rows, target.cfg.hidden_size)
    calls = {}
    for ids in [None] + [vocab.load_vocab(f, V)[0] for f in args.vocab]:
        d = new_draft(target.cfg, num_layers=1, block_size=args.rows + 1, mask_token_id=0, draft_vocab=ids)
        d.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
        K = V if ids is None else len(ids)
        calls[f"{K} logits"] = d.eval().logits
        if ids is not None:
            calls[f"{K} draft_logits (matmul only)"] = d.draft_logits
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    with torch.inference_mode():
        for _ in range(5):
            for fn in calls.values():
                fn(h)
        for _ in range(args.repeats):
            for k, fn in calls.items():
                t, c = time.perf_counter(), time.process_time()
                fn(h)
                cpu[k].append((time.process_time() - c) * 1e3)
                wall[k].append((time.perf_counter() - t) * 1e3)
    out = {"target": args.target, "vocab": V, "rows": args.rows, "threads": args.threads, "repeats": args.repeats}
    full = f"{V} logits"
    for k in calls:
        row = {}
        for kind, ts in (("wall", wall[k]), ("cpu", cpu[k])):
            q = statistics.quantiles(ts, n=4)
            row[kind] = {"median_ms": statistics.median(ts), "q1_ms": q[0], "q3_ms": q[2]}
        ratio = {kind: row[kind]["median_ms"] / statistics.median((wall if kind == "wall" else cpu)[full])
                 for kind in ("wall", "cpu")}
        out[k] = {**row, "of_full": ratio}
        w, c = row["wall"], row["cpu"]
        print(f"{k:38s} wall median {w['median_ms']:8.3f} ms ({w['q1_ms']:.2f}..{w['q3_ms']:.2f}), "
              f"cpu median {c['median_ms']:8.3f} ms ({c['q1_ms']:.2f}..{c['q3_ms']:.2f}); "
              f"of the full head: wall {ratio['wall']:.3f}, cpu {ratio['cpu']:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
