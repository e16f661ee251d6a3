"""`splitspec bench-forward`: the target's forward in process, no services (docs/speculation.md,
"Exact at bf16"). `exactness`: per prompt, target-only greedy decoding, then the same prompt
verified in chains whose drafts are that continuation (a perfect drafter: every verify row is
compared); a prompt mismatches when a committed token differs. `quality`: mean NLL and top-1
agreement with the float32 dequantized model, beside llama.cpp's on the same file. `cost`: forward ms of a decode,
verifies of each width and decodes of 8 and 16 sessions, for each weights mode of a GGUF target
(packed, dequantized), plain and batch-invariant attention taking turns. `profile`: where a
batch-invariant decode step's time goes (matmuls, attention, the other operators, Python) beside
the bound the weights' bytes and this machine's measured read bandwidth set.

    splitspec bench-forward exactness --prompts 200 --dtypes bfloat16,float32 --threads 1
    splitspec bench-forward exactness --prompts 24 --attention torch-exact --threads 2 --verify-threads 1
    splitspec bench-forward cost --reps 15 --prompt-tokens 128,2000 --weights packed,dequantized
    splitspec bench-forward profile --weights packed,dequantized --prompt-tokens 128
    splitspec bench-forward quality --dtypes bfloat16,float32 --weights packed,dequantized
"""
from __future__ import annotations

import time

from .harness import columns, csv_items, entry, header, log, median, metadata



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
    "--reps": (30, "cost / profile: timed repetitions of each step"),
    "--prompt-tokens": ("128,2000", "cost / profile: context lengths"),
    "--weights": ("packed", "cost / profile: a GGUF target's weights modes, comma-separated (packed, dequantized)"),
    "--widths": ("2,4,8,16", "cost: verify widths (root + drafted tokens)"),
    "--prompt-tokens-quality": (1024, "quality: tokens of held-out text scored"),
    "--streams": ("8,16", "cost / profile: decode batch sizes besides one"),
    "--out": ("bench-out/forward", "folder for results.json and results.md"),
}


def add_flags(a) -> None:
    a("check", choices=["exactness", "cost", "profile", "quality"])
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


