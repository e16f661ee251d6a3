"""`splitspec bench-auto`: the default method (`auto`) against target-only, cell by cell (T × streams × new
tokens × short or long prompts), and the per-step prices that decide whether drafting pays (issue 42). A
cell's repeats send the same requests with `none` and with `auto`, the order alternating; "auto ×" is the
median of the paired tok/s ratios. Services: `--launch up` (`splitspec up`), `hand` (bare), `up,hand` or
`--gateway ADDR`. More in docs/benchmarks.md.

    splitspec bench-auto                                   # full grid with `splitspec up`, ~40 min on 2 cores
    splitspec bench-auto --launch up,hand --repeats 3
    splitspec bench-auto --smoke                           # one tiny cell and one load, ~1 min
"""
from __future__ import annotations

import math
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import stack as stacks
from .client import Gateway, Sample, request, sampling, tok_s
from .harness import alternate, columns, csv_items, entry, fmt, header, log, median, metadata, mix_cell, step_mix, tau
from .prompts import default_prompts, digest

TOP_P = 0.95
SHORT_MAX = 255
# Price configurations: (label, method, topk, verify width); topk 1 = a chain.
PRICE_CONFIGS = (("none", "none", 1, 0), ("ngram", "ngram", 1, 8), ("dflash", "dflash", 1, 8),
                 ("dflash tree 16", "dflash", 4, 16), ("dflash tree 32", "dflash", 4, 32))


def add_flags(a) -> None:
    a("--launch", default="up", help="how the services start: up, hand, or both (up,hand); ignored with --gateway")
    a("--gateway", default=None, help="measure a running gateway instead of starting services")
    a("--model-path", default=None, help="target model folder (default: the bundled target)")
    a("--draft-model-path", default=None, help="draft model folder (default: the bundled draft)")
    a("--temperatures", default="0,1", help=f"temperatures of the grid (T > 0 runs with top_p {TOP_P})")
    a("--streams", default="1,8,16", help="requests in flight")
    a("--max-new-tokens", default="64,512", help="new tokens per request")
    a("--prompt-kinds", default="short,long", help="short (< 256 tokens) and/or long (~--long-tokens)")
    a("--long-tokens", type=int, default=2000, help="tokens of a long prompt (capped by the context)")
    a("--min-requests", default="64:8,512:2", help="NEW:N: at least N requests a run at that generation length")
    a("--repeats", type=int, default=2, help="paired runs per cell (none and auto, order alternating)")
    a("--min-run-s", type=float, default=8.0, help="a cell's runs last this long at least (whole waves, at most "
      "8x the requests); 0: --min-requests alone")
    a("--price-streams", default="1,8,16", help="loads of the price table ('' to skip it)")
    a("--price-new-tokens", type=int, default=64, help="new tokens of the price table's requests")
    a("--price-repeats", type=int, default=2, help="runs per price configuration and load (medians)")
    a("--seed", type=int, default=0, help="request i of repeat r uses seed + 1000 r + i at T > 0")
    a("--out", default="bench-auto", help="folder for results.json, results.md and the services' logs")
    a("--timeout-s", type=float, default=900.0, help="deadline per request")
    a("--startup-timeout-s", type=float, default=600.0)
    a("--smoke", action="store_true", help="one small cell per temperature and one load: a quick end-to-end check")


def make_prompts(tokenizer, args) -> dict[str, list[list[int]]]:
    """short: held-out cuts of 16 to 255 tokens; long: cuts of at least --long-tokens, kept to their
    last --long-tokens (the request then continues the function body)."""
    encoded = lambda n, chars: [tokenizer.encode(p.text).ids for p in default_prompts(n, max_chars=chars)]  # noqa: E731
    return {"short": [ids for ids in encoded(64, 700) if 16 <= len(ids) <= SHORT_MAX],
            "long": [ids[-args.long_tokens:] for ids in encoded(96, 12000) if len(ids) >= args.long_tokens]}


def fit(prompt: list[int], max_new: int, max_context: int, width: int = 8) -> list[int]:
    """The prompt's tail that leaves room for the generation (and a verify past its end)."""
    room = max_context - max_new - width - 1
    return prompt[-room:] if len(prompt) > room else prompt


