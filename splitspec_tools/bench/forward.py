"""`splitspec bench-forward`: the target's forward in process, no services (docs/speculation.md,
"Exact at bf16"). `exactness`: per prompt, target-only greedy decoding, then the same prompt
verified in chains whose drafts are that continuation (a perfect drafter: every verify row is
compared); a prompt mismatches when a committed token differs. `cost`: forward ms of a decode, a
width-8 verify and a decode of 8 sessions, plain and batch-invariant attention taking turns.

    splitspec bench-forward exactness --prompts 200 --dtypes bfloat16,float32 --threads 1
    splitspec bench-forward exactness --prompts 24 --attention torch-exact --threads 2 --verify-threads 1
    splitspec bench-forward cost --reps 15 --prompt-tokens 128,2000
"""
from __future__ import annotations

import time

from .harness import columns, csv_items, entry, header, log, median, metadata

STEPS = ("decode x1", "verify-8 x1", "decode x8")


# (default, help), each parsed as its default's type; "exactness:" and "cost:" flags serve that check alone.
FLAGS = {
    "--dtypes": ("bfloat16", "comma-separated"),
    "--threads": (2, "intra-op threads"),
    "--prompts": (200, "exactness: HumanEval's 164 first, then chat prompts"),
    "--new-tokens": (64, "exactness: tokens generated per prompt"),
    "--max-prompt-tokens": (0, "exactness: keep each prompt's last N tokens (0: whole prompts)"),
    "--width": (8, "exactness: verify width (root + drafted tokens)"),
    "--attention": ("torch,torch-exact", "exactness: attention paths, comma-separated"),
    "--verify-threads": (0, "exactness: the speculative side's threads (0: --threads)"),
    "--reps": (30, "cost: timed repetitions of each step"),
    "--prompt-tokens": ("128,2000", "cost: context lengths"),
    "--out": ("bench-out/forward", "folder for results.json and results.md"),
}


def add_flags(a) -> None:
    a("check", choices=["exactness", "cost"])
    a("--model-path", default=None, help="target model (default: SmolLM2-135M-Instruct's GGUF)")
    for flag, (default, what) in FLAGS.items():
        a(flag, type=type(default), default=default, help=what)


def mismatch(model, ids: list[int], a, attention: str) -> bool:
    import torch

    from splitspec.engine.tree import Tree
    from target_service.engine import TargetSequence
    max_len = len(ids) + a.new_tokens + a.width + 2
    torch.set_num_threads(a.threads)
    ref = TargetSequence(model, ids, max_len=max_len, attention=attention)
    greedy = [ref.prefill().committed[0]]
    while len(greedy) < a.new_tokens:
        greedy.append(ref.decode().committed[0])
    torch.set_num_threads(a.verify_threads or a.threads)
    spec = TargetSequence(model, ids, max_len=max_len, attention=attention)
    got = [spec.prefill().committed[0]]
    while len(got) < a.new_tokens and got == greedy[:len(got)]:
        got += spec.verify(Tree.chain(greedy[len(got):len(got) + a.width - 1])).committed
    torch.set_num_threads(a.threads)
    return got[:a.new_tokens] != greedy[:len(got[:a.new_tokens])]


def _tail(ids: list[int], n: int) -> list[int]:
    return ids[-n:] if n else ids


def exactness(model, path, a, dtype: str) -> list[dict]:
    from splitspec_tools.bench.prompts import chat_prompts, humaneval_prompts
    from target_service.engine import load_tokenizer
    tok, ps = load_tokenizer(path), humaneval_prompts(path, a.prompts)
    ps += chat_prompts(path, a.prompts - len(ps)) if len(ps) < a.prompts else []
    rows = []
    for attention in csv_items(a.attention):
        t0 = time.perf_counter()
        bad = [p.id for p in ps if mismatch(model, _tail(tok.encode(p.text).ids, a.max_prompt_tokens), a, attention)]
        rows.append({"dtype": dtype, "attention": attention, "prompts": len(ps), "mismatches": len(bad),
                     "share": len(bad) / len(ps), "seconds": time.perf_counter() - t0, "mismatching": bad})
        log(f"{dtype} {attention}: {len(bad)}/{len(ps)} prompts mismatch; first {bad[:5]}")
    return rows