class Steps:
    """Sessions of `plen` random tokens prefilled on a pool of their own, per attention mode, and
    the steps to time on them; `run` times one step and rolls back what it appended, so every
    repetition sees the same lengths."""

    def __init__(self, model, plen: int, sessions: int, modes):
        import torch

        from target_service.engine import TargetSequence
        from target_service.pools import make_pool
        g = torch.Generator().manual_seed(plen)
        prompts = [torch.randint(100, 40000, (plen,), generator=g).tolist() for _ in range(sessions)]
        self.model = model
        self.pool = make_pool(model, num_blocks=len(modes) * sessions * (-(-(plen + 64) // 16)) + 16, block_size=16)
        self.seqs = {m: [TargetSequence(model, p, max_len=plen + 64, pool=self.pool, attention=m) for p in prompts]
                     for m in modes}
        for s in (s for m in modes for s in self.seqs[m]):
            s.prefill()

    def kinds(self, a) -> dict:
        """step name -> (lambda mode: the runner's steps)."""
        from splitspec.engine.tree import Tree
        from target_service.runner import Decode, Verify
        out = {"decode x1": lambda m: [Decode(self.seqs[m][0].seq)]}
        for w in (int(x) for x in csv_items(a.widths)):
            out[f"verify-{w} x1"] = lambda m, w=w: [Verify(self.seqs[m][0].seq, Tree.chain([5] * (w - 1)))]
        for n in (int(x) for x in csv_items(a.streams)):
            out[f"decode x{n}"] = lambda m, n=n: [Decode(s.seq) for s in self.seqs[m][:n]]
        return out

    def run(self, mode: str, steps) -> float:
        from target_service.runner import run_batch
        from target_service.torch_verifier import TorchVerifier
        saved = [(len(s.seq.tokens), s.seq.table.length) for s in self.seqs[mode]]
        t0 = time.perf_counter()
        run_batch(self.model, self.pool, TorchVerifier(), steps, mode)
        ms = (time.perf_counter() - t0) * 1e3
        for s, (ntok, length) in zip(self.seqs[mode], saved):
            del s.seq.tokens[ntok:]
            s.seq.table.length = length
        return ms


def sessions(a) -> int:
    return max([1] + [int(x) for x in csv_items(a.streams)])


def cost(model, a, dtype: str, weights: str) -> list[dict]:
    modes, rows = ("torch", "torch-exact"), []
    for plen in (int(x) for x in csv_items(a.prompt_tokens)):
        steps = Steps(model, plen, sessions(a), modes)
        kinds = steps.kinds(a)
        times = {(m, k): [] for m in modes for k in kinds}
        for rep in range(a.reps):
            for m in modes[::-1] if rep % 2 else modes:
                for kind, make in kinds.items():
                    times[(m, kind)].append(steps.run(m, make(m)))
        decode = {m: median(times[(m, "decode x1")]) for m in modes}
        for kind in kinds:
            plain, exact = (median(times[(m, kind)]) for m in modes)
            rows.append({"dtype": dtype, "weights": weights, "prompt_tokens": plen, "step": kind, "plain_ms": plain,
                         "invariant_ms": exact, "ratio": exact / plain, "decodes": exact / decode["torch-exact"]})
            log(f"{weights} {plen} tokens, {kind}: plain {plain:.2f} ms, batch-invariant {exact:.2f} ms "
                f"({exact / decode['torch-exact']:.2f} decodes)")
    return rows


MATMULS = ("_weight_int4pack_mm", "_weight_int8pack_mm", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul",
           "aten::bmm")
ATTENTION = ("scaled_dot_product_attention", "exact_attention")


def _category(name: str) -> str:
    if any(m in name for m in MATMULS):
        return "matmul"
    return "attention" if any(m in name for m in ATTENTION) else "other ops"


def read_bandwidth_gbs(threads: int) -> float:
    """This machine's read bandwidth now, GB/s: the median of summing a 512 MB tensor."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(128 * 1024 * 1024)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        runs.append(x.nbytes / (time.perf_counter() - t0) / 1e9)
    return median(runs)


def streamed_bytes(model) -> int:
    """Bytes of weights a decode reads: every parameter and buffer but the embedding table (a
    lookup reads one row of it), the head counted once when tied."""
    embed = model.model.embed_tokens
    skip = {id(t) for t in list(embed.parameters()) + list(embed.buffers())}
    head = getattr(model.lm_head, "weight", None)
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or (id(t) in skip and t is not head):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def profile(model, a, dtype: str, weights: str) -> list[dict]:
    """Decode steps (one session, and each --streams) under torch's profiler: the top-level
    operators' time by category; Python is the wall time no operator accounts for."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    rows, bound_ms = [], streamed_bytes(model) / (a.bandwidth_gbs * 1e9) * 1e3
    for plen in (int(x) for x in csv_items(a.prompt_tokens)):
        steps = Steps(model, plen, sessions(a), ("torch-exact",))
        kinds = {k: v for k, v in steps.kinds(a).items() if k.startswith("decode")}
        for kind, make in kinds.items():
            for _ in range(3):
                steps.run("torch-exact", make("torch-exact"))
            walls = []
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(a.reps):
                    walls.append(steps.run("torch-exact", make("torch-exact")))
            by = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
            for ev in prof.events():
                if ev.cpu_parent is None:
                    by[_category(ev.name)] += ev.cpu_time_total / 1e3 / a.reps
            wall = sum(walls) / len(walls)
            row = {"dtype": dtype, "weights": weights, "prompt_tokens": plen, "step": kind, "wall_ms": wall,
                   **{f"{k}_ms": v for k, v in by.items()}, "python_ms": max(0.0, wall - sum(by.values())),
                   "bound_ms": bound_ms, "mb_streamed": streamed_bytes(model) / 1e6}
            rows.append(row)
            log(f"{weights} {plen} tokens, {kind}: {wall:.2f} ms = matmul {by['matmul']:.2f} + attention "
                f"{by['attention']:.2f} + other ops {by['other ops']:.2f} + Python {row['python_ms']:.2f}; "
                f"weights bound {bound_ms:.2f} ms")
    return rows


def quality_text(tokenizer, tokens: int) -> list[int]:
    """Held-out text the target never saw as such: the standard library's `json` and `textwrap`
    sources (the draft's training data, not the bench's prompts), cut to `tokens`."""
    import inspect
    import json
    import textwrap
    return tokenizer.encode(inspect.getsource(json.decoder) + inspect.getsource(textwrap)).ids[:tokens]


def _scores(logits, ids, ref=None) -> dict:
    import torch
    lp = torch.log_softmax(logits[:-1].float(), -1)
    out = {"nll": -lp.gather(-1, torch.tensor(ids[1:])[:, None]).mean().item()}
    if ref is not None:
        out["top1_agreement"] = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return out


def quality(path, a) -> list[dict]:
    """Mean NLL on held-out text and top-1 agreement with the float32 dequantized model, for each
    dtype, weights mode and head format, and for llama.cpp's own logits on the same file (the
    reference implementation of its quant types) where llama-cpp-python is installed."""
    import torch

    from target_service.engine import forward_sequences, load_model, load_tokenizer
    ids = quality_text(load_tokenizer(path), a.prompt_tokens_quality)
    ref = forward_sequences(load_model(path, dtype="float32", gguf_weights="dequantized"), torch.tensor([ids])).logits[0]
    rows = [{"engine": "splitspec", "dtype": "float32", "weights": "dequantized", "head": "–", **_scores(ref, ids, ref)}]
    for dtype in csv_items(a.dtypes):
        for weights in csv_items(a.weights):
            for head in ("int8", "int4") if weights == "packed" else ("–",):
                model = load_model(path, dtype=dtype, gguf_weights=weights, gguf_head=head if head != "–" else "int8")
                got = forward_sequences(model, torch.tensor([ids])).logits[0]
                rows.append({"engine": "splitspec", "dtype": dtype, "weights": weights, "head": head, **_scores(got, ids, ref)})
                del model
    try:
        from llama_cpp import Llama
    except ImportError:
        log("llama-cpp-python is not installed: no llama.cpp row")
    else:
        from splitspec.models.gguf import source_of
        llm = Llama(model_path=str(source_of(path) or path), n_ctx=len(ids) + 8, n_batch=512, logits_all=True,
                    n_threads=a.threads, verbose=False)
        llm.eval(ids)
        got = torch.from_numpy(llm.scores[:len(ids)].copy())
        rows.append({"engine": "llama.cpp", "dtype": "native", "weights": "its own", "head": "its own",
                     **_scores(got, ids, ref)})
        llm.close()
    for r in rows:
        r["nll_vs_reference"] = r["nll"] / rows[0]["nll"]
        log(f"{r['engine']} {r['dtype']} {r['weights']} head {r['head']}: NLL {r['nll']:.4f} "
            f"({r['nll_vs_reference']:.4f}x), top-1 agreement {r['top1_agreement']:.4f}")
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
    if a.check == "quality":
        rows = quality(path, a)
        return {"meta": meta, "check": a.check, "rows": rows, "setting": f"model `{path}`; {a.prompt_tokens_quality} "
                f"tokens of the standard library's json.decoder and textwrap sources, one forward"}
    if a.check == "profile":
        a.bandwidth_gbs = read_bandwidth_gbs(a.threads)
        log(f"read bandwidth {a.bandwidth_gbs:.1f} GB/s ({a.threads} threads)")
    # A --weights item may name its own dtype ("packed:float32,dequantized:bfloat16": each weights
    # mode at the dtype `--dtype auto` serves it); plain items run at every --dtypes.
    items = csv_items(a.weights)[:1] if a.check == "exactness" else csv_items(a.weights)
    runs = [(dt, w) for w in items if ":" not in w for dt in csv_items(a.dtypes)]
    runs += [(w.split(":")[1], w.split(":")[0]) for w in items if ":" in w]
    for dtype, weights in runs:
        model = load_model(path, dtype=dtype, gguf_weights=weights)
        check = {"exactness": lambda: exactness(model, path, a, dtype), "cost": lambda: cost(model, a, dtype, weights),
                 "profile": lambda: profile(model, a, dtype, weights)}[a.check]
        rows += check()
        del model
    setting = {"exactness": f"{a.new_tokens} tokens a prompt, verify width {a.width}; threads {a.threads} (verifies: "
                            f"{a.verify_threads or a.threads}); weights {csv_items(a.weights)[0]}",
               "cost": f"threads {a.threads}; medians of {a.reps} repetitions, the attention paths taking turns",
               "profile": f"threads {a.threads}; means of {a.reps} profiled steps; read bandwidth "
                          f"{getattr(a, 'bandwidth_gbs', 0):.1f} GB/s, measured in this run"}[a.check]
    return {"meta": meta, "check": a.check, "setting": f"model `{path}`; {setting}", "rows": rows}


COLUMNS = {"exactness": [("dtype", "dtype", "{}"), ("attention", "attention", "{}"),
                         ("mismatching prompts", lambda x: f"{x['mismatches']}/{x['prompts']} ({x['share']:.1%})"),
                         ("s", "seconds", "{:.0f}"), ("first", lambda x: ", ".join(x["mismatching"][:5]) or "–")],
           "cost": [("dtype", "dtype", "{}"), ("weights", "weights", "{}"), ("prompt tokens", "prompt_tokens", "{}"),
                    ("step", "step", "{}"), ("plain ms", "plain_ms"), ("batch-invariant ms", "invariant_ms"),
                    ("ratio", "ratio", "{:.3f}"), ("÷ decode (invariant)", "decodes")],
           "quality": [("engine", "engine", "{}"), ("dtype", "dtype", "{}"), ("weights", "weights", "{}"),
                       ("head", "head", "{}"), ("mean NLL", "nll", "{:.4f}"), ("÷ reference", "nll_vs_reference", "{:.4f}"),
                       ("top-1 agreement", "top1_agreement", "{:.4f}")],
           "profile": [("dtype", "dtype", "{}"), ("weights", "weights", "{}"), ("prompt tokens", "prompt_tokens", "{}"),
                       ("step", "step", "{}"), ("wall ms", "wall_ms"), ("matmul", "matmul_ms"),
                       ("attention", "attention_ms"), ("other ops", "other ops_ms"), ("Python", "python_ms"),
                       ("weights bound ms", "bound_ms"), ("MB streamed", "mb_streamed", "{:.0f}")]}


def markdown(r: dict) -> str:
    lines = header(f"splitspec bench-forward {r['check']}", r["meta"], r["setting"])
    return "\n".join(lines + columns(COLUMNS[r["check"]], r["rows"])) + "\n"


main, cli_main = entry("splitspec bench-forward", __doc__, add_flags, bench, markdown)
