"""`splitspec bench`: the speculative methods side by side through the real services on the same
held-out prompts, taking turns per prompt; then a concurrency sweep; the target's own step prices give
each configuration's ideal speed-up. Writes results.json, results.md and PNG plots (docs/benchmarks.md).

    splitspec bench                                   # default models, default prompts, everything
    splitspec bench --configs target,ngram-grpc --num-prompts 10 --temperatures 0 --concurrency ''
    splitspec bench --gateway 127.0.0.1:50050 --target 127.0.0.1:50051   # running services
    splitspec bench --prompts humaneval --configs target,ngram-grpc,auto-grpc,transformers,llamacpp   # + other engines
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from . import stack as stacks
from .client import Gateway, counters, mean_batch, sampling, step_prices, target_info
from .harness import (alternate, columns, csv_items, entry, fmt, header, interleave, log, median, metadata, mix_cell,
                      percentile, ratio, request_flags, settings, summary, table)
from .baselines import BASELINES, make, unavailable
from .prompts import load_prompts

# key: (method, tree?): every configuration is a Generate request through the gateway.
CONFIGS = {"target": ("none", False), "dflash-grpc": ("dflash", False), "ngram-grpc": ("ngram", False),
           "auto-grpc": ("auto", False), "dflash-tree-grpc": ("dflash", True), "auto-tree-grpc": ("auto", True)}
DRAFT_SAMPLING = ("dflash-grpc", "auto-grpc", "dflash-tree-grpc", "auto-tree-grpc")   # greedy or sampled at T > 0


def add_flags(a) -> None:
    a("--draft-model-path", default=None, help="DFlash draft (default: the bundled one with the bundled target; "
      "'none': the draft service runs ngram)")
    a("--gateway", default=None, help="a running gateway (host:port) instead of starting services")
    a("--target", default=None, help="a running target (its step prices; without --gateway the bench starts a "
      "gateway in front of --target / --draft)")
    a("--draft", default=None, help="a running draft service")
    a("--configs", default=",".join(CONFIGS), help=f"from {','.join((*CONFIGS, *BASELINES))} (target, the "
      "baseline, always runs; transformers and llamacpp: other engines on the same weights, one stream)")
    request_flags(a)
    a("--tree", default="4:16", help="TOPK:WIDTH of the tree configurations")
    a("--concurrency", default="1,4,16,64", help="stream counts of the sweep ('' to skip it)")
    a("--sweep-configs", default="target,dflash-grpc,ngram-grpc,auto-grpc")
    a("--sweep-temperatures", default=None, help="default: the first of --temperatures; drafts greedy")
    a("--sweep-requests", type=int, default=8, help="requests per sweep point: max(this, streams)")
    a("--sweep-repeats", type=int, default=1, help="runs of each point, the configurations taking turns")
    a("--step-time-prompts", type=int, default=3, help="prompts for the target's step prices (0: skip)")
    a("--no-plots", action="store_true")
    stacks.add_flags(a, out="bench-out")


class Bench:
    def __init__(self, args):
        self.args, self.skipped, self.runners, self.baselines = args, [], [], {}
        self.target_path, self.draft_path = stacks.models(args.target_model_path, args.draft_model_path,
                                                          required=not (args.gateway or args.target))
        self.width = stacks.draft_width(self.draft_path, args.num_draft_tokens)
        self.tree = tuple(int(x) for x in args.tree.split(":"))
        self.temperatures, self.modes = settings(args)
        wanted, known = csv_items(args.configs), (*CONFIGS, *BASELINES)
        if set(wanted) - set(known):
            raise SystemExit(f"--configs: unknown {sorted(set(wanted) - set(known))}; choose from {', '.join(known)}")
        self.configs = [k for k in known if k in wanted or k == "target"]
        self.stack = stacks.Stack(args, self.target_path, self.width, Path(args.out) / "logs")

    def start(self) -> None:
        a = self.args
        self.target, self.draft = a.target, a.draft
        if a.gateway:
            self.gateway, self.services = a.gateway, f"running gateway {a.gateway}"
        else:
            if not a.target:
                t, d = self.stack.target(), self.stack.draft(self.draft_path)
                log(f"starting target {t.address} and draft {d.address}")
                self.stack.wait(t, d)
                self.target, self.draft = t.address, d.address
            gw = self.stack.gateway(self.target, self.draft)
            self.stack.wait(gw)
            self.gateway = gw.address
            self.services = "target, draft and gateway started by the bench" if not a.target else \
                f"target {a.target}, draft {a.draft}, gateway started by the bench"
        info = (gw := Gateway(self.gateway)).info()
        gw.close()
        self.max_context = info.max_context or 4096
        if not info.draft_model_id:
            self.skip([k for k in self.configs if k != "target"], f"the gateway at {self.gateway} has no draft service")
        elif self.draft_path is None and not (a.gateway or a.draft):
            self.skip([k for k in self.configs if method_of(k) == "dflash"], "no DFlash draft (--draft-model-path)")
        for k in [k for k in self.configs if k in BASELINES]:
            if why := unavailable(k, self.target_path):
                self.skip([k], why)

    def skip(self, keys, why: str) -> None:
        for k in keys:
            self.configs.remove(k)
            self.skipped.append(f"{k}: {why}")

    def prompts(self) -> None:
        a, tokenizer = self.args, None
        if self.target_path is None:
            from tokenizers import Tokenizer
            if not self.target:
                raise SystemExit("with --gateway and no --target-model-path, pass --target (for its tokenizer)")
            tokenizer = Tokenizer.from_str(target_info(self.target).tokenizer_json.decode())
        self.prompt_ids, self.prompt_names, self.prompt_source = load_prompts(
            a.prompts, a.num_prompts, self.target_path, max_chars=a.max_prompt_chars, tokenizer=tokenizer,
            max_tokens=max(1, min(a.max_prompt_tokens, self.max_context - a.max_new_tokens - self.width - 2)))
        if others := [k for k in self.configs if k in BASELINES]:
            import torch
            n_ctx = max(map(len, self.prompt_ids)) + a.max_new_tokens + 8
            for k in others:
                self.baselines[k] = make(k, self.target_path, torch.get_num_threads(), n_ctx)
                self.runners.append(self.baselines[k])

    def runner(self, key: str, mode: str = "greedy") -> Gateway:
        method, tree = CONFIGS[key]
        self.runners.append(Gateway(self.gateway, method, self.width, mode, self.args.timeout_s,
                                    tree=self.tree if tree else None))
        return self.runners[-1]

    def runs(self, temperature: float) -> list[tuple[str, str, str | None, Gateway]]:
        """(name, config, draft sampling, runner) for one temperature, in interleaving order."""
        out = []
        for key in self.configs:
            for mode in (self.modes if key in DRAFT_SAMPLING and temperature > 0 else [None]):
                name = f"{key}:{'sampled' if mode == 'sample' else 'greedy'}-drafts" if mode else key
                runner = self.baselines[key] if key in BASELINES else self.runner(key, mode or "greedy")
                out.append((name, key, mode, runner))
        return out

    def step_prices(self) -> dict | None:
        n = self.args.step_time_prompts
        if self.target and n > 0:
            return step_prices(self.target, self.prompt_ids[:n], list(range(2, self.width + 1)))
        self.skipped.append("step prices: no --target address" if n > 0 else "step prices: --step-time-prompts 0")

    def measure(self, prices: dict | None) -> tuple[list[dict], dict]:
        a, entries, reference = self.args, [], {}
        for t in self.temperatures:
            runs = self.runs(t)
            for _, _, _, runner in runs:          # warm-up, not timed
                for ids in self.prompt_ids[:a.warmup]:
                    runner.run(ids, min(16, a.max_new_tokens), sampling(t, a.top_p, 1))
            def progress(rep, i, out):
                log(f"T={t:g} rep {rep + 1}/{a.repeats} prompt {i + 1}/{len(self.prompt_ids)}: tok/s " +
                    ", ".join(f"{r[0]} {len(s[-1].tokens) / s[-1].wall_s:.0f}" for r, s in zip(runs, out)))
            samples = interleave([r[3] for r in runs], self.prompt_ids, a.repeats,
                                 lambda runner, ids, params: runner.run(ids, a.max_new_tokens, params),
                                 t, a.top_p, a.seed, progress, rotate=True)
            if t == 0:
                reference = {i % len(self.prompt_ids): s.tokens for i, s in enumerate(samples[0])}
            entries += [summarize(name, key, mode, t, mine, samples[0], prices, self.prompt_names)
                        for (name, key, mode, _), mine in zip(runs, samples)]
        return entries, reference

    def sweep(self, reference: dict) -> list[dict]:
        """Each (streams, T) point runs every configuration back to back, --sweep-repeats times in turn:
        a point's tok/s is the median of its runs, × target the median of the paired ratios."""
        a, out = self.args, []
        keys = [k for k in csv_items(a.sweep_configs) if k in self.configs and k in CONFIGS]
        temps = [float(t) for t in csv_items(a.sweep_temperatures)] if a.sweep_temperatures else self.temperatures[:1]
        for t in temps:
            for streams in (int(x) for x in csv_items(a.concurrency)):
                runs = alternate(keys, a.sweep_repeats, lambda k, _: self.point(k, streams, t, reference))
                rates = {k: [p["tokens_per_s"] for p in ps] for k, ps in runs.items()}
                for k in keys:
                    point = dict(runs[k][len(runs[k]) // 2], tokens_per_s_runs=rates[k], tokens_per_s=median(rates[k]))
                    if "target" in runs:
                        point["speedup_vs_target"] = median([x / b for x, b in zip(rates[k], rates["target"])])
                    out.append(point)
        one = {(p["config"], p["temperature"]): p["tokens_per_s"] for p in out if p["streams"] == 1}
        for p in out:
            p["speedup_vs_1_stream"] = ratio(p["tokens_per_s"], one.get((p["config"], p["temperature"])))
        return out

    def point(self, key: str, streams: int, t: float, reference: dict) -> dict:
        a, runner = self.args, self.runner(key)
        jobs = [(j % len(self.prompt_ids), a.seed + 500_000 + j) for j in range(max(streams, a.sweep_requests))]
        before = counters(self.target, "target"), counters(self.draft, "draft")
        samples, wall = runner.batch([runner.request(self.prompt_ids[i], a.max_new_tokens, sampling(t, a.top_p, seed))
                                      for i, seed in jobs], streams)
        after = counters(self.target, "target"), counters(self.draft, "draft")
        e2e, ttft = [s.wall_s * 1e3 for s in samples], [s.ttft_s * 1e3 for s in samples]
        point = {"name": key, "config": key, "streams": streams, "temperature": t, "max_new_tokens": a.max_new_tokens,
                 **summary(samples, runner.method, wall), "latency_ms_p50": percentile(e2e, 50),
                 "latency_ms_p99": percentile(e2e, 99), "ttft_ms_p99": percentile(ttft, 99),
                 "target_batch_mean": mean_batch(before[0], after[0]),
                 "draft_batch_mean": mean_batch(before[1], after[1]), "speedup_vs_target": None,
                 "greedy_matches": sum(reference.get(i) == s.tokens for (i, _), s in zip(jobs, samples))
                 if t == 0 and reference else None}
        log(f"{streams} streams T={t:g} {key}: {point['tokens_per_s']:.1f} tok/s, target batch "
            f"{fmt(point['target_batch_mean'])}")
        return point

    def run(self, meta: dict) -> dict:
        a, t0 = self.args, time.perf_counter()
        try:
            self.start()
            self.prompts()
            log(f"{len(self.prompt_ids)} prompts, configurations {', '.join(self.configs)}")
            prices = self.step_prices()
            entries, reference = self.measure(prices)
            concurrency = self.sweep(reference)
        finally:
            for r in self.runners:
                r.close()
            self.stack.stop()
        return {"meta": meta, "run": {
            "duration_s": time.perf_counter() - t0, "target_model": str(self.target_path or a.target),
            "draft_model": str(self.draft_path) if self.draft_path else None, "services": self.services,
            "prompt_source": self.prompt_source, "prompt_ids": self.prompt_names, "num_prompts": len(self.prompt_ids),
            "prompt_tokens_mean": statistics.mean(map(len, self.prompt_ids)), "max_new_tokens": a.max_new_tokens,
            "repeats": a.repeats, "num_draft_tokens": self.width, "configs": self.configs},
            "step_prices_ms": {str(w): v for w, v in prices.items()} if prices else None,
            "temperatures": self.temperatures, "configs": entries, "concurrency": concurrency, "skipped": self.skipped}


def summarize(name: str, key: str, mode: str | None, t: float, samples: list, base: list, prices: dict | None,
              names: list[str]) -> dict:
    """One configuration at one temperature; `base[i]` is target-only's request on samples[i]'s prompt and seed."""
    e = {"name": name, "config": key, "temperature": t, "draft_sampling": mode, **summary(samples, method_of(key))}
    steps = e["verify_steps"]
    ms = {k: sum(getattr(s, f"{k}_ms") for s in samples) for k in ("draft", "verify", "wire", "queue")}
    ms["total"] = e["wall_s"] * 1e3
    e.update(method=method_of(key), speedup=e["tokens_per_s"] / summary(base)["tokens_per_s"], ideal_speedup=None,
             efficiency=None, per_step_ms={k: v / steps for k, v in ms.items()} if steps else None)
    if prices and steps and key in CONFIGS and key != "target":
        # The physical limit: τ × t(decode) ÷ t(verify at this configuration's mean verify width).
        width = 1 + sum(s.draft_tokens for s in samples) / steps
        e["ideal_speedup"] = e["tau"] * prices[1] / interpolate(prices, width)
        e["efficiency"] = e["speedup"] / e["ideal_speedup"]
    e["greedy_mismatches"] = ([names[i % len(names)] for i, (s, b) in enumerate(zip(samples, base))
                               if s.tokens != b.tokens] if t == 0 else None)
    e["greedy_matches"] = len(samples) - len(e["greedy_mismatches"]) if t == 0 else None
    return e


def method_of(key: str) -> str:
    return CONFIGS[key][0] if key in CONFIGS else "none"


def interpolate(table_: dict, x: float) -> float:
    """Piecewise-linear value of {width: ms} at x, clamped to the measured widths."""
    xs = sorted(table_)
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return table_[a] + (table_[b] - table_[a]) * max(0.0, x - a) / (b - a)
    return table_[xs[-1]]


STEPS = ("steps", lambda e: mix_cell(e["steps_by_method"]))
MATCHES = ("= target", lambda e: "–" if e["greedy_matches"] is None else f"{e['greedy_matches']}/{e['requests']}")


def markdown(r: dict) -> str:
    run, prices = r["run"], r.get("step_prices_ms")
    lines = header("splitspec bench", r["meta"],
                   f"target: `{run['target_model']}`; draft: `{run['draft_model'] or 'none'}`; {run['services']}",
                   f"prompts: {run['num_prompts']} ({run['prompt_source']}, {run['prompt_tokens_mean']:.0f} tokens "
                   f"on average); {run['max_new_tokens']} new tokens each (eos ignored); repeats {run['repeats']}; "
                   f"verify width {run['num_draft_tokens']}; configurations interleaved per prompt; took "
                   f"{run['duration_s']:.0f} s")
    if prices:
        lines += ["Step prices (the target's forward_ms, median, by verify width w; w=1 is a decode step): " +
                  ", ".join(f"w={w}: {ms:.2f}" for w, ms in prices.items()), ""]
    step = lambda e, *ks: " / ".join(fmt((e["per_step_ms"] or {}).get(k), "{:.1f}") for k in ks)  # noqa: E731
    for t in r["temperatures"]:
        entries = [e for e in r["configs"] if e["temperature"] == t]
        lines += [f"## temperature {t:g}" + (" (greedy)" if t == 0 else ""), ""]
        lines += columns([("configuration", "name", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"), ("speedup", "speedup"),
                          ("τ", "tau"), ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"), ("ITL p50 ms", "itl_ms_p50"),
                          ("step ms", lambda e: step(e, "total")),
                          ("draft / verify / wire / queue ms", lambda e: step(e, "draft", "verify", "wire", "queue")),
                          ("ideal", "ideal_speedup"), ("efficiency", "efficiency"), STEPS, MATCHES], entries)
        if spec := [e for e in entries if e["per_position_acceptance"]]:
            depth = max(len(e["per_position_acceptance"]) for e in spec)
            lines += ["", "Share of verify steps whose draft at depth k was accepted:", ""]
            lines += table(["configuration", *map(str, range(1, depth + 1))],
                           [[e["name"], *(fmt(x, "{:.3f}") for x in e["per_position_acceptance"])] for e in spec])
        lines += [f"- **{e['name']}: {n} {what}**" for e in entries for what, n in (
            ("output(s) differ from target-only's", len(e["greedy_mismatches"] or [])),
            ("request(s) ran another method than asked", e["method_mismatches"]),
            ("draft fallback(s)", e["draft_fallbacks"])) if n] + [""]
    if r["concurrency"]:
        lines += ["## Concurrency", ""]
        pair = lambda a, b, f="{:.0f}": lambda c: f"{fmt(c[a], f)} / {fmt(c[b], f)}"  # noqa: E731
        lines += columns([("streams", "streams", "{}"), ("configuration", "name", "{}"), ("T", "temperature", "{:g}"),
                          ("requests", "requests", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"),
                          ("× target", "speedup_vs_target"), ("× 1 stream", "speedup_vs_1_stream"), ("τ", "tau"),
                          ("latency p50 / p99 ms", pair("latency_ms_p50", "latency_ms_p99")),
                          ("TTFT p50 / p99 ms", pair("ttft_ms_p50", "ttft_ms_p99")),
                          ("target / draft batch", pair("target_batch_mean", "draft_batch_mean", "{:.2f}")), STEPS,
                          MATCHES], r["concurrency"])
        lines.append("")
    if r["skipped"]:
        lines += ["Not run: " + "; ".join(r["skipped"]), ""]
    lines += ["speedup: tok/s ÷ target-only's on the same prompts and seeds; τ: tokens committed per verify step; "
              "step ms: wall time per verify step and the Propose / Verify round trips in it (wire: outside both "
              "models, queue: in the services' batches); ideal = τ × t(decode) ÷ t(verify at the mean width), "
              "efficiency = speedup ÷ ideal; = target: greedy outputs equal to target-only's; batch: steps per "
              "forward the service ran.", ""]
    return "\n".join(lines)


def plots(args, results) -> int:
    if not args.no_plots:
        try:
            from .plots import plot
            log("plots: " + ", ".join(map(str, plot(results, Path(args.out)))))
        except ModuleNotFoundError as exc:       # the `bench` extra is not installed: the report stands
            log(f"plots skipped: {exc.name} is not installed (pip install -e '.[bench]')")
    return 0


main, cli_main = entry("splitspec bench", __doc__, add_flags,
                       lambda args, argv: Bench(args).run(metadata("splitspec bench", argv)), markdown, plots)
