"""What the OpenAI surface of issue 28 costs, through the HTTP front with the official client:

* log-probs: one stream with speculation, tokens/s with `logprobs` (top-N alternatives) against
  without, interleaved run by run so drift on a shared machine hits both alike;
* n: one request with `n = 4` against 4 separate requests sent at once, and 4 sent one after
  another, interleaved the same way (total completion tokens / wall time).

    python -m splitspec_tools.bench.openai_surface                        # starts target + draft + gateway
    python -m splitspec_tools.bench.openai_surface --url http://127.0.0.1:8000/v1   # an already running gateway

Prints one JSON object (medians and every run); docs/benchmarks.md has the numbers."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def quicksort(items):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "def parse_csv(path):\n    rows = []\n", "import json\n\ndef load_config(path):\n"]


@contextlib.contextmanager
def stack(args):
    """A target + draft + gateway on loopback (the bundled models by default)."""
    from splitspec_tools.ops.launch import free_port, start_service
    logs = Path(tempfile.mkdtemp(prefix="splitspec-surface-"))
    threads = ["--torch-threads", str(args.torch_threads)] if args.torch_threads else []
    port = free_port()
    procs = []
    try:
        target = start_service("target", ["--model-path", args.target, *threads], log_dir=logs)
        procs.append(target)
        draft = start_service("draft", ["--model-path", args.draft, "--target-model-path", args.target, *threads],
                              log_dir=logs)
        procs.append(draft)
        for p in (target, draft):
            p.wait_healthy(600)
        gw = start_service("gateway", ["--target", target.address, "--draft", draft.address,
                                       "--http-port", str(port)], log_dir=logs)
        procs.append(gw)
        gw.wait_healthy(600)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for p in reversed(procs):
            p.stop()


def tok_s(fn) -> float:
    t = time.perf_counter()
    tokens = fn()
    return tokens / (time.perf_counter() - t)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running gateway's /v1 base URL (default: start one)")
    ap.add_argument("--target", default=str(ROOT / "models" / "splitspec-code-target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "splitspec-code-draft"))
    ap.add_argument("--torch-threads", type=int, default=0)
    ap.add_argument("--method", default="dflash", help="speculative.method of every request")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top-logprobs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repeats of each variant")
    ap.add_argument("--parts", default="logprobs,n", help="which measures: logprobs, n or both")
    args = ap.parse_args(argv)
    with (contextlib.nullcontext(args.url) if args.url else stack(args)) as url:
        print(json.dumps(run(url, args), indent=1))


def run(url: str, args) -> dict:
    import openai
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    extra = {"speculative": {"method": args.method}, "ignore_eos": True}

    def one(prompt, *, n=1, logprobs=None, seed=None, temperature=0.0) -> int:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, n=n, logprobs=logprobs,
                                      temperature=temperature, seed=seed, extra_body=extra)
        return r.usage.completion_tokens

    one(PROMPTS[0])                                                # warm-up: first forwards, caches
    parts = set(args.parts.split(","))
    out = {"method": args.method, "max_tokens": args.max_tokens, "rounds": args.rounds}
    if "logprobs" in parts:
        out["one_stream_tok_s"] = logprobs_overhead(one, args)
    if "n" in parts:
        out["n4_tok_s"] = n_against_separate(one, args)
    return out


def med(values) -> float:
    return statistics.median(list(values))


def logprobs_overhead(one, args) -> dict:
    plain, with_lp = [], []
    for r in range(args.rounds):
        prompt = PROMPTS[r % len(PROMPTS)]
        order = [(plain, None), (with_lp, args.top_logprobs)]
        for runs, lp in (order if r % 2 == 0 else order[::-1]):
            runs.append(tok_s(lambda: one(prompt, logprobs=lp)))
    ratios = [b / a for a, b in zip(plain, with_lp)]
    return {"plain": med(plain), f"logprobs_{args.top_logprobs}": med(with_lp),
            "overhead_pct": round(100 * (1 - med(with_lp) / med(plain)), 2),
            # Each round's pair ran back to back: their ratio cancels most of the drift a shared
            # machine adds, which the medians of each side keep.
            "paired_overhead_pct": round(100 * (1 - med(ratios)), 2),
            "paired_geomean_overhead_pct": round(100 * (1 - math.exp(statistics.fmean(map(math.log, ratios)))), 2),
            "runs_plain": plain, "runs_logprobs": with_lp}


def n_against_separate(one, args) -> dict:
    n4, separate, sequential = [], [], []
    pool = ThreadPoolExecutor(4)
    for r in range(args.rounds):
        prompt = PROMPTS[r % len(PROMPTS)]
        variants = [(n4, lambda: one(prompt, n=4, temperature=1.0, seed=r)),
                    (separate, lambda: sum(pool.map(lambda i: one(prompt, temperature=1.0, seed=1000 * r + i),
                                                    range(4)))),
                    (sequential, lambda: sum(one(prompt, temperature=1.0, seed=2000 * r + i) for i in range(4)))]
        for runs, fn in variants[r % 3:] + variants[:r % 3]:
            runs.append(tok_s(fn))
    pool.shutdown()
    return {"n=4": med(n4), "4 separate at once": med(separate), "4 one after another": med(sequential),
            "paired_n4_over_separate": round(med(a / b for a, b in zip(n4, separate)), 3),
            "paired_n4_over_sequential": round(med(a / b for a, b in zip(n4, sequential)), 3),
            "runs_n4": n4, "runs_separate": separate, "runs_sequential": sequential}


if __name__ == "__main__":
    main()
