"""Choose a draft's reduced vocabulary from the target's own outputs (`splitspec draft-vocab`, and
the `--draft-vocab-coverage` step of `splitspec train-draft`).

The target continues training prompts greedily (its argmax at every step, through the serving
runner, many rows a forward); each row's continuation is counted up to and including its first
end-of-sequence token. The kept set is the smallest set of the most counted tokens that holds
`--coverage` of them (`draft_service/vocab.py`), plus the end-of-sequence tokens, so a draft can
always propose the end of an answer. Counting the argmax, not sampled tokens, is what the draft is
judged on at temperature 0: a greedy verify accepts only the target's argmax.

    splitspec draft-vocab --target-model-path models/splitspec-code-target --out vocab.safetensors

prints the coverage of the top-K sets for `--report-sizes` on the counted tokens and, with
`--heldout-seqs`, on the continuations of held-out prompts (a fair estimate: the set was not chosen
on them)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draft_service import vocab
from splitspec_tools.defaults import DEFAULT_TARGET

from .draft_data import corpus_streams, eos_ids_of, load_target, regenerate, target_tokenizer, windows


def count_greedy(target, prompts: torch.Tensor, new_tokens: int, batch: int, eos_ids=()) -> torch.Tensor:
    """Counts [V] of the target's greedy continuations of prompts [n, P], each cut after its
    first end-of-sequence token."""
    V = target.cfg.vocab_size
    counts = torch.zeros(V, dtype=torch.long)
    P = prompts.shape[1]
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
    g = torch.Generator().manual_seed(0)      # unused by greedy rows; regenerate seeds every row
    for i in range(0, len(prompts), batch):
        rows = prompts[i:i + batch]
        tokens, _ = regenerate(target, rows, P + new_tokens, torch.zeros(len(rows)), 1.0, g, (0,))
        for row in tokens[:, P:].cpu():
            ends = torch.isin(row, eos).nonzero()
            counts += torch.bincount(row[:int(ends[0]) + 1 if len(ends) else len(row)], minlength=V)
    return counts


def training_prompts(streams: dict, split: str, n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return windows(streams[split], n, length, g)


def choose(target_path, target, streams: dict, *, num_seqs: int, prompt_len: int, new_tokens: int,
           batch: int, coverage: float, max_size: int | None, seed: int, min_size: int = 0,
           heldout_seqs: int = 0, report_sizes=()) -> dict:
    """Count the target's greedy tokens on `streams` (`corpus_streams`), choose and report:
    {"target_ids", "counts", "eos", "report"}."""
    tok = target_tokenizer(target_path) if (Path(str(target_path)) / "tokenizer.json").is_file() else None
    eos = tuple(i for i in eos_ids_of(target.cfg, tok) if i is not None and 0 <= i < target.cfg.vocab_size)
    t0 = time.perf_counter()
    prompts = training_prompts(streams, "train", num_seqs, prompt_len, seed)
    counts = count_greedy(target, prompts, new_tokens, batch, eos)
    ids = vocab.kept_by_coverage(counts, coverage, max_size=max_size, min_size=min_size, always=eos)
    report = {"counted_tokens": int(counts.sum()), "sequences": num_seqs, "seconds": time.perf_counter() - t0,
              "kept": int(ids.shape[0]), "coverage": vocab.coverage_of(counts, ids),
              "top_k": vocab.top_k_coverage(counts, report_sizes)}
    if heldout_seqs:
        held = count_greedy(target, training_prompts(streams, "heldout", heldout_seqs, prompt_len, seed + 1),
                            new_tokens, batch, eos)
        order = counts.double().sort(descending=True, stable=True).indices
        report["heldout"] = {"counted_tokens": int(held.sum()), "sequences": heldout_seqs,
                             "coverage": vocab.coverage_of(held, ids),
                             "top_k": {int(k): vocab.coverage_of(held, order[:k]) for k in report_sizes}}
    return {"target_ids": ids, "counts": counts, "eos": eos, "report": report}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitspec draft-vocab", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--target-model-path", default=DEFAULT_TARGET, help="the target (HF folder or .gguf)")
    a("--out", required=True, help="map file to write (safetensors: d2t, counts)")
    a("--run-dir", default="runs/draft-vocab", help="where the tokenized prompts are cached")
    a("--data", default="code", choices=["code", "chat"], help="prompts as train-draft builds them")
    a("--num-seqs", type=int, default=64, help="training prompts the target continues")
    a("--heldout-seqs", type=int, default=0, help="held-out prompts to measure the chosen set on")
    a("--prompt-len", type=int, default=128)
    a("--new-tokens", type=int, default=128, help="greedy tokens per prompt (fewer where it ends)")
    a("--batch", type=int, default=32, help="rows per batched forward")
    a("--coverage", type=float, default=0.99, help="share of the counted argmax tokens the kept set holds")
    a("--max-size", type=int, default=None, help="cap on the kept set (coverage is then what it holds)")
    a("--min-size", type=int, default=0,
      help="floor on the kept set, filled with the next most counted tokens, then the lowest ids: on a small "
           "sample the smallest set holding --coverage fits that sample (see --heldout-seqs)")
    a("--report-sizes", default="4096,8192,12288,16384", help="K of the top-K sets whose coverage is printed")
    a("--max-files", type=int, default=None, help="a small corpus subset (tests)")
    a("--threads", type=int, default=1)
    a("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target_model_path)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sizes = [int(k) for k in args.report_sizes.split(",") if k]
    streams = corpus_streams(args.target_model_path, run_dir, args.max_files, args.data, args.prompt_len)
    got = choose(args.target_model_path, target, streams, num_seqs=args.num_seqs, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, batch=args.batch, coverage=args.coverage, max_size=args.max_size,
                 min_size=args.min_size, seed=args.seed, heldout_seqs=args.heldout_seqs, report_sizes=sizes)
    r = got["report"]
    vocab.save_vocab(args.out, got["target_ids"], got["counts"],
                     {"target": str(args.target_model_path), "data": args.data, "coverage": r["coverage"],
                      "report": json.dumps(r)})
    V = target.cfg.vocab_size
    print(f"counted {r['counted_tokens']:,} greedy tokens of {r['sequences']} prompts in {r['seconds']:.0f}s; "
          f"kept {r['kept']:,} of {V:,} tokens ({r['kept'] / V:.1%}), holding {r['coverage']:.2%} of them")
    for k, c in r["top_k"].items():
        held = r.get("heldout", {}).get("top_k", {}).get(k)
        print(f"  top {k:>6,}: {c:.2%} of the counted tokens"
              + (f", {held:.2%} of {r['heldout']['counted_tokens']:,} held-out ones" if held is not None else ""))
    if "heldout" in r:
        print(f"  the kept set holds {r['heldout']['coverage']:.2%} of the held-out greedy tokens")
    print(json.dumps({"out": args.out, **{k: v for k, v in r.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
