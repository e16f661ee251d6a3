"""`splitspec bench-drafts`: two or more draft checkpoints for one target, side by side through the real
services (issue 16: DFlash vs DFlash2), every prompt through each draft in turn with method "dflash" (so τ
is the drafter's own): τ, P(slot k accepted), tok/s, draft ms per Propose, τ ÷ the first draft's and ÷ the
`splitspec ceiling`. At T=0 all drafts must give the same tokens, else exit code 1. See docs/benchmarks.md.

    splitspec bench-drafts --draft runs/out-dflash --draft runs/out-dflash2      # ~25 min on 2 idle cores
    splitspec bench-drafts --draft A --draft B --num-prompts 10 --ceiling-paths 0    # no ceiling
    splitspec bench-drafts --draft A --draft B --prompt-lengths 128,512,1024,1800   # τ by prompt length
"""
from __future__ import annotations

import time
from pathlib import Path

from . import stack as stacks
from .client import Gateway, prometheus, sampling
from .harness import (columns, csv_items, entry, fmt, header, interleave, log, metadata, percentile, ratio,
                      request_flags, settings, summary, table, tau)
from .prompts import at_least, default_prompts, digest, load_jsonl, load_prompts


def add_flags(a) -> None:
    a("--draft", action="append", required=True, help="draft folder (repeat; the first is the reference)")
    request_flags(a)
    a("--prompt-lengths", default="", metavar="L1,L2,…", help="every setting at each prompt length (tokens)")
    a("--ceiling-paths", type=int, default=64, help="target paths per context for `splitspec ceiling` at each "
      "T > 0, run after the services stop (~10 min on 2 cores for 50 prompts at 64); 0 skips it")
    stacks.add_flags(a, out="bench-out/drafts")


def propose_ms(url: str) -> tuple[float, float]:
    """(seconds, count) of the draft's propose forwards so far: model time only, no Open, no wire."""
    got = prometheus(url, r'^splitspec:forward_time_seconds_(sum|count)\{kind="propose"\} (\S+)$')
    return got.get("sum", 0.0), got.get("count", 0.0)


