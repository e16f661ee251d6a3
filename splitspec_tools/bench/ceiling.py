"""How high can the accept length τ go against a given target, whatever the drafter?

On real contexts (held-out prompts plus the target's own continuations), the τ of two idealised
drafters of block size B: the target's own argmax chain under target-only verification (what
greedy-draft mode can reach), and block drafts sampled from the exact per-slot marginals under
`min(1, p/q)` (what a perfectly trained DFlash draft reaches in sampled mode); and the target's
mean entropy along its own paths. At T=0 both are B. docs/training.md, "How high can τ go
against a target?", explains both.

    python -m splitspec_tools.bench.ceiling --temperature 1.0 --top-p 0.95     # or: splitspec ceiling ...
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from splitspec.engine.sample import SamplingParams, probs_from_logits
from target_service.engine import SequenceBatch


@dataclass
class ContextCeiling:
    greedy_accept: torch.Tensor    # [K] P(slot k accepted | slots < k accepted), target's argmax chain
    sampled_accept: torch.Tensor   # [m, K] min(1, p/q) of each sampled draft path, slot by slot
    entropy: float                 # mean entropy of p over the target's paths, nats

    @property
    def greedy_tau(self) -> float:
        return 1.0 + float(self.greedy_accept.cumprod(-1).sum())

    @property
    def sampled_tau(self) -> float:
        return 1.0 + float(self.sampled_accept.cumprod(-1).sum(-1).mean())


def _probs(outs, params: SamplingParams) -> torch.Tensor:
    """p(·) of each row's step outputs (their kept logits) -> [rows, V]."""
    return probs_from_logits(torch.cat([o.logits for o in outs]), params)


def _batch(model, context: list[int], rows: int, room: int):
    """The context on the target's own runner (one forward path for every target family), with
    room for `rows` branches of `room` more tokens; rows decode greedily, since each step's token
    is chosen here (fed) from the logits they keep."""
    return SequenceBatch(model, [context], [SamplingParams()], max_len=len(context) + room + 1,
                         keep_logits=True, rows=1 + rows)


@torch.inference_mode()
def context_ceiling(model, context: list[int], *, block_size: int, params: SamplingParams,
                    num_paths: int, generator: torch.Generator) -> ContextCeiling:
    K = block_size - 1
    batch = _batch(model, context, num_paths, K)
    p1 = _probs(batch.prefill(), params)[0]
    # the target's own paths, sampled slot by slot, and p along them
    paths = torch.zeros(num_paths, K, dtype=torch.long)
    rows, p, ps = batch.fork(0, num_paths), p1.expand(num_paths, -1), []
    for k in range(K):
        ps.append(p)
        paths[:, k] = torch.multinomial(p, 1, generator=generator).flatten()
        if k < K - 1:
            p = _probs(batch.decode(rows, feed=paths[:, k].tolist()), params)
    batch.release(rows)
    ps = torch.stack(ps, 1)                                              # [m, K, V]
    entropy = float(-(ps * ps.clamp(min=1e-30).log()).sum(-1).mean())
    q = ps.mean(0)                                                       # [K, V] marginals
    # sampled block drafts: y_k ~ q_k independently, accepted with min(1, p(y_k|c, y_<k) / q_k(y_k))
    y = torch.stack([torch.multinomial(q[k], num_paths, replacement=True, generator=generator)
                     for k in range(K)], 1)                              # [m, K]
    rows = batch.fork(0, num_paths)     # p(·|c, y_<k) along each draft path, one forked row per path
    py = torch.stack([p1.expand(num_paths, -1)] + [_probs(batch.decode(rows, feed=y[:, k].tolist()), params)
                                                   for k in range(K - 1)], 1).gather(2, y[..., None])[..., 0]
    batch.release(rows)
    qy = q.gather(1, y.T).T
    sampled = (py / qy).clamp(max=1.0)
    # greedy drafts: the target's argmax chain, accepted with probability p(y_k)
    p, acc = p1[None], []
    rows = batch.fork(0, 1)
    for k in range(K):
        acc.append(p.max(-1).values[0])
        if k < K - 1:
            p = _probs(batch.decode(rows, feed=[int(p.argmax(-1)[0])]), params)
    return ContextCeiling(torch.stack(acc), sampled, entropy)


