"""`splitspec bench-trees`: chain vs tree drafts from one draft, side by side in process (the
`splitspec_tools.speculate` loop, no gRPC, so τ is the drafter's own): τ, tok/s, ms per step, tree ÷
chain; then what a verify costs against its node count (issue 23). More in docs/benchmarks.md.

    splitspec bench-trees                                      # default pair, ~15 min on 2 idle cores
    splitspec bench-trees --num-prompts 4 --prompt-lengths 64 --max-new-tokens 32     # quick look
"""
from __future__ import annotations

import time

from .harness import columns, csv_items, entry, header, interleave, log, median, metadata, ratio, tau


def add_flags(a) -> None:
    a("--draft", default="models/splitspec-code-draft", help="draft folder")
    a("--target-model-path", default="models/splitspec-code-target")
    a("--num-prompts", type=int, default=8, help="held-out prompts (function cuts from installed packages)")
    a("--prompt-lengths", default="64,512", help="prompt tokens (the last N tokens of each prompt)")
    a("--max-new-tokens", type=int, default=64)
    a("--temperatures", default="0,1.0")
    a("--top-p", type=float, default=0.95)
    a("--draft-sampling", default="greedy,sample", help="draft modes at T > 0")
    a("--chain-width", type=int, default=8, help="chain verify width (root + drafted tokens)")
    a("--tree", default="4:16", help="TOPK:WIDTH of the tree (verify width = root + nodes)")
    a("--nodes", default="7,15,31,63", help="tree sizes for the verify-cost part")
    a("--verify-repeats", type=int, default=7)
    a("--torch-threads", type=int, default=1)
    a("--seed", type=int, default=0)
    a("--out", default="bench-out/trees")


def prompts_of_length(tok, n: int, length: int) -> list[list[int]]:
    from .prompts import at_least, default_prompts
    return [p[-length:] for p, _ in at_least(default_prompts(4 * n, max_chars=max(1500, 6 * length)), tok, length, n)]


def run_generation(model, draft, prompt, *, params, draft_params, width: int, topk: int, max_new: int):
    from draft_service.proposer import DFlashProposer
    from splitspec_tools.speculate import speculative_generate
    from target_service.engine import TargetSequence
    max_len = len(prompt) + max_new + 2 * width + 2
    seq = TargetSequence(model, prompt, params, max_len=max_len, hidden_layers=tuple(draft.cfg.target_layer_ids))
    prop = DFlashProposer(draft, num_draft_tokens=width, topk=topk, max_len=max_len,
                          num_steps=draft.cfg.block_size - 1 if topk > 1 else None, sampling=draft_params)
    t0 = time.perf_counter()
    out, stats = speculative_generate(seq, prop, max_new)
    secs = time.perf_counter() - t0
    prop.close()
    return out, stats, secs


def tau_part(model, draft, tok, args) -> list[dict]:
    topk, tree_width = map(int, args.tree.split(":"))
    shapes, rows = {"chain": (args.chain_width, 1), "tree": (tree_width, topk)}, []
    for length in map(int, csv_items(args.prompt_lengths)):
        prompts = prompts_of_length(tok, args.num_prompts, length)
        for t in [float(x) for x in args.temperatures.split(",")]:
            for mode in ["greedy"] if t == 0 else args.draft_sampling.split(","):
                def one(name, prompt, params):      # (tokens, the loop's stats, seconds)
                    return run_generation(model, draft, prompt, params=params, width=shapes[name][0],
                                          draft_params=params if mode == "sample" and t > 0 else None,
                                          topk=shapes[name][1], max_new=args.max_new_tokens)
                got = dict(zip(shapes, interleave(list(shapes), prompts, 1, one, t, args.top_p, args.seed)))
                row = {"prompt_tokens": length, "temperature": t, "draft_sampling": mode,
                       "top_p": args.top_p if t > 0 else None, "prompts": len(prompts),
                       "t0_mismatches": sum(t == 0 and c[0] != r[0] for c, r in zip(got["chain"], got["tree"]))}
                for name, runs in got.items():
                    outs, stats, secs = [o for o, _, _ in runs], [st for _, st, _ in runs], sum(s for _, _, s in runs)
                    row.update({f"{name}_tau": tau(stats), f"{name}_tok_s": ratio(sum(map(len, outs)), secs),
                                f"{name}_ms_per_step": ratio(1e3 * secs, sum(st.verify_steps for st in stats))})
                row |= {f"{k}_tree_over_chain": ratio(row[f"tree_{k}"], row[f"chain_{k}"]) for k in ("tau", "tok_s")}
                log(f"{length} tokens, T={t:g} {mode}: τ chain {row['chain_tau']:.2f} tree {row['tree_tau']:.2f} "
                    f"({row['tau_tree_over_chain']:.2f}x), tok/s {row['tok_s_tree_over_chain']:.2f}x")
                rows.append(row)
    return rows