class DraftBench:
    def __init__(self, args, argv):
        self.args, self.argv, self.skipped, self.mismatches = args, argv, [], []
        self.target_path, _ = stacks.models(args.target_model_path, "none")
        self.drafts = [{"label": p.name, "path": str(p), "architecture": stacks.architecture(p, "--draft"),
                        "block_size": stacks.draft_width(p)} for p in map(Path, args.draft)]
        if len({d["label"] for d in self.drafts}) < len(self.drafts):     # same folder names: say more
            for d in self.drafts:
                d["label"] = f"{Path(d['path']).parent.name}/{d['label']}"
        # One width for all, so every draft is verified alike and one ceiling per setting applies.
        self.width = args.num_draft_tokens or min(d["block_size"] for d in self.drafts)
        self.temperatures, modes = settings(args)
        self.settings = [(t, m) for t in self.temperatures for m in (["greedy"] if t == 0 else modes)]
        self.stack = stacks.Stack(args, self.target_path, self.width, Path(args.out) / "logs")

    def prompts(self) -> None:
        """`self.by_length`: L → the prompts cut to their last L tokens (None: as `splitspec bench` cuts them)."""
        a = self.args
        self.lengths = [int(x) for x in csv_items(a.prompt_lengths)]
        room = stacks.max_context(self.target_path) - a.max_new_tokens - self.width - 2
        if not self.lengths:
            ids, self.names, self.source = load_prompts(a.prompts, a.num_prompts, self.target_path,
                                                        max_chars=a.max_prompt_chars,
                                                        max_tokens=max(1, min(a.max_prompt_tokens, room)))
            self.by_length = {None: ids}
            return
        if max(self.lengths) > room:
            raise SystemExit(f"--prompt-lengths: {max(self.lengths)} tokens + {a.max_new_tokens} new exceed the "
                             f"target's context; the longest length can be at most {room}")
        kept = at_least(load_jsonl(a.prompts) if a.prompts else default_prompts(
            a.num_prompts * 4, max_chars=max(a.max_prompt_chars, 8 * max(self.lengths))),
            stacks.tokenizer(self.target_path), max(self.lengths), a.num_prompts)
        if not kept:
            raise SystemExit(f"--prompt-lengths: no prompt has {max(self.lengths)} tokens")
        self.names, kept = [name for _, name in kept], [ids for ids, _ in kept]
        self.by_length = {L: [ids[-L:] for ids in kept] for L in self.lengths}
        self.source = f"prompts of at least {max(self.lengths)} tokens cut to their last L, digest {digest(kept)}"

    def start(self) -> None:
        stack, target, drafts = self.stack, self.stack.target(), []
        for i, d in enumerate(self.drafts):
            flags, d["metrics"] = stacks.metrics_port()
            drafts.append(stack.draft(Path(d["path"]), flags, name=f"draft{i}"))
        stack.wait(target, *drafts)
        self.gateways = [stack.gateway(target.address, p.address, name=f"gateway{i}") for i, p in enumerate(drafts)]
        stack.wait(*self.gateways)

    def measure(self, L: int | None, ids: list[list[int]]) -> list[dict]:
        a, entries, at = self.args, [], f" at {L} prompt tokens" if L else ""
        for t, mode in self.settings:
            runners = [Gateway(gw.address, "dflash", self.width, mode, a.timeout_s) for gw in self.gateways]
            name = f"T={t:g} top_p {a.top_p:g}, {'sampled' if mode == 'sample' else 'greedy'} drafts" if t else "T=0"
            for runner in runners:      # this setting's own path (sampled drafts too), not timed
                for p in ids[:a.warmup]:
                    runner.run(p, min(16, a.max_new_tokens), sampling(t, a.top_p, a.seed + 999_999))
            def send(d, p, params):      # (sample, the draft's forward ms per Propose meanwhile)
                s0, n0 = propose_ms(self.drafts[d]["metrics"])
                sample = runners[d].run(p, a.max_new_tokens, params)
                s1, n1 = propose_ms(self.drafts[d]["metrics"])
                return sample, (s1 - s0) * 1e3 / (n1 - n0) if n1 > n0 else None
            def after(rep, i, out):
                if t == 0:      # lossless: every draft must give the reference draft's tokens
                    self.mismatches += [f"{self.drafts[d]['label']} ≠ {self.drafts[0]['label']} on {self.names[i]}{at} "
                                        f"(repeat {rep + 1})" for d in range(1, len(runners))
                                        if out[d][-1][0].tokens != out[0][-1][0].tokens]
                log(f"{name}{at} rep {rep + 1}/{a.repeats} prompt {i + 1}/{len(ids)}: τ " +
                    ", ".join(f"{dr['label']} {fmt(tau([o[-1][0]]))}" for dr, o in zip(self.drafts, out)))
            out = interleave(range(len(runners)), ids, a.repeats, send, t, a.top_p, a.seed, after, rotate=True)
            for runner in runners:
                runner.close()
            rows = [summarize(dr, [s for s, _ in o], [f for _, f in o], t, mode, name)
                    for dr, o in zip(self.drafts, out)]
            for r in rows:
                ms, ref = r["draft_forward_ms_p50"], rows[0]["draft_forward_ms_p50"]
                r.update(prompt_tokens=L or sum(map(len, ids)) / len(ids), length_key=L,
                         tau_vs_first=ratio(r["tau"], rows[0]["tau"]),
                         draft_forward_ms_vs_first=None if ms is None or ref is None else ms - ref)
            entries += rows
        return entries

    def ceilings(self) -> dict:
        """`splitspec ceiling` on the same prompts, width and settings, per prompt length, in this
        process once the services are gone; keyed by (length, T). At T=0 the target is
        deterministic, so a perfect drafter's τ is the width: nothing to compute."""
        a = self.args
        exact = {"greedy_tau": float(self.width), "greedy_reach_per_position": [1.0] * (self.width - 1),
                 "seconds": 0.0, "source": "exact (the target is deterministic at T=0)"}
        out = {(L, 0.0): exact for L in self.by_length} if 0 in self.temperatures else {}
        hot = sorted({t for t, _ in self.settings if t > 0})
        if not hot or a.ceiling_paths <= 0:
            self.skipped += ["ceiling at T > 0: --ceiling-paths 0"] if hot else []
            return out
        from splitspec.engine.sample import SamplingParams
        from target_service.engine import load_model

        from .ceiling import ceiling
        model, offsets = load_model(self.target_path, device=a.device), list(range(0, a.max_new_tokens, 40))
        for (L, ids), t in ((kv, t) for kv in self.by_length.items() for t in hot):
            t0 = time.perf_counter()
            res = ceiling(model, ids, block_size=self.width, num_paths=a.ceiling_paths, offsets=offsets,
                          params=SamplingParams(temperature=t, top_p=a.top_p).validate(), seed=a.seed)
            out[(L, t)] = {**res, "seconds": time.perf_counter() - t0,
                      "source": f"splitspec ceiling, {a.ceiling_paths} paths/context, offsets {offsets}"}
        return out

    def run(self) -> dict:
        a, t0, meta = self.args, time.perf_counter(), metadata("splitspec bench-drafts", self.argv)
        try:
            self.prompts()
            self.start()
            entries = [e for L, ids in self.by_length.items() for e in self.measure(L, ids)]
        finally:
            self.stack.stop()
        ceil = self.ceilings()
        for e in entries:
            c = ceil.get((e.pop("length_key"), e["temperature"]))
            key = "sampled" if e["draft_sampling"] == "sample" else "greedy"
            e["ceiling_tau"] = c[f"{key}_tau"] if c else None
            e["ceiling_share"] = ratio(e["tau"], e["ceiling_tau"])
            e["ceiling_reach_per_position"] = c[f"{key}_reach_per_position"] if c else None
        for d in self.drafts:
            d.pop("metrics", None)
        some = next(iter(self.by_length.values()))
        return {"meta": meta, "run": {
            "duration_s": time.perf_counter() - t0, "target_model": str(self.target_path), "num_prompts": len(some),
            "prompt_source": self.source, "prompt_tokens_mean": sum(map(len, some)) / len(some),
            "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "num_draft_tokens": self.width,
            "prompt_lengths": self.lengths, "seed": a.seed}, "drafts": self.drafts,
            "ceilings": {(f"{L}:{t:g}" if L else f"{t:g}"): c for (L, t), c in ceil.items()}, "results": entries,
            "lossless": {"requests": len(some) * a.repeats * len(self.by_length) if 0.0 in self.temperatures else 0,
                         "mismatches": self.mismatches}, "skipped": self.skipped}