@dataclass(frozen=True)
class Cell:
    temperature: float
    streams: int
    max_new: int
    kind: str

    @property
    def label(self) -> str:
        t = "0" if self.temperature == 0 else f"{self.temperature:g} / top_p {TOP_P}"
        return f"T={t}, {self.streams} streams, {self.max_new} tokens, {self.kind} prompts"


def drafter_tau(results: list[Sample], method: str) -> float | None:
    """Committed tokens per verify of the given drafter's steps (the accepted drafts + 1)."""
    steps = [s for r in results for s in r.stats.steps if s.method == method]
    return (sum(s.accepted for s in steps) / len(steps) + 1.0) if steps else None


MAX_SIZE_UP = 8          # --min-run-s scales a cell's requests up this many times at most


def requests_for(n: int, streams: int, wall_s: float, min_run_s: float) -> int:
    """Requests per run for a cell whose run of n requests took wall_s: enough whole waves of
    `streams` that a run lasts min_run_s (at most MAX_SIZE_UP x n). On this host one wave of 16
    short requests lasts ~1.7 s, and the same requests run twice read 0.76-1.21x of each other
    (docs/benchmarks.md, the A/A runs); a longer run averages the host's swings out."""
    if min_run_s <= 0 or wall_s >= min_run_s or n <= 0:
        return n
    want = min(n * min_run_s / max(wall_s, 1e-3), MAX_SIZE_UP * n)      # > n: the run was short
    return math.ceil(want / streams) * streams


def size_cell(gw: Gateway, cell: Cell, prompts: list[list[int]], n: int, min_run_s: float,
              seed: int) -> tuple[int, float]:
    """(requests per run, the timing run's seconds): one run of `none` with n requests, timed and
    not counted (it also warms the cell's shapes up)."""
    if min_run_s <= 0:
        return n, 0.0
    _, wall = gw.batch(cell_requests(cell, prompts, "none", n, seed + 10 ** 6), cell.streams)
    return requests_for(n, cell.streams, wall, min_run_s), wall


def cell_requests(cell: Cell, prompts: list[list[int]], method: str, n: int, seed: int) -> list:
    """n requests of the cell, request i on prompt i (cycling) with seed + i, one fresh cache salt
    for them all (each run starts cold)."""
    salt = uuid.uuid4().hex
    return [request(prompts[i % len(prompts)], cell.max_new, sampling(cell.temperature, TOP_P, seed + i),
                    method=method, salt=salt) for i in range(n)]


def run_cell(gw: Gateway, cell: Cell, prompts: list[list[int]], n_requests: int, repeats: int, seed: int) -> dict:
    got = alternate(("none", "auto"), repeats, lambda method, rep: gw.batch(
        cell_requests(cell, prompts, method, n_requests, seed + 1000 * rep), cell.streams))
    rates = {m: [tok_s(*run) for run in runs] for m, runs in got.items()}
    ratios = [a / b for a, b in zip(rates["auto"], rates["none"])]
    none_all, auto_all = ([r for res, _ in got[m] for r in res] for m in ("none", "auto"))
    return {"temperature": cell.temperature, "streams": cell.streams, "max_new_tokens": cell.max_new,
            "prompts": cell.kind, "requests": n_requests, "repeats": repeats,
            "prompt_tokens_mean": round(statistics.mean(len(prompts[i % len(prompts)]) for i in range(n_requests)), 1),
            "none_tok_s": median(rates["none"]), "auto_tok_s": median(rates["auto"]), "ratio": median(ratios),
            "ratios": [round(x, 3) for x in ratios], "ttft_ms_none": 1e3 * median([r.ttft_s for r in none_all]),
            "ttft_ms_auto": 1e3 * median([r.ttft_s for r in auto_all]), "auto_steps": step_mix(auto_all),
            "auto_dflash_tau": drafter_tau(auto_all, "dflash"), "auto_ngram_tau": drafter_tau(auto_all, "ngram"),
            "greedy_mismatches": sum(a.tokens != b.tokens for a, b in zip(auto_all, none_all))
            if cell.temperature == 0 else None}


def grid(a) -> list[Cell]:
    return [Cell(float(t), int(s), int(n), k) for t in csv_items(a.temperatures) for k in csv_items(a.prompt_kinds)
            for n in csv_items(a.max_new_tokens) for s in csv_items(a.streams)]