@torch.inference_mode()
def contexts_of(model, prompt: list[int], offsets: list[int], params: SamplingParams,
                generator: torch.Generator) -> list[list[int]]:
    """The prompt plus the target's own continuation (sampled with `params`), cut after each of
    `offsets` generated tokens — the contexts a drafter sees while the target generates."""
    need = max(offsets)
    batch = _batch(model, prompt, 0, need)
    p = _probs(batch.prefill(), params)[0]
    toks, out = list(prompt), []
    for n in range(need + 1):
        if n in offsets:
            out.append(list(toks))
        if n == need:
            break
        nxt = int(torch.multinomial(p, 1, generator=generator))
        toks.append(nxt)
        p = _probs(batch.decode(feed=[nxt]), params)[0]
    return out


def ceiling(model, prompts: list[list[int]], *, block_size: int = 8, params: SamplingParams,
            num_paths: int = 64, offsets=(0, 40, 80, 120), seed: int = 0, progress=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = []
    for i, pr in enumerate(prompts):
        per += [context_ceiling(model, ctx, block_size=block_size, params=params, num_paths=num_paths, generator=g)
                for ctx in contexts_of(model, pr, list(offsets), params, g)]
        if progress is not None:
            progress(i + 1, len(prompts))
    greedy = torch.stack([r.greedy_accept for r in per]).cumprod(-1)       # [n, K] P(reach slot k)
    sampled = torch.stack([r.sampled_accept.cumprod(-1).mean(0) for r in per])
    return {
        "contexts": len(per), "block_size": block_size, "num_paths": num_paths,
        "temperature": params.temperature, "top_p": params.top_p,
        "entropy_nats": sum(r.entropy for r in per) / len(per),
        "greedy_tau": 1.0 + float(greedy.sum(-1).mean()),
        "sampled_tau": 1.0 + float(sampled.sum(-1).mean()),
        # P(every slot up to k accepted), the figure the benchmark's acceptance curves show
        "greedy_reach_per_position": greedy.mean(0).tolist(),
        "sampled_reach_per_position": sampled.mean(0).tolist(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="splitspec ceiling", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--target-model-path", default="models/splitspec-code-target")
    a("--prompts", default=None, help="JSONL prompts (as `splitspec bench --prompts`); default: the "
                                      "benchmark's held-out third-party prompts")
    a("--num-prompts", type=int, default=50)
    a("--temperature", type=float, default=1.0)
    a("--top-p", type=float, default=0.95)
    a("--block-size", type=int, default=8, help="verify width: last token + B-1 drafted tokens")
    a("--num-paths", type=int, default=64, help="target paths per context for the marginals")
    a("--offsets", default="0,40,80,120", help="contexts per prompt: after this many generated tokens")
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=None)
    a("--out", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    from target_service.engine import load_model, load_tokenizer

    from .harness import log, machine_line, metadata
    from .prompts import default_prompts, digest, load_jsonl
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.target_model_path)
    raw = load_jsonl(args.prompts, args.num_prompts) if args.prompts else default_prompts(args.num_prompts)
    tok = None if all(p.token_ids for p in raw) else load_tokenizer(args.target_model_path)
    prompts = [list(p.token_ids) or tok.encode(p.text).ids for p in raw]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p).validate()
    t0 = time.time()
    res = ceiling(model, prompts, block_size=args.block_size, params=params, num_paths=args.num_paths,
                  offsets=[int(o) for o in args.offsets.split(",")], seed=args.seed,
                  progress=lambda done, total: log(f"{done}/{total} prompts, {time.time() - t0:.0f}s")
                  if done % 10 == 0 or done == total else None)
    meta = metadata("splitspec ceiling", sys.argv[1:] if argv is None else argv)
    res.update(seconds=round(time.time() - t0, 1), command=meta["command"], git_revision=meta["git_revision"],
               machine=machine_line(meta), prompts_digest=digest(prompts))
    reach = lambda key: " ".join(f"{x:.2f}" for x in res[f"{key}_reach_per_position"])   # noqa: E731
    print(f"{res['contexts']} contexts ({len(prompts)} prompts), T={args.temperature} top_p={args.top_p}, "
          f"B={args.block_size}, {args.num_paths} paths/context, {res['seconds']:.0f}s\n"
          f"command: {res['command']} | git {res['git_revision']} | {res['machine']}\n"
          f"target entropy along its own paths: {res['entropy_nats']:.2f} nats/token\n"
          f"tau, greedy drafts (target's argmax chain):      {res['greedy_tau']:.2f}   reach per slot {reach('greedy')}\n"
          f"tau, sampled drafts (exact marginals, min(1,p/q)): {res['sampled_tau']:.2f}   "
          f"reach per slot {reach('sampled')}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
