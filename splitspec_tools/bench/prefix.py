"""`splitspec bench-prefix`: the target's prefix cache on and off, side by side, through the real
services (issue 40, item 7): a target with its prefix cache and one with `--disable-radix-cache`
(`--replicas 2`: also two cache-on targets behind `prefix` and `round_robin` routing), a draft
service and gateways. Every workload (shared, multiturn, probe, unique) runs with every method, the
cache on and off in turn; reported: TTFT, tok/s and τ, on ÷ off, and the hit rate against the
targets' counters and the ideal. See docs/benchmarks.md.

    splitspec bench-prefix                               # defaults, about 25 min on 2 cores
    splitspec bench-prefix --smoke                       # tiny sizes, well under a minute
    splitspec bench-prefix --methods none,dflash,auto --replicas 2 --workloads multiturn
"""
from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from splitspec.engine.prefix_cache import block_keys

from . import stack as stacks
from .client import Gateway, Sample, prometheus, sampling
from .harness import (apply_sizes, columns, csv_items, entry, fmt, header, log, median, metadata, mix_cell, paired,
                      percentile, ratio, step_mix, summary, tail, tau)
from .prompts import default_prompts, digest

WORKLOADS = ("shared", "multiturn", "probe", "unique")
METHODS = ("none", "dflash", "auto", "ngram")
# Sizes: (default, --smoke, what). None: follows another size (PrefixBench.__init__).
SIZES = {"groups": (8, 2, "shared: groups (system prompts)"), "questions": (8, 2, "shared: questions per group"),
         "system_tokens": (1536, 128, "shared: system prompt tokens"),
         "question_tokens": (64, 64, "question and user-message tokens"),
         "max_new_tokens": (64, 8, "new tokens a request (shared, multiturn, unique)"),
         "concurrency": (8, 2, "streams (shared, multiturn, unique)"),
         "conversations": (8, 2, "multiturn: conversations"), "turns": (4, 2, "multiturn: turns a conversation"),
         "context_tokens": (1024, 128, "multiturn: a conversation's first context"),
         "probe_pairs": (6, 1, "probe: (cached, fresh) pairs"), "probe_prefix_tokens": (None, None, "probe: prefix tokens"),
         "probe_new_tokens": (8, 4, "probe: new tokens"), "unique_prompts": (16, 4, "unique: prompts"),
         "unique_tokens": (None, None, "unique: tokens a prompt"), "repeats": (2, 1, "runs of every cell")}