def cost(model, a, dtype: str) -> list[dict]:
    import torch

    from splitspec.engine.tree import Tree
    from target_service.engine import TargetSequence
    from target_service.pools import make_pool
    from target_service.runner import Decode, Verify, run_batch
    from target_service.torch_verifier import TorchVerifier
    modes, rows = ("torch", "torch-exact"), []
    for plen in (int(x) for x in csv_items(a.prompt_tokens)):
        g = torch.Generator().manual_seed(plen)
        prompts = [torch.randint(100, 40000, (plen,), generator=g).tolist() for _ in range(8)]
        pool = make_pool(model, num_blocks=16 * (-(-(plen + 64) // 16)) + 16, block_size=16)
        seqs = {m: [TargetSequence(model, p, max_len=plen + 64, pool=pool, attention=m) for p in prompts] for m in modes}
        for s in (s for m in modes for s in seqs[m]):
            s.prefill()
        times = {(m, k): [] for m in modes for k in STEPS}
        for rep in range(a.reps):
            for m in modes[::-1] if rep % 2 else modes:
                one = seqs[m][0].seq
                for kind, steps in zip(STEPS, ([Decode(one)], [Verify(one, Tree.chain([5] * 7))],
                                               [Decode(s.seq) for s in seqs[m]])):
                    saved = [(len(s.seq.tokens), s.seq.table.length) for s in seqs[m]]
                    t0 = time.perf_counter()
                    run_batch(model, pool, TorchVerifier(), steps, m)
                    times[(m, kind)].append((time.perf_counter() - t0) * 1e3)
                    # Roll back what the step appended, so every repetition sees the same lengths.
                    for s, (ntok, length) in zip(seqs[m], saved):
                        del s.seq.tokens[ntok:]
                        s.seq.table.length = length
        for kind in STEPS:
            plain, exact = (median(times[(m, kind)]) for m in modes)
            rows.append({"dtype": dtype, "prompt_tokens": plen, "step": kind, "plain_ms": plain, "invariant_ms": exact,
                         "ratio": exact / plain})
            log(f"{plen} tokens, {kind}: plain {plain:.2f} ms, batch-invariant {exact:.2f} ms")
    return rows


def bench(a, argv: list[str]) -> dict:
    import torch
    threads = torch.get_num_threads()
    try:
        return _bench(a, argv)
    finally:
        torch.set_num_threads(threads)      # in process (the tests) the caller's threads are its own


def _bench(a, argv: list[str]) -> dict:
    import torch

    from splitspec.models.loader import model_folder
    from splitspec_tools.defaults import real_target
    from target_service.engine import load_model
    torch.set_num_threads(a.threads)
    meta, path = metadata("splitspec bench-forward", argv), model_folder(a.model_path or real_target())
    rows = []
    for dtype in csv_items(a.dtypes):
        model = load_model(path, dtype=dtype)
        rows += exactness(model, path, a, dtype) if a.check == "exactness" else cost(model, a, dtype)
    setting = (f"{a.new_tokens} tokens a prompt, verify width {a.width}; threads {a.threads} (verifies: "
               f"{a.verify_threads or a.threads})" if a.check == "exactness" else
               f"threads {a.threads}; medians of {a.reps} repetitions, the attention paths taking turns")
    return {"meta": meta, "check": a.check, "setting": f"model `{path}`; {setting}", "rows": rows}


COLUMNS = {"exactness": [("dtype", "dtype", "{}"), ("attention", "attention", "{}"),
                         ("mismatching prompts", lambda x: f"{x['mismatches']}/{x['prompts']} ({x['share']:.1%})"),
                         ("s", "seconds", "{:.0f}"), ("first", lambda x: ", ".join(x["mismatching"][:5]) or "–")],
           "cost": [("dtype", "dtype", "{}"), ("prompt tokens", "prompt_tokens", "{}"), ("step", "step", "{}"),
                    ("plain ms", "plain_ms"), ("batch-invariant ms", "invariant_ms"), ("ratio", "ratio", "{:.3f}")]}


def markdown(r: dict) -> str:
    lines = header(f"splitspec bench-forward {r['check']}", r["meta"], r["setting"])
    return "\n".join(lines + columns(COLUMNS[r["check"]], r["rows"])) + "\n"


main, cli_main = entry("splitspec bench-forward", __doc__, add_flags, bench, markdown)