def summarize(draft: dict, samples: list, fwd: list, t: float, mode: str, name: str) -> dict:
    step = lambda k: percentile([getattr(s, k) / s.verify_steps for s in samples if s.verify_steps], 50)  # noqa: E731
    return {"setting": name, "temperature": t, "draft_sampling": mode if t > 0 else None, "draft": draft["label"],
            "architecture": draft["architecture"], **summary(samples, "dflash"),
            "draft_forward_ms_p50": percentile(fwd, 50),
            "propose_ms_per_step_p50": step("draft_ms"), "verify_ms_per_step_p50": step("verify_ms")}


def markdown(r: dict) -> str:
    run, entries, first = r["run"], r["results"], r["drafts"][0]["label"]
    lines = header("splitspec bench-drafts", r["meta"],
                   f"target: `{run['target_model']}`; drafts: " + ", ".join(
                       f"`{d['label']}` ({d['architecture']}, block {d['block_size']}, `{d['path']}`)"
                       for d in r["drafts"]),
                   f"prompts: {run['num_prompts']} ({run['prompt_source']}, {run['prompt_tokens_mean']:.0f} tokens on "
                   f"average); {run['max_new_tokens']} new tokens each (eos ignored); repeats {run['repeats']}; verify "
                   f"width {run['num_draft_tokens']}; method dflash; drafts interleaved per prompt; took "
                   f"{run['duration_s']:.0f} s") + ["## τ through the services", ""]
    lines += columns([("setting", "setting", "{}"), ("prompt tokens", "prompt_tokens", "{:.0f}"),
                      ("draft", lambda e: f"{e['draft']} ({e['architecture'].replace('DraftModel', '')})"),
                      ("τ", "tau"), ("τ ÷ first", "tau_vs_first", "{:.2f}x"), ("ceiling τ", "ceiling_tau"),
                      ("share of ceiling", "ceiling_share", "{:.0%}"), ("tok/s", "tokens_per_s", "{:.1f}"),
                      ("draft forward ms/Propose p50", "draft_forward_ms_p50"),
                      ("Δ draft ms vs first", "draft_forward_ms_vs_first", "{:+.2f}"),
                      ("Propose / Verify ms/step p50", lambda e: " / ".join(
                          fmt(e[f"{k}_ms_per_step_p50"], "{:.1f}") for k in ("propose", "verify")))], entries)
    if run["prompt_lengths"]:
        Ls, at = run["prompt_lengths"], {(e["setting"], e["draft"], e["prompt_tokens"]): e for e in entries}
        cells = lambda s, d, f: [f(at[s, d, L]) if (s, d, L) in at else "–" for L in Ls]  # noqa: E731
        lines += ["", "## By prompt length", "", "τ (share of the ceiling) and draft ms per Propose, the same prompts "
                  "cut to their last L tokens:", ""]
        lines += table(["setting", "draft", *[f"τ @{L}" for L in Ls], *[f"ms @{L}" for L in Ls]],
                       [[s, d, *cells(s, d, lambda c: f"{fmt(c['tau'])} ({fmt(c['ceiling_share'], '{:.0%}')})"),
                         *cells(s, d, lambda c: fmt(c["draft_forward_ms_p50"]))]
                        for s, d in dict.fromkeys((e["setting"], e["draft"]) for e in entries)])
    depth = max((len(e["per_position_acceptance"]) for e in entries), default=0)
    rows = []
    for e in entries:
        if e["draft"] == first and e["ceiling_reach_per_position"]:
            rows.append([e["setting"], "ceiling", *[fmt(x, "{:.3f}") for x in e["ceiling_reach_per_position"][:depth]]])
        rows.append([e["setting"], e["draft"], *[fmt(x, "{:.3f}") for x in e["per_position_acceptance"]]])
    lines += ["", "## P(slot k accepted): share of verify steps whose draft at depth k was accepted", ""]
    lines += table(["setting", "draft", *map(str, range(1, depth + 1))],
                   [row + ["–"] * (depth + 2 - len(row)) for row in rows])
    ll = r["lossless"]
    lines += ["", (f"**LOSSLESS CHECK FAILED at T=0: {len(ll['mismatches'])} output(s) differ between drafts:** "
                   + "; ".join(ll["mismatches"][:10])) if ll["mismatches"] else
              f"Lossless check: at T=0 all drafts gave the same tokens on {ll['requests']}/{ll['requests']} requests."]
    lines += [f"- **{e['setting']} {e['draft']}: {e['method_mismatches']} request(s) ran another method, "
              f"{e['draft_fallbacks']} draft fallback(s) (τ understated)**" for e in entries
              if e["method_mismatches"] or e["draft_fallbacks"]]
    ceilings = ", ".join(f"T={t}: {c['source']}, {c['seconds']:.0f} s" for t, c in r["ceilings"].items())
    lines += ["", f"Ceilings: {ceilings}." + (f" Not run: {'; '.join(r['skipped'])}." if r["skipped"] else "")]
    lines += ["", "τ = tokens committed per verify step, pooled; ceiling τ = `splitspec ceiling` on these prompts and "
              "this width; draft forward ms/Propose = the draft service's own time per propose forward (its metrics), "
              "median over requests; Propose / Verify ms/step = the gateway's round trips per step, median over "
              "requests.", ""]
    return "\n".join(lines)


def lossless(args, results) -> int:
    if results["lossless"]["mismatches"]:
        log("LOSSLESS CHECK FAILED: drafts disagree at T=0 (see results.md)")
    return 1 if results["lossless"]["mismatches"] else 0


main, cli_main = entry("splitspec bench-drafts", __doc__, add_flags, lambda args, argv: DraftBench(args, argv).run(),
                       markdown, lossless)