def min_requests(spec: str) -> dict[int, int]:
    """"64:8,512:2" -> {64: 8, 512: 2}"""
    return {int(new): int(n) for new, _, n in (part.partition(":") for part in csv_items(spec))}


def step_prices(results: list[Sample]) -> dict:
    """Per step, medians over the requests: a step's time (after the first token), a Propose
    round trip, a Verify round trip, the wire's share of them, and τ pooled."""
    n = lambda r: r.verify_steps or max(1, len(r.tokens) - 1)       # target-only: a step is a token
    steps = sum(n(r) for r in results)
    per = lambda k: sum(getattr(r, k) for r in results) / steps
    return {"step_ms": median([1e3 * (r.wall_s - r.ttft_s) / n(r) for r in results]), "propose_ms": per("draft_ms"),
            "verify_ms": per("verify_ms"), "wire_ms": per("wire_ms"), "queue_ms": per("queue_ms"),
            "tau": tau(results) or 1.0, "steps": steps}


def run_prices(gw: Gateway, prompts: list[list[int]], args, depth: int) -> list[dict]:
    """depth: the deepest branch the draft makes (its block size - 1): trees are that deep at most."""
    rows = []
    for load in [int(x) for x in csv_items(args.price_streams)]:
        def price(config, rep):
            _, method, topk, width = config
            salt = uuid.uuid4().hex
            res, wall = gw.batch([request(prompts[i % len(prompts)], args.price_new_tokens, sampling(0, TOP_P, 0),
                                          method=method, width=width, tree=(topk, width), depth=depth, salt=salt)
                                  for i in range(max(load, 4))], load)
            return {**step_prices(res), "tok_s": tok_s(res, wall)}
        got = alternate(PRICE_CONFIGS, args.price_repeats, price)
        med = {c: {k: median([x[k] for x in xs]) for k in xs[0]} for c, xs in got.items()}
        none = med[PRICE_CONFIGS[0]]
        rows += [{"streams": load, "config": label, "width": width, **m, "tok_s_vs_none": m["tok_s"] / none["tok_s"],
                  **({"break_even_tau": m["step_ms"] / none["step_ms"]} if method != "none" else {})}
                 for (label, method, _, width), m in med.items()]
        log(f"prices at {load} streams: " + ", ".join(f"{r['config']} {fmt(r['step_ms'], '{:.1f}')} ms"
                                                      for r in rows[-len(PRICE_CONFIGS):]))
    return rows


def markdown(res: dict) -> str:
    out = header("splitspec bench-auto", res["meta"], f"took {res['took_s']:.0f} s",
                 f"prompts: short {res['prompts']['short']}, long {res['prompts']['long']}")
    for run in res["runs"]:
        out += [f"## Services: {run['services']}", "", f"`{run['description']}`", ""]
        same = lambda c: "–" if c["greedy_mismatches"] is None else (      # noqa: E731
            f"{c['requests'] * c['repeats'] - c['greedy_mismatches']}/{c['requests'] * c['repeats']}")
        out += columns([("T", "temperature", "{:g}"), ("streams", "streams", "{}"), ("new", "max_new_tokens", "{}"),
                        ("prompts (tokens)", lambda c: f"{c['prompts']} ({c['prompt_tokens_mean']:.0f})"),
                        ("requests", "requests", "{}"), ("none tok/s", "none_tok_s", "{:.1f}"),
                        ("auto tok/s", "auto_tok_s", "{:.1f}"),
                        ("auto ×", lambda c: f"**{fmt(c['ratio'])}**" if c["ratio"] < 0.95 else fmt(c["ratio"])),
                        ("per repeat", lambda c: " ".join(f"{x:.2f}" for x in c["ratios"])),
                        ("auto steps", lambda c: mix_cell(c["auto_steps"])), ("τ dflash", "auto_dflash_tau"),
                        ("τ ngram", "auto_ngram_tau"), ("= none", same)], run["cells"])
        if ratios := [c["ratio"] for c in run["cells"]]:
            out += ["", f"auto × none: min {min(ratios):.2f}, median {median(ratios):.2f}; "
                        f"{sum(r >= 0.95 for r in ratios)}/{len(ratios)} cells ≥ 0.95, "
                        f"{sum(r >= 1.0 for r in ratios)}/{len(ratios)} ≥ 1.0", ""]
        if prices := run.get("prices"):
            dash = lambda k: lambda r: fmt(r[k]) if r["config"] != "none" else "–"      # noqa: E731
            out += ["### Prices per step (T=0, short prompts)", ""] + columns(
                [("streams", "streams", "{}"), ("step", "config", "{}"), ("ms a step", "step_ms"),
                 ("Propose ms", dash("propose_ms")), ("Verify ms", dash("verify_ms")), ("wire ms", "wire_ms"),
                 ("queue ms", "queue_ms"), ("τ", "tau"), ("break-even τ", "break_even_tau"),
                 ("tok/s × none", "tok_s_vs_none")], prices)
            out += ["", "ms a step: a request's time after its first token ÷ its steps (median over requests; for "
                    "none a step is one token); Propose / Verify / wire / queue: the gateway's per-request totals ÷ "
                    "steps; break-even τ = ms a step ÷ none's ms a step at the same load: the drafter pays where "
                    "its τ is above it.", ""]
    out += ["auto × = median over repeats of (auto tok/s ÷ none tok/s), each pair run back to back in "
            "alternating order on the same gateway; requests = per run (sized by --min-run-s); auto steps = "
            "its steps by what ran; τ dflash / ngram = committed tokens per verify of auto's steps by that "
            "drafter; = none: greedy auto outputs equal to none's."]
    return "\n".join(out) + "\n"