def best_first_shape(nodes: int, topk: int) -> list[int]:
    """Parents of a best-first tree of `nodes` nodes: the spine, then breadth under it."""
    from draft_service.tree_search import best_first_tree
    return best_first_tree(lambda _p, _d: [(j, -0.5 * (j + 1)) for j in range(topk)], root_token=0,
                           spine=[(0, -0.1)] * 7, budget=nodes, max_depth=7, topk=topk).parents


def verify_cost_part(model, tok, args) -> list[dict]:
    from splitspec.engine.tree import Tree
    from target_service.engine import TargetSequence
    topk, sizes = int(args.tree.split(":")[0]), [int(x) for x in csv_items(args.nodes)]
    shapes, rows = {n: tuple(best_first_shape(n, topk)) for n in sizes}, []
    for length in map(int, csv_items(args.prompt_lengths)):
        prompt = prompts_of_length(tok, 1, length)[0]
        seq = TargetSequence(model, prompt, max_len=length + (args.verify_repeats + 1) * (len(sizes) + 1) + 80)
        seq.prefill()
        times: dict[int, list[float]] = {n: [] for n in [0, *sizes]}
        for _ in range(args.verify_repeats):
            for n in [0, *sizes]:                           # interleaved: every size meets the same minute
                if n == 0:
                    t0 = time.perf_counter()
                    seq.decode()
                else:
                    # Tokens no target would pick next (the last token repeated is rarely it) are
                    # rejected, so each verify commits one token, as a decode does.
                    ids = tuple((seq.tokens[-1] + 1 + j) % model.cfg.vocab_size for j in range(len(shapes[n])))
                    t0 = time.perf_counter()
                    seq.verify(Tree(ids, shapes[n]))
                times[n].append((time.perf_counter() - t0) * 1e3)
        med = {n: median(ts) for n, ts in times.items()}
        rows += [{"prompt_tokens": length, "nodes": n, "verify_width": n + 1, "ms_median": ms, "vs_decode": ms / med[0]}
                 for n, ms in med.items()]
        log(f"verify cost at {length} tokens: " + ", ".join(f"{n + 1}-wide {ms:.1f} ms" for n, ms in med.items()))
    return rows


def markdown(res: dict) -> str:
    lines = header("splitspec bench-trees", res["meta"]) + ["## Accept length, chain vs tree (in process)", ""]
    lines += columns([("prompt tokens", "prompt_tokens", "{}"), ("T", "temperature", "{:g}"),
                      ("draft mode", "draft_sampling", "{}"), ("τ chain", "chain_tau"), ("τ tree", "tree_tau"),
                      ("τ tree ÷ chain", "tau_tree_over_chain"), ("tok/s chain", "chain_tok_s", "{:.1f}"),
                      ("tok/s tree", "tree_tok_s", "{:.1f}"), ("tok/s tree ÷ chain", "tok_s_tree_over_chain"),
                      ("ms/step chain", "chain_ms_per_step", "{:.1f}"), ("ms/step tree", "tree_ms_per_step", "{:.1f}"),
                      ("T=0 mismatches", "t0_mismatches", "{}")], res["tau"])
    lines += ["", "## Verify forward against its node count (one sequence, median)", ""]
    lines += columns([("prompt tokens", "prompt_tokens", "{}"), ("verify width", "verify_width", "{}"),
                      ("ms", "ms_median", "{:.1f}"), ("÷ decode", "vs_decode")], res["verify_cost"])
    return "\n".join(lines) + "\n"


def bench(args, argv: list[str]) -> dict:
    import torch

    from draft_service.architectures import load_draft
    from target_service.engine import load_model, load_tokenizer
    torch.set_num_threads(args.torch_threads)
    meta, path = metadata("splitspec bench-trees", argv), args.target_model_path
    model, draft, tok = load_model(path), load_draft(args.draft, path), load_tokenizer(path)
    with torch.inference_mode():
        return {"meta": meta, "verify_cost": verify_cost_part(model, tok, args),
                "tau": tau_part(model, draft, tok, args)}


main, cli_main = entry("splitspec bench-trees", __doc__, add_flags, bench, markdown,
                       lambda args, res: 1 if any(r["t0_mismatches"] for r in res["tau"]) else 0)