def add_flags(a) -> None:
    a("--smoke", action="store_true", help="tiny sizes, one repeat: a quick end-to-end check (explicit sizes win)")
    a("--draft-model-path", default=None, help="DFlash draft folder (default: the bundled draft with the bundled "
      "target; 'none': the draft service runs ngram)")
    a("--methods", default="none,dflash", help=f"speculative methods, comma-separated, from {', '.join(METHODS)}")
    a("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    for name, (default, smoke, what) in SIZES.items():
        a(f"--{name.replace('_', '-')}", type=int, help=f"{what} [{default or 'follows'}; smoke {smoke or 'follows'}]")
    a("--replicas", type=int, default=1, choices=[1, 2], help="2: multiturn also through two cache-on targets "
      "behind one gateway (prefix and round_robin routing)")
    a("--temperature", type=float, default=0.0, help="0: greedy, and outputs must not depend on the cache")
    a("--kv-block-size", type=int, default=16, help="the targets' --kv-block-size (the prefix cache's block)")
    a("--kv-cache-budget-mb", type=int, default=2048, help="every target's (a cache-on pool fills to it)")
    a("--prefix-cache-hidden-mb", type=int, default=None, help="the cache-on targets' (default: their own)")
    stacks.add_flags(a, request_timeout_s=900.0, out="bench-out/prefix")


@dataclass
class Result:
    key: str                 # the request's name in its workload ("g3q1", "c2t0", "fresh4", ...)
    prompt: list[int]
    sample: Sample           # its Usage: prompt_tokens, cached_tokens
    ideal_cached: int = 0    # what an unbounded cache could have served (set after the run)


def send(runner: Gateway, key: str, prompt: list[int], max_new: int, params) -> Result:
    return Result(key, list(prompt), runner.run(prompt, max_new, params))


class TokenText:
    """Disjoint pieces of the held-out text, in exact token counts; no two pieces start with the
    same block, so no two share a cached prefix unless a workload makes them."""

    def __init__(self, stream: list[int], block: int):
        self.stream, self.block, self.pos, self.firsts = stream, block, 0, set()

    def take(self, n: int) -> list[int]:
        while self.pos + n <= len(self.stream):
            piece = self.stream[self.pos:self.pos + n]
            self.pos += n
            first = tuple(piece[:self.block])
            if first not in self.firsts:
                self.firsts.add(first)
                return piece
        raise RuntimeError("held-out text exhausted")


@dataclass
class Variant:
    name: str                # "on", "off", "on x2 prefix", "on x2 round_robin"
    cache: bool
    replicas: int
    routing: str | None
    gateway: str = ""
    metrics: list[str] = field(default_factory=list)     # the targets' /metrics URLs


class PrefixBench:
    def __init__(self, a, argv):
        self.args, self.argv, self.skipped = a, argv, []
        apply_sizes(a, SIZES)
        a.probe_prefix_tokens = a.probe_prefix_tokens or a.system_tokens
        a.unique_tokens = a.unique_tokens or a.system_tokens + a.question_tokens
        for name in SIZES:
            if getattr(a, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
        self.target_path, self.draft_path = stacks.models(a.target_model_path, a.draft_model_path)
        self.workloads, self.methods = csv_items(a.workloads), csv_items(a.methods)
        bad = set(self.workloads) - set(WORKLOADS) or set(self.methods) - set(METHODS)
        if bad or not self.workloads or not self.methods:
            raise SystemExit(f"--workloads from {', '.join(WORKLOADS)}; --methods from {', '.join(METHODS)}")
        if self.draft_path is None:
            self.skipped += [f"{m}: no DFlash draft (--draft-model-path)" for m in self.methods if m in ("dflash", "auto")]
            self.methods = [m for m in self.methods if m not in ("dflash", "auto")]
        if not self.methods:
            raise SystemExit("no method left to run")
        self.variants = [Variant("on", True, 1, None), Variant("off", False, 1, None)]
        if a.replicas == 2:
            self.variants += [Variant(f"on x2 {policy}", True, 2, policy) for policy in ("prefix", "round_robin")]
        self.width = stacks.draft_width(self.draft_path, a.num_draft_tokens)
        self.nonce = uuid.uuid4().hex[:8]
        self.stack = stacks.Stack(a, self.target_path, self.width, Path(a.out) / "logs")

    def start_services(self) -> None:
        a, stack = self.args, self.stack
        common = ["--kv-block-size", str(a.kv_block_size), "--kv-cache-budget-mb", str(a.kv_cache_budget_mb)]
        hidden = [] if a.prefix_cache_hidden_mb is None else ["--prefix-cache-hidden-mb", str(a.prefix_cache_hidden_mb)]
        kinds = {"on": hidden, "off": ["--disable-radix-cache"], "on2": hidden}     # on2: with --replicas 2
        targets = {}
        for name in list(kinds)[:a.replicas + 1]:
            flags, url = stacks.metrics_port()
            targets[name] = (stack.target([*common, *kinds[name], *flags], name=f"target-{name}"), url)
        draft = stack.draft(self.draft_path)
        stack.wait(*(p for p, _ in targets.values()), draft)
        gateways = []
        for v in self.variants:
            names = ["on", "on2"] if v.replicas == 2 else ["on" if v.cache else "off"]
            gw = stack.gateway(",".join(targets[n][0].address for n in names), draft.address,
                               ["--routing-policy", v.routing] if v.routing else [],
                               name=f"gateway-{v.name.replace(' ', '-')}")
            gateways.append(gw)
            v.gateway, v.metrics = gw.address, [targets[n][1] for n in names]
        stack.wait(*gateways)
        self.services = (f"targets {', '.join(f'{n} {p.address}' for n, (p, _) in targets.items())}, draft "
                         f"{draft.address}, gateways " + ", ".join(f"{v.name} {v.gateway}" for v in self.variants))

    def prepare_text(self) -> None:
        """Every workload's token ids, fixed for the whole run."""
        a = self.args
        room = stacks.max_context(self.target_path) - self.width - 2
        longest = {"shared": a.system_tokens + a.question_tokens + a.max_new_tokens,
                   "multiturn": a.context_tokens + a.turns * (a.question_tokens + a.max_new_tokens),
                   "probe": a.probe_prefix_tokens + a.question_tokens + a.probe_new_tokens,
                   "unique": a.unique_tokens + a.max_new_tokens}
        for w in self.workloads:
            if longest[w] > room:
                raise SystemExit(f"{w}: sequences of {longest[w]} tokens exceed the target's context "
                                 f"({stacks.max_context(self.target_path)} - {self.width + 2}); lower its sizes")
        # Every workload's pieces are cut, run or not, so a workload's token ids do not depend on
        # --workloads; + the warm-up prompts.
        total = (a.groups * (a.system_tokens + a.questions * a.question_tokens)
                 + a.conversations * (a.context_tokens + a.turns * a.question_tokens)
                 + a.probe_pairs * (2 * a.probe_prefix_tokens + 3 * a.question_tokens)
                 + a.unique_prompts * a.unique_tokens + 2 * 256)
        tok = stacks.tokenizer(self.target_path)
        n = max(8, total // 600)
        while True:
            prompts = default_prompts(n, max_chars=6000)
            stream = [t for p in prompts for t in tok.encode(p.text).ids]
            if len(stream) >= 1.2 * total or len(prompts) < n:
                break
            n *= 2
        if len(stream) < total:
            raise SystemExit(f"the held-out text gives {len(stream)} tokens; these sizes need {total}")
        text = TokenText(stream, a.kv_block_size)
        self.warm_prompts = [text.take(256), text.take(256)]
        q = a.question_tokens
        self.shared = [(f"g{g}q{i}", system + text.take(q)) for g in range(a.groups)
                       for system in [text.take(a.system_tokens)] for i in range(a.questions)]
        self.contexts = [text.take(a.context_tokens) for _ in range(a.conversations)]
        self.messages = [[text.take(q) for _ in range(a.turns)] for _ in range(a.conversations)]
        self.pairs = [{"prime": prefix + text.take(q), "cached": prefix + text.take(q),
                       "fresh": text.take(a.probe_prefix_tokens) + text.take(q)}
                      for _ in range(a.probe_pairs) for prefix in [text.take(a.probe_prefix_tokens)]]
        self.unique = [(f"u{i}", text.take(a.unique_tokens)) for i in range(a.unique_prompts)]
        self.text_digest = digest([ids for _, ids in self.shared] + self.contexts + sum(self.messages, [])
                                  + [ids for pr in self.pairs for ids in pr.values()] + [ids for _, ids in self.unique])
        self.text_source = (f"{len(prompts)} function cuts from installed third-party packages (max 6000 chars "
                            f"each), {len(stream)} tokens, cut into disjoint pieces")

    def warm_up(self) -> None:
        """Each gateway and method once or twice on text no workload uses, salted apart."""
        for v in self.variants:
            for m in self.methods:
                salt = f"warmup-{uuid.uuid4().hex}"
                with closing(Gateway(v.gateway, m, self.width, timeout_s=self.args.timeout_s, salt=salt)) as runner:
                    for ids in self.warm_prompts:
                        runner.run(ids, 8, sampling(0.0, self.args.top_p, 0))

    def run_cell(self, workload: str, method: str, v: Variant, rep: int) -> dict:
        a = self.args
        # a cache_salt of the run's own: every run starts cold without a restart
        salt = f"bench-prefix-{self.nonce}-{workload}-{method}-{v.name}-r{rep}".replace(" ", "_")
        runner = Gateway(v.gateway, method, self.width, timeout_s=a.timeout_s, salt=salt)
        before = target_counters(v.metrics)
        t0 = time.perf_counter()
        with closing(runner):
            if workload in ("shared", "unique"):      # the prompts all at once, C streams
                results, extra = self._concurrent(runner, getattr(self, workload), a.max_new_tokens), {}
            else:
                results, extra = getattr(self, f"_{workload}")(runner, rep)
        wall = time.perf_counter() - t0
        (q0, h0), (q1, h1) = before, target_counters(v.metrics)
        set_ideal(results, a.kv_block_size)
        out = {"workload": workload, "method": method, "variant": v.name, "cache": v.cache, "replicas": v.replicas,
               "routing": v.routing, "repeat": rep, **run_stats(results, method, wall),
               "target_hit_rate": ratio(h1 - h0, q1 - q0), **extra,
               "outputs": {r.key: r.sample.tokens for r in results},
               "per_request": {r.key: [r.sample.cached_tokens, r.ideal_cached, r.sample.committed, r.sample.verify_steps]
                               for r in results}}
        log(f"{workload} {method} cache {v.name} rep {rep + 1}: TTFT p50 {fmt(out['ttft_ms_p50'], '{:.0f}')} ms, "
            f"{out['tokens_per_s']:.1f} tok/s, hit rate {out['hit_rate']:.3f} (ideal {out['ideal_hit_rate']:.3f}, "
            f"target {fmt(out['target_hit_rate'], '{:.3f}')}), τ {fmt(out['tau'])}")
        return out

    def _concurrent(self, runner: Gateway, jobs: list[tuple[str, list[int]]], max_new: int) -> list[Result]:
        params = sampling(self.args.temperature, self.args.top_p, self.args.seed)
        samples, _ = runner.batch([runner.request(ids, max_new, params) for _, ids in jobs], self.args.concurrency)
        return [Result(key, list(ids), s) for (key, ids), s in zip(jobs, samples)]

    def _multiturn(self, runner, rep):
        """Round robin over the conversations, turn by turn, a turn's prompt the transcript so far; the pool
        takes jobs in order, so a turn's predecessor was taken before it and waiting on it cannot deadlock."""
        a = self.args
        params = sampling(a.temperature, a.top_p, a.seed)
        answers: dict[tuple[int, int], list[int]] = {}
        done = {(k, t): threading.Event() for k in range(a.conversations) for t in range(a.turns)}

        def turn(kt):
            k, t = kt
            if t and (not done[(k, t - 1)].wait(a.timeout_s) or (k, t - 1) not in answers):
                raise RuntimeError(f"conversation {k} turn {t}: the previous turn failed")
            prompt = list(self.contexts[k])
            for j in range(t):
                prompt += self.messages[k][j] + answers[(k, j)]
            prompt += self.messages[k][t]
            try:
                r = send(runner, f"c{k}t{t}", prompt, a.max_new_tokens, params)
                answers[kt] = r.sample.tokens
                return r
            finally:
                done[kt].set()
        with ThreadPoolExecutor(a.concurrency) as pool:
            return list(pool.map(turn, [(k, t) for t in range(a.turns) for k in range(a.conversations)])), {}

    def _probe(self, runner, rep):
        """Per pair: the prime (caches the prefix), then the cached and the fresh request, in an
        order that alternates pair by pair (and repeat by repeat)."""
        a, results = self.args, []
        params = sampling(a.temperature, a.top_p, a.seed)
        for i, pair in enumerate(self.pairs):
            results.append(send(runner, f"prime{i}", pair["prime"], a.probe_new_tokens, params))
            order = ("cached", "fresh") if (i + rep) % 2 == 0 else ("fresh", "cached")
            results += [send(runner, f"{kind}{i}", pair[kind], a.probe_new_tokens, params) for kind in order]
        cached, fresh = ([r for r in results if r.key.startswith(kind)] for kind in ("cached", "fresh"))
        cached_ms, fresh_ms = [r.sample.ttft_s * 1e3 for r in cached], [r.sample.ttft_s * 1e3 for r in fresh]
        return results, {"probe_ttft_cached_ms": cached_ms, "probe_ttft_fresh_ms": fresh_ms,
                         "probe_ttft_cached_ms_p50": percentile(cached_ms, 50),
                         "probe_ttft_fresh_ms_p50": percentile(fresh_ms, 50),
                         "probe_ttft_ratio": percentile([c / f for c, f in zip(cached_ms, fresh_ms)], 50),
                         "probe_cached_hit_tokens": [r.sample.cached_tokens for r in cached]}

    def measure(self) -> list[dict]:
        runs = []
        for rep in range(self.args.repeats):
            for workload in self.workloads:
                variants = [v for v in self.variants if v.replicas == 1 or workload == "multiturn"]
                if rep % 2:     # on off ... then off on ...: a slow minute of a shared machine hits both
                    variants = variants[::-1]
                runs += [self.run_cell(workload, method, v, rep) for method in self.methods for v in variants]
        return runs

    def run(self) -> dict:
        a, t0, meta = self.args, time.perf_counter(), metadata("splitspec bench-prefix", self.argv)
        try:
            self.start_services()
            self.prepare_text()
            self.warm_up()
            log(f"workloads {', '.join(self.workloads)}; methods {', '.join(self.methods)}; variants "
                f"{', '.join(v.name for v in self.variants)}; {a.repeats} repeat(s)")
            runs = self.measure()
        finally:
            self.stack.stop()
        by: dict[tuple, list[dict]] = {}        # (workload, method, variant): its runs, in the order they ran
        for r in runs:
            by.setdefault((r["workload"], r["method"], r["variant"]), []).append(r)
        cells = summarize_cells(by)
        for r in runs:
            del r["outputs"]         # compared in the cells; the token ids would swell the JSON
        results = {
            "meta": meta,
            "run": {"duration_s": time.perf_counter() - t0, "target_model": str(self.target_path),
                    "draft_model": str(self.draft_path or "") or None, "services": self.services,
                    "workloads": self.workloads, "methods": self.methods, "variants": [v.name for v in self.variants],
                    "sizes": {name: getattr(a, name) for name in SIZES}, "smoke": a.smoke, "temperature": a.temperature,
                    "num_draft_tokens": self.width, "kv_block_size": a.kv_block_size,
                    "kv_cache_budget_mb": a.kv_cache_budget_mb, "prefix_cache_hidden_mb": a.prefix_cache_hidden_mb,
                    "text_source": self.text_source, "text_digest": self.text_digest, "seed": a.seed},
            "cells": cells, "ratios": ratios(cells, by), "replicas": replica_ratios(by) if a.replicas == 2 else [],
            "runs": runs, "skipped": self.skipped}
        results["flags"] = flags(results)
        return results


def target_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix_cache_queries, prefix_cache_hits) of the targets together, from their Prometheus exporters."""
    got = [prometheus(url, r"^splitspec:prefix_cache_(queries|hits)(?:_total)? (\S+)$") for url in urls]
    return sum(g.get("queries", 0.0) for g in got), sum(g.get("hits", 0.0) for g in got)


def set_ideal(results: list[Result], block: int) -> None:
    """Each request's ideal cached tokens: its leading prompt blocks (at most those before its last
    token, the target's hit limit) that a request sent before it had: that request's prompt, and
    its whole sequence (prompt + output less the last token, the one without K/V) if it had
    finished by then."""
    root = b"ideal"
    keys = {id(r): (block_keys(root, r.prompt, block), block_keys(root, r.prompt + r.sample.tokens[:-1], block))
            for r in results}
    order = sorted(results, key=lambda r: r.sample.start_s)
    for i, r in enumerate(order):
        seen = set()
        for o in order[:i]:
            prompt_keys, seq_keys = keys[id(o)]
            seen.update(seq_keys if o.sample.end_s <= r.sample.start_s else prompt_keys)
        prefix = keys[id(r)][0][:(len(r.prompt) - 1) // block]
        r.ideal_cached = block * next((n for n, k in enumerate(prefix) if k not in seen), len(prefix))


def run_stats(results: list[Result], method: str, wall: float) -> dict:
    """harness.summary of a run, tok/s over its wall time (its requests in flight together), and the cache's figures."""
    samples, hits = [r.sample for r in results], [r for r in results if r.sample.cached_tokens > 0]
    prompt, cached = sum(s.prompt_tokens for s in samples), sum(s.cached_tokens for s in samples)
    return {**summary(samples, method, wall), "requests_hit": len(hits), "requests_miss": len(results) - len(hits),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "ideal_hit_rate": sum(r.ideal_cached for r in results) / prompt if prompt else 0.0,
            "ttft_ms_p90": percentile([s.ttft_s * 1e3 for s in samples], 90)}


MEDIAN_FIELDS = ("ttft_ms_p50", "ttft_ms_p90", "tokens_per_s", "hit_rate", "ideal_hit_rate", "target_hit_rate",
                 "probe_ttft_cached_ms_p50", "probe_ttft_fresh_ms_p50", "probe_ttft_ratio")


def summarize_cells(by: dict) -> list[dict]:
    """One cell per (workload, method, variant): medians over the repeats, τ pooled over them; the
    τ of the requests that hit, and of the same requests in the cache-off run of the same repeat;
    outputs equal to that run's (at T=0 the cache must not change a token)."""
    cells = []
    for (w, m, v), mine in by.items():
        offs = {r["repeat"]: r for r in by.get((w, m, "off"), [])} if v != "off" else {}
        hit_on, hit_off, compared, mismatches = [], [], 0, []
        for r in mine:
            if (off := offs.get(r["repeat"])) is None:
                continue
            for key, (cached, _, c, n) in r["per_request"].items():
                if cached > 0 and key in off["per_request"]:
                    hit_on.append({"committed": c, "verify_steps": n})
                    hit_off.append(dict(zip(("committed", "verify_steps"), off["per_request"][key][2:])))
            compared += len(r["outputs"])
            mismatches += [[r["repeat"] + 1, k] for k, toks in r["outputs"].items() if off["outputs"].get(k) != toks]
        spec = m != "none"      # target-only: every step commits one token
        cells.append({
            "workload": w, "method": m, "variant": v, "cache": mine[0]["cache"], "replicas": mine[0]["replicas"],
            "routing": mine[0]["routing"], "repeats": len(mine), "requests": mine[0]["requests"],
            **{f: median([r.get(f) for r in mine]) for f in MEDIAN_FIELDS if any(f in r for r in mine)},
            **{f"{f}_runs": [r.get(f) for r in mine] for f in ("ttft_ms_p50", "tokens_per_s", "hit_rate")},
            "requests_hit": sum(r["requests_hit"] for r in mine), "requests_miss": sum(r["requests_miss"] for r in mine),
            **{f"tau{k}": tau([{"committed": c, "verify_steps": n} for r in mine for cached, _, c, n in
                                r["per_request"].values() if which(cached)]) if spec else None
               for k, which in (("", lambda n: True), ("_hit", lambda n: n > 0), ("_miss", lambda n: n == 0))},
            **{f"tau_hit_requests_{k}": tau(hits) if spec else None for k, hits in (("on", hit_on), ("off", hit_off))},
            "outputs_equal_to_off": [compared - len(mismatches), compared] if v != "off" else None,
            "output_mismatches": mismatches,      # [repeat, request] whose output differs from the cache-off run's
            "steps_by_method": step_mix(mine)})
    return cells


def _paired(by: dict, w: str, m: str, f: str, num: str = "on", den: str = "off") -> float | None:
    """The median over the repeats of field f's ratio, variant num ÷ variant den."""
    return paired(*({r["repeat"]: r.get(f) for r in by.get((w, m, v), [])} for v in (num, den)))


def ratios(cells: list[dict], by: dict) -> list[dict]:
    """Cache on ÷ off per (workload, method): the median of the repeats' paired ratios."""
    cell, out = {(c["workload"], c["method"], c["variant"]): c for c in cells}, []
    for w, m in dict.fromkeys((c["workload"], c["method"]) for c in cells):
        on, off = cell[(w, m, "on")], cell[(w, m, "off")]
        # probe: its TTFT percentiles pool primes, cached and fresh requests; the cached one's counts
        ttft = "probe_ttft_cached_ms_p50" if w == "probe" else "ttft_ms_p50"
        out.append({"workload": w, "method": m, "ttft_ms_p50_on_over_off": _paired(by, w, m, ttft),
                    "ttft_ms_p90_on_over_off": None if w == "probe" else _paired(by, w, m, "ttft_ms_p90"),
                    "tokens_per_s_on_over_off": _paired(by, w, m, "tokens_per_s"), "hit_rate_on": on["hit_rate"],
                    "tau_on": on["tau"], "tau_on_over_off": ratio(on["tau"], off["tau"])})
    return out


def replica_ratios(by: dict) -> list[dict]:
    """multiturn hit rate with two replicas ÷ with one, per method and routing policy."""
    hits = lambda m, v: median([r["hit_rate"] for r in by.get(("multiturn", m, v), [])])     # noqa: E731
    return [{"method": m, "variant": v, "hit_rate_1": hits(m, "on"), "hit_rate_2": hits(m, v),
             "ratio": _paired(by, "multiturn", m, "hit_rate", v, "on")}
            for m in dict.fromkeys(m for w, m, _ in by if w == "multiturn") for v in ("on x2 prefix", "on x2 round_robin")]


def flags(r: dict) -> list[str]:
    """What looks wrong, in words, for whoever reads the report."""
    out = []
    for c in r["cells"]:
        name = f"{c['workload']} / {c['method']} / cache {c['variant']}"
        if c["hit_rate"] and (not c["cache"] or c["workload"] == "unique"):
            out.append(f"{name}: hit rate {c['hit_rate']:.3f} where nothing can be reused")
        if c["cache"] and c["replicas"] == 1 and c["ideal_hit_rate"] and c["hit_rate"] < 0.9 * c["ideal_hit_rate"]:
            out.append(f"{name}: hit rate {c['hit_rate']:.3f} is below 90 % of the ideal {c['ideal_hit_rate']:.3f}")
        if c.get("target_hit_rate") is not None and abs(c["target_hit_rate"] - c["hit_rate"]) > 0.01:
            out.append(f"{name}: Usage says hit rate {c['hit_rate']:.3f}, the targets' counters {c['target_hit_rate']:.3f}")
        on, off = c.get("tau_hit_requests_on"), c.get("tau_hit_requests_off")
        if on and off and abs(on / off - 1) > 0.02:
            out.append(f"{name}: τ of the requests that hit is {on:.3f} with the cache on, {off:.3f} with it off")
        if c["output_mismatches"] and r["run"]["temperature"] == 0:
            out.append(f"{name}: {len(c['output_mismatches'])} greedy output(s) differ from the cache-off run's "
                       "(repeat, request): " + ", ".join(map(str, c["output_mismatches"][:12])))
    for row in r["ratios"]:
        if row["workload"] == "unique" and (row["tokens_per_s_on_over_off"] or 1) < 0.95:
            out.append(f"unique / {row['method']}: tok/s on ÷ off {row['tokens_per_s_on_over_off']:.2f}, with "
                       "nothing to reuse")
    for x in r["replicas"]:
        if x["variant"].endswith("prefix") and x["ratio"] is not None and x["ratio"] < 0.9:
            out.append(f"multiturn / {x['method']}: with prefix routing, 2 replicas keep {x['ratio']:.2f}x the hit "
                       "rate of 1")
    return out


def markdown(r: dict) -> str:
    run = r["run"]
    lines = header("splitspec bench-prefix", r["meta"],
                   f"target: `{run['target_model']}`; draft: `{run['draft_model'] or 'none (ngram)'}`; verify width "
                   f"{run['num_draft_tokens']}; KV block {run['kv_block_size']}; T={run['temperature']:g}, eos ignored",
                   f"services: {run['services']}", f"text: {run['text_source']} (digest {run['text_digest']})",
                   "sizes: " + ", ".join(f"{k} {v}" for k, v in run["sizes"].items()) + " (cache on/off order "
                   f"alternating per repeat); took {run['duration_s']:.0f} s") + ["## Cells", ""]
    pair = lambda a, b, f="{:.2f}": lambda c: f"{fmt(c.get(a), f)} / {fmt(c.get(b), f)}"     # noqa: E731
    lines += columns([
        ("workload", "workload", "{}"), ("method", "method", "{}"), ("cache", "variant", "{}"),
        ("TTFT p50 / p90 ms", pair("ttft_ms_p50", "ttft_ms_p90", "{:.0f}")), ("tok/s", "tokens_per_s", "{:.1f}"),
        ("hit rate (ideal, targets' counters)", lambda c: " (".join(fmt(c.get(k), "{:.3f}") for k in (
            "hit_rate", "ideal_hit_rate")) + f", {fmt(c.get('target_hit_rate'), '{:.3f}')})"),
        ("τ (hit / miss)", lambda c: f"{fmt(c['tau'])} ({pair('tau_hit', 'tau_miss')(c)})"),
        ("τ hit reqs on / off", pair("tau_hit_requests_on", "tau_hit_requests_off")),
        ("requests hit/miss", lambda c: f"{c['requests_hit']}/{c['requests_miss']}"),
        ("steps", lambda c: mix_cell(c["steps_by_method"])),
        ("= off outputs", lambda c: "/".join(map(str, c["outputs_equal_to_off"] or [])) or "–")], r["cells"])
    lines += ["", "## Cache on ÷ off", "", *columns([
        ("workload", "workload", "{}"), ("method", "method", "{}"), ("TTFT p50 on/off", "ttft_ms_p50_on_over_off"),
        ("TTFT p90 on/off", "ttft_ms_p90_on_over_off"), ("tok/s on/off", "tokens_per_s_on_over_off"),
        ("τ on/off", "tau_on_over_off", "{:.3f}"), ("hit rate on", "hit_rate_on", "{:.3f}")], r["ratios"])]
    if probe := [c for c in r["cells"] if c["workload"] == "probe"]:
        lines += ["", "## TTFT probe: prefix sent once before vs a fresh prefix of the same length", "", *columns([
            ("method", "method", "{}"), ("cache", "variant", "{}"),
            ("TTFT cached p50 ms", "probe_ttft_cached_ms_p50", "{:.0f}"),
            ("TTFT fresh p50 ms", "probe_ttft_fresh_ms_p50", "{:.0f}"),
            ("median ratio cached/fresh", "probe_ttft_ratio", "{:.3f}")], probe)]
    if r["replicas"]:
        lines += ["", "## multiturn: two cache-on replicas behind one gateway", "", *columns([
            ("method", "method", "{}"), ("gateway", "variant", "{}"), ("hit rate, 1 replica", "hit_rate_1", "{:.3f}"),
            ("hit rate, 2 replicas", "hit_rate_2", "{:.3f}"), ("2 ÷ 1", "ratio", "{:.3f}")], r["replicas"])]
    lines += [""] + tail(r["flags"], r["skipped"], (
        "TTFT (client-side) and tok/s (output tokens ÷ the run's wall time) are medians over the repeats; hit "
        "rate = Σ cached ÷ Σ prompt tokens (Usage), ideal = the prompt blocks an unbounded cache could have "
        "served given what was sent before, targets' counters = Δ prefix_cache_hits ÷ Δ queries; τ = committed "
        "tokens per verify step pooled over the repeats (all requests, those with cached tokens, those without); "
        "τ hit reqs on / off = the requests that hit, and the same requests with the cache off; = off outputs: "
        "outputs equal to the cache-off run's, token for token; on/off = medians of the repeats' paired ratios "
        "(probe: the cached request's TTFT)."))
    return "\n".join(lines)


main, cli_main = entry("splitspec bench-prefix", __doc__, add_flags, lambda *a: PrefixBench(*a).run(), markdown)