SMOKE = dict(temperatures="0,1", streams="2", max_new_tokens="16", prompt_kinds="short,long", long_tokens=400,
             repeats=1, price_streams="2", price_new_tokens=16, price_repeats=1, min_requests="16:2", min_run_s=0.0)


def bench(args, argv: list[str]) -> dict:
    if args.smoke:
        vars(args).update(SMOKE)
    from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir
    meta, t0 = metadata("splitspec bench-auto", argv), time.perf_counter()
    model, draft = model_dir(args.model_path, DEFAULT_TARGET), model_dir(args.draft_model_path, DEFAULT_DRAFT)
    launches = ["running"] if args.gateway else csv_items(args.launch)
    if set(launches) - {"up", "hand", "running"}:
        raise SystemExit("--launch: up, hand or up,hand")
    prompts, needed, runs = make_prompts(stacks.tokenizer(model), args), min_requests(args.min_requests), []
    for i, how in enumerate(launches):
        stack, gateway, target, description = (
            (None, args.gateway, None, f"gateway {args.gateway}") if how == "running" else
            (stacks.up if how == "up" else stacks.hand)(args, model, draft, Path(args.out) / "logs" / how))
        gw = Gateway(gateway, timeout_s=args.timeout_s)
        try:
            log(f"{how}: gateway {gateway}, target {target}")
            info = gw.info()
            gw.send(request(prompts["short"][0], 8, sampling(0, TOP_P, 0), method="auto"))     # warm-up
            run = {"services": how, "description": description, "gateway": gateway, "cells": []}
            if i == 0 and csv_items(args.price_streams):
                run["prices"] = run_prices(gw, prompts["short"], args, max(1, info.num_draft_tokens - 1))
            for cell in grid(args):
                ps = [fit(p, cell.max_new, info.max_context) for p in prompts[cell.kind]]
                n, sized_s = size_cell(gw, cell, ps, max(cell.streams, needed.get(cell.max_new, 1)), args.min_run_s,
                                       args.seed)
                row = {**run_cell(gw, cell, ps, n, args.repeats, args.seed), "sizing_run_s": round(sized_s, 2)}
                run["cells"].append(row)
                log(f"{how}: {cell.label}: auto × none {row['ratio']:.2f} ({row['ratios']}), "
                    f"steps {row['auto_steps']}")
            runs.append(run)
        finally:
            gw.close()
            if stack is not None:
                stack.stop()
    return {"meta": meta, "took_s": time.perf_counter() - t0,
            "prompts": {k: f"{len(v)} ({digest(v)})" for k, v in prompts.items()}, "runs": runs}


main, cli_main = entry("splitspec bench-auto", __doc__, add_flags, bench, markdown)
