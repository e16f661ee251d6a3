"""`splitspec bench-drafts`: two or more draft checkpoints for the same target, side by side in
one run through the real services (issue 16: DFlash vs DFlash2).

One target service is shared; each draft gets its own draft service and gateway. Every prompt
runs through each draft's gateway in turn (A B A B …, so a slow minute of a shared machine hits
all drafts alike) with method "dflash" (fixed, never auto, so τ is the drafter's own), at T=0 and
at each T > 0 with greedy and sampled drafts. Reported per draft and setting: τ, P(slot k
accepted), tok/s, the draft's forward time per Propose (from the draft service's metrics, so
DFlash2's convs + selector show as added ms), τ ÷ the first draft's, and τ ÷ the `splitspec
ceiling` τ of the same prompts and setting. At T=0 every draft must give the same tokens
(all are lossless w.r.t. the same target): a mismatch is printed and the exit code is 1.

    splitspec bench-drafts --draft runs/out-dflash --draft runs/out-dflash2      # ~25 min on 2 idle cores
    splitspec bench-drafts --draft A --draft B --num-prompts 10 --ceiling-paths 0    # no ceiling
    splitspec bench-drafts --draft A --draft B --prompt-lengths 128,512,1024,1800   # τ by prompt length

With `--prompt-lengths`, the same prompts run at every length: long function cuts (at least the
longest length, in tokens), each cut to its last L tokens, so a length only changes how much of
the file before the function the models see, not which continuation they must draft.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from . import stack as stacks
from .client import Gateway, sampling
from .harness import cli, csv_items, fmt, header, log, metadata, percentile, table, tau, write
from .prompts import digest, load_prompts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec bench-drafts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--draft", action="append", required=True, help="draft folder (repeat; the first is the reference)")
    a("--target-model-path", default=None, help="target model folder (default: models/splitspec-code-target)")
    a("--prompts", default=None, help="JSONL prompts, as `splitspec bench --prompts`")
    a("--num-prompts", type=int, default=50)
    a("--max-prompt-chars", type=int, default=1500)
    a("--max-prompt-tokens", type=int, default=512)
    a("--max-new-tokens", type=int, default=128, help="tokens per request (eos ignored)")
    a("--prompt-lengths", default=None, metavar="L1,L2,…",
      help="run every setting at each prompt length (tokens): the same long prompts cut to their last L tokens")
    a("--repeats", type=int, default=1)
    a("--warmup", type=int, default=2, help="warm-up requests per draft and setting (not timed)")
    a("--temperatures", default="0,1.0")
    a("--top-p", type=float, default=0.95)
    a("--draft-sampling", default="greedy,sample", help="draft modes run at temperature > 0")
    a("--num-draft-tokens", type=int, default=None,
      help="verify width for every draft (default: the smallest block size among the drafts)")
    a("--seed", type=int, default=0, help="request i of repeat r uses seed + 1000 r + i")
    a("--ceiling-paths", type=int, default=64,
      help="target paths per context for `splitspec ceiling` at each T > 0, run after the services stop "
           "(about 10 min on 2 cores for 50 prompts at 64; docs/training.md used 128); 0 skips it")
    stacks.add_flags(a)
    a("--out", default="bench-out/drafts", help="folder for results.json, results.md and the service logs")
    return p


def propose_forwards(url: str) -> tuple[float, float]:
    """(seconds, count) of the draft service's propose forwards so far, from its Prometheus
    histogram: model time only, without the Open forward or the wire."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    got = dict(re.findall(r'^splitspec:forward_time_seconds_(sum|count)\{kind="propose"\} (\S+)$', text, re.MULTILINE))
    return float(got.get("sum", 0.0)), float(got.get("count", 0.0))


class DraftBench:
    def __init__(self, args, argv):
        self.args, self.argv, self.skipped, self.runners, self.procs = args, argv, [], [], []

    def resolve(self) -> None:
        from draft_service.architectures import draft_classes
        from splitspec_tools.defaults import DEFAULT_TARGET, model_dir
        a = self.args
        self.target_path = model_dir(a.target_model_path, DEFAULT_TARGET)
        if self.target_path is None or not (self.target_path / "config.json").is_file():
            raise SystemExit(f"no target model at {self.target_path or DEFAULT_TARGET} (--target-model-path)")
        self.drafts = []
        for path in map(Path, a.draft):
            if not (path / "config.json").is_file():
                raise SystemExit(f"--draft {path}: no config.json there")
            raw = json.loads((path / "config.json").read_text())
            self.drafts.append({"label": path.name, "path": str(path), "architecture": raw["architectures"][0],
                                "block_size": draft_classes(raw)[0].from_dict(raw).block_size})
        if len({d["label"] for d in self.drafts}) < len(self.drafts):     # same folder names: say more
            for d in self.drafts:
                d["label"] = f"{Path(d['path']).parent.name}/{d['label']}"
        # One width for all, so every draft is verified alike and one ceiling per setting applies.
        self.width = a.num_draft_tokens or min(d["block_size"] for d in self.drafts)
        temps = [float(t) for t in csv_items(a.temperatures)]
        modes = csv_items(a.draft_sampling)
        if not temps or set(modes) - {"greedy", "sample"} or not modes:
            raise SystemExit("--temperatures: values >= 0; --draft-sampling: greedy and/or sample")
        self.temperatures = temps
        self.settings = [(t, m) for t in temps for m in (["greedy"] if t == 0 else modes)]
        self.target_address = None

    def prepare_prompts(self) -> None:
        """With --prompt-lengths: long cuts of the default prompts (or the JSONL's), keeping those
        with at least the longest length in tokens; `self.by_length` maps L to each prompt's last
        L tokens."""
        a = self.args
        self.lengths = [int(x) for x in csv_items(a.prompt_lengths)] if a.prompt_lengths else []
        if not self.lengths:
            room = stacks.max_context(self.target_path) - a.max_new_tokens - self.width - 2
            self.prompt_ids, self.prompt_names, self.prompt_source = load_prompts(
                a.prompts, a.num_prompts, self.target_path, max_chars=a.max_prompt_chars,
                max_tokens=max(1, min(a.max_prompt_tokens, room)))
            self.by_length = {None: self.prompt_ids}
            return
        longest = max(self.lengths)
        room = stacks.max_context(self.target_path) - a.max_new_tokens - self.width - 2
        if longest > room:
            raise SystemExit(f"--prompt-lengths: {longest} tokens + {a.max_new_tokens} new exceed the target's "
                             f"context ({stacks.max_context(self.target_path)}); the longest length can be at most {room}")
        from .prompts import default_prompts, load_jsonl
        tok = stacks.tokenizer(self.target_path)
        pool = (load_jsonl(a.prompts) if a.prompts else
                default_prompts(a.num_prompts * 4, max_chars=max(a.max_prompt_chars, 8 * longest)))
        kept, names = [], []
        for p in pool:
            ids = list(p.token_ids) or tok.encode(p.text).ids
            if len(ids) >= longest:
                kept.append(ids)
                names.append(p.id)
            if len(kept) == a.num_prompts:
                break
        if not kept:
            raise SystemExit(f"--prompt-lengths: no prompt has {longest} tokens")
        if len(kept) < a.num_prompts:
            log(f"only {len(kept)} prompts have {longest} tokens (asked for {a.num_prompts})")
        self.by_length = {L: [ids[-L:] for ids in kept] for L in self.lengths}
        self.prompt_ids, self.prompt_names = self.by_length[self.lengths[0]], names
        self.prompt_source = (f"file {a.prompts}" if a.prompts else "function cuts from installed third-party "
                              f"packages") + f" with at least {longest} tokens, cut to their last L tokens"

    def start_services(self) -> None:
        from splitspec_tools.ops.launch import free_port, start_service
        a = self.args
        logs = Path(a.out) / "logs"
        target = start_service("target", ["--model-path", str(self.target_path), "--device", a.device,
                                          "--log-level", "warning", "--torch-threads", str(a.target_torch_threads),
                                          "--verify-torch-threads", str(a.target_verify_torch_threads)],
                               log_dir=logs)
        self.procs.append(target)
        drafts = []
        for i, d in enumerate(self.drafts):
            port = free_port()
            proc = start_service("draft", ["--method", "dflash", "--model-path", d["path"], "--target-model-path",
                                           str(self.target_path), "--device", a.device, "--log-level", "warning",
                                           "--torch-threads", str(a.draft_torch_threads), "--metrics-port", str(port)],
                                 log_dir=logs / f"draft{i}")
            self.procs.append(proc)
            drafts.append(proc)
            d["metrics"] = f"http://127.0.0.1:{port}/metrics"
        log(f"starting target {target.address} and {len(drafts)} drafts (logs: {logs})")
        for p in [target, *drafts]:
            p.wait_healthy(a.startup_timeout_s)
        self.gateways = []
        for i, dp in enumerate(drafts):
            gw = start_service("gateway", ["--target", target.address, "--draft", dp.address, "--log-level", "warning",
                                           "--max-new-tokens-cap", str(max(2048, a.max_new_tokens)),
                                           "--speculative-num-draft-tokens", str(self.width),
                                           "--speculative-num-steps", str(self.width - 1)], log_dir=logs / f"draft{i}")
            self.procs.append(gw)
            self.gateways.append(gw)
        for gw in self.gateways:
            gw.wait_healthy(a.startup_timeout_s)
        self.target_address = target.address

    def measure(self) -> tuple[list[dict], list[str]]:
        entries, mismatches = [], []
        for L, ids in self.by_length.items():
            self.prompt_ids = ids
            e, m = self.measure_length(L)
            entries += e
            mismatches += m
        return entries, mismatches

    def measure_length(self, L: int | None) -> tuple[list[dict], list[str]]:
        a = self.args
        entries, mismatches = [], []
        at = f" at {L} prompt tokens" if L else ""
        for t, mode in self.settings:
            runners = [Gateway(gw.address, "dflash", self.width, mode, a.timeout_s) for gw in self.gateways]
            self.runners += runners
            name = setting_name(t, mode, a.top_p)
            log(f"{name}{at}: warming up")
            for runner in runners:      # this setting's own path (sampled drafts too), not timed
                for ids in self.prompt_ids[:a.warmup]:
                    runner.run(ids, min(16, a.max_new_tokens), sampling(t, self.args.top_p, a.seed + 999_999))
            samples, fwd = [[] for _ in runners], [[] for _ in runners]
            for rep in range(a.repeats):
                for i, ids in enumerate(self.prompt_ids):
                    params = sampling(t, self.args.top_p, a.seed + 1000 * rep + i)
                    for d, runner in enumerate(runners):         # interleaved: A B A B …
                        s0, n0 = propose_forwards(self.drafts[d]["metrics"])
                        samples[d].append(runner.run(ids, a.max_new_tokens, params))
                        s1, n1 = propose_forwards(self.drafts[d]["metrics"])
                        fwd[d].append((s1 - s0) * 1e3 / (n1 - n0) if n1 > n0 else None)
                    if t == 0:      # lossless: every draft must give the reference draft's tokens
                        for d in range(1, len(runners)):
                            if samples[d][-1].tokens != samples[0][-1].tokens:
                                mismatches.append(f"{self.drafts[d]['label']} ≠ {self.drafts[0]['label']} on "
                                                  f"{self.prompt_names[i]}{at} (repeat {rep + 1})")
                    log(f"{name}{at} rep {rep + 1}/{a.repeats} prompt {i + 1}/{len(self.prompt_ids)}: τ " +
                        ", ".join(f"{dr['label']} {tau(s[-1:]) or 1.0:.2f}" for dr, s in zip(self.drafts, samples)))
            rows = [summarize(dr, s, f, t, mode, a.top_p if t > 0 else None, name) for dr, s, f in
                    zip(self.drafts, samples, fwd)]
            ref = rows[0]
            for r in rows:
                r["prompt_tokens"] = L if L else statistics.mean(map(len, self.prompt_ids))
                r["length_key"] = L
                r["tau_vs_first"] = r["tau_pooled"] / ref["tau_pooled"] if ref["tau_pooled"] else None
                ms = (r["draft_forward_ms_p50"], ref["draft_forward_ms_p50"])
                r["draft_forward_ms_vs_first"] = ms[0] - ms[1] if None not in ms else None
            entries += rows
        return entries, mismatches

    def ceilings(self) -> dict:
        """`splitspec ceiling` on the same prompts, width and settings, per prompt length, in this
        process once the services are gone (so it does not slow them); keyed by (length, T). T=0
        needs no computing: the target is deterministic, so a perfect drafter's τ is the width."""
        a = self.args
        exact = {"greedy_tau": float(self.width), "greedy_reach_per_position": [1.0] * (self.width - 1),
                 "seconds": 0.0, "source": "exact (the target is deterministic at T=0)"}
        out = {(L, 0.0): exact for L in self.by_length} if 0 in self.temperatures else {}
        hot = sorted({t for t, _ in self.settings if t > 0})
        if hot and a.ceiling_paths <= 0:
            self.skipped.append("ceiling at T > 0: --ceiling-paths 0")
        if not hot or a.ceiling_paths <= 0:
            return out
        from splitspec.engine.sample import SamplingParams
        from target_service.engine import load_model

        from .ceiling import ceiling
        model = load_model(self.target_path, device=a.device)
        offsets = list(range(0, a.max_new_tokens, 40))     # the contexts a drafter meets along a request
        for L, ids in self.by_length.items():
            for t in hot:
                log(f"ceiling at T={t:g}{f', {L} prompt tokens' if L else ''}: {len(ids) * len(offsets)} "
                    f"contexts, {a.ceiling_paths} paths each")
                t0 = time.perf_counter()
                res = ceiling(model, ids, block_size=self.width, num_paths=a.ceiling_paths, offsets=offsets,
                              params=SamplingParams(temperature=t, top_p=a.top_p).validate(), seed=a.seed)
                out[(L, t)] = {**res, "seconds": time.perf_counter() - t0,
                               "source": f"splitspec ceiling, {a.ceiling_paths} paths/context, offsets {offsets}"}
        return out

    def run(self) -> tuple[dict, int]:
        a = self.args
        started, t0 = datetime.now(timezone.utc), time.perf_counter()
        meta = metadata("splitspec bench-drafts", self.argv)
        self.resolve()
        try:
            self.start_services()
            self.prepare_prompts()
            entries, mismatches = self.measure()
        finally:
            for r in self.runners:
                r.close()
            for p in reversed(self.procs):
                p.stop()
        ceil = self.ceilings()
        for e in entries:
            c = ceil.get((e.pop("length_key"), e["temperature"]))
            key = "sampled" if e["draft_sampling"] == "sample" and e["temperature"] > 0 else "greedy"
            e["ceiling_tau"] = c[f"{key}_tau"] if c else None
            e["ceiling_share"] = e["tau_pooled"] / e["ceiling_tau"] if c and e["tau_pooled"] else None
            e["ceiling_reach_per_position"] = c[f"{key}_reach_per_position"] if c else None
        for d in self.drafts:
            d.pop("metrics", None)
        results = {
            "meta": meta,
            "run": {"started": started.isoformat(timespec="seconds"), "duration_s": time.perf_counter() - t0,
                    "target_model": str(self.target_path), "num_prompts": len(self.prompt_ids),
                    "prompt_source": self.prompt_source, "prompt_digest": digest(self.prompt_ids),
                    "prompt_tokens_mean": statistics.mean(map(len, self.prompt_ids)),
                    "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "num_draft_tokens": self.width,
                    "prompt_lengths": self.lengths,
                    "seed": a.seed},
            "drafts": self.drafts,
            "ceilings": {(f"{L}:{t:g}" if L else f"{t:g}"): c for (L, t), c in ceil.items()},
            "results": entries,
            "lossless": {"checked": "T=0 outputs of every draft equal to the first draft's, token for token",
                         "requests": (len(self.prompt_ids) * a.repeats * len(self.by_length)
                                      if 0.0 in self.temperatures else 0),
                         "mismatches": mismatches},
            "skipped": self.skipped,
        }
        return results, 1 if mismatches else 0


def setting_name(t: float, mode: str, top_p: float) -> str:
    return "T=0" if t == 0 else f"T={t:g} top_p {top_p:g}, {'sampled' if mode == 'sample' else 'greedy'} drafts"


def summarize(draft: dict, samples: list, fwd: list, t: float, mode: str, top_p, name: str) -> dict:
    steps = sum(s.verify_steps for s in samples)
    positions = [0] * (max((len(s.accepted_per_position) for s in samples), default=0))
    for s in samples:
        for k, c in enumerate(s.accepted_per_position):
            positions[k] += c

    def per_step(attr: str) -> float | None:      # median over requests of the request's ms per step
        return percentile([getattr(s, attr) / s.verify_steps for s in samples
                           if s.verify_steps and getattr(s, attr) is not None], 50)
    taus = [tau([s]) or 1.0 for s in samples]
    tokens, wall = sum(len(s.tokens) for s in samples), sum(s.wall_s for s in samples)
    return {"setting": name, "temperature": t, "top_p": top_p, "draft_sampling": mode if t > 0 else None,
            "draft": draft["label"], "architecture": draft["architecture"], "requests": len(samples),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "verify_steps": steps,
            "tau_mean": statistics.mean(taus), "tau_pooled": sum(s.committed for s in samples) / steps if steps else None,
            "tau_per_request": taus,
            # share of verify steps whose draft at depth k was accepted (= P(slots 1..k all accepted))
            "per_position_acceptance": [c / steps for c in positions] if steps else [],
            "draft_forward_ms_p50": percentile([f for f in fwd if f is not None], 50),
            "propose_ms_per_step_p50": per_step("draft_ms"), "verify_ms_per_step_p50": per_step("verify_ms"),
            "method_mismatches": sum(1 for s in samples if s.method_ran and s.method_ran != "dflash"),
            "draft_fallbacks": sum(s.draft_fallbacks for s in samples)}


COLUMNS = [
    ("setting", lambda e: e["setting"]),
    ("prompt tokens", lambda e: fmt(e.get("prompt_tokens"), "{:.0f}")),
    ("draft", lambda e: f"{e['draft']} ({e['architecture'].replace('DraftModel', '')})"),
    ("τ pooled", lambda e: fmt(e["tau_pooled"])),
    ("τ mean of requests", lambda e: fmt(e["tau_mean"])),
    ("τ ÷ first", lambda e: fmt(e["tau_vs_first"], "{:.2f}x")),
    ("ceiling τ", lambda e: fmt(e["ceiling_tau"])),
    ("share of ceiling", lambda e: fmt(e["ceiling_share"], "{:.0%}")),
    ("tok/s", lambda e: fmt(e["tokens_per_s"], "{:.1f}")),
    ("draft forward ms/Propose p50", lambda e: fmt(e["draft_forward_ms_p50"])),
    ("Δ draft ms vs first", lambda e: fmt(e["draft_forward_ms_vs_first"], "{:+.2f}")),
    ("Propose ms/step p50", lambda e: fmt(e["propose_ms_per_step_p50"], "{:.1f}")),
    ("Verify ms/step p50", lambda e: fmt(e["verify_ms_per_step_p50"], "{:.1f}")),
]


def markdown(r: dict) -> str:
    meta, run, entries = r["meta"], r["run"], r["results"]
    first = r["drafts"][0]["label"]
    lines = header("splitspec bench-drafts", meta)[:-1] + [
             f"- target: `{run['target_model']}`; drafts: " + ", ".join(
                 f"`{d['label']}` ({d['architecture']}, block {d['block_size']}, `{d['path']}`)" for d in r["drafts"]),
             f"- prompts: {run['num_prompts']} ({run['prompt_source']}, digest {run['prompt_digest']}, "
             f"{run['prompt_tokens_mean']:.0f} tokens on average); {run['max_new_tokens']} new tokens each (eos "
             f"ignored); repeats {run['repeats']}; verify width {run['num_draft_tokens']}; method dflash; drafts "
             f"interleaved per prompt; one target service shared",
             f"- started {run['started']}, took {run['duration_s']:.0f} s", "", "## τ through the services", ""]
    lines += table([c for c, _ in COLUMNS], [[f(e) for _, f in COLUMNS] for e in entries])
    if run.get("prompt_lengths"):
        lines += ["", "## By prompt length", "",
                  "τ pooled (share of the ceiling) and the draft's forward ms per Propose, the same prompts cut to "
                  "their last L tokens:", ""]
        Ls = run["prompt_lengths"]
        keys = list(dict.fromkeys((e["setting"], e["draft"]) for e in entries))
        at = {(e["setting"], e["draft"], e["prompt_tokens"]): e for e in entries}
        rows = []
        for setting, draft in keys:
            cells = [at.get((setting, draft, L)) for L in Ls]
            rows.append([setting, draft,
                         *[f"{fmt(c['tau_pooled'])} ({fmt(c['ceiling_share'], '{:.0%}')})" if c else "–" for c in cells],
                         *[fmt(c["draft_forward_ms_p50"]) if c else "–" for c in cells]])
        lines += table(["setting", "draft", *[f"τ @{L}" for L in Ls], *[f"ms @{L}" for L in Ls]], rows)
    lines += ["", "Ratios to the first draft:", ""]
    for e in entries:
        if e["draft"] != first:
            at = f" at {e['prompt_tokens']:.0f} prompt tokens" if run.get("prompt_lengths") else ""
            lines.append(f"- {e['setting']}{at}: {e['draft']} / {first} τ = {fmt(e['tau_vs_first'], '{:.2f}x')}, "
                         f"draft forward {fmt(e['draft_forward_ms_vs_first'], '{:+.2f}')} ms per Propose")
    depth = max((len(e["per_position_acceptance"]) for e in entries), default=0)
    rows = []
    for e in entries:
        if e["draft"] == first and e["ceiling_reach_per_position"]:
            rows.append([e["setting"], "ceiling", *[fmt(x, "{:.3f}") for x in e["ceiling_reach_per_position"][:depth]]])
        rows.append([e["setting"], e["draft"], *[fmt(x, "{:.3f}") for x in e["per_position_acceptance"]]])
    lines += ["", "## P(slot k accepted): share of verify steps whose draft at depth k was accepted", ""]
    lines += table(["setting", "draft", *[str(k + 1) for k in range(depth)]],
                   [row + ["–"] * (depth + 2 - len(row)) for row in rows])
    ll = r["lossless"]
    lines += ["", (f"**LOSSLESS CHECK FAILED at T=0: {len(ll['mismatches'])} output(s) differ between drafts:** "
                   + "; ".join(ll["mismatches"][:10])) if ll["mismatches"] else
              f"Lossless check: at T=0 all drafts gave the same tokens on {ll['requests']}/{ll['requests']} requests."]
    notes = [f"{e['setting']} {e['draft']}: {e['method_mismatches']} request(s) ran another method, "
             f"{e['draft_fallbacks']} draft fallback(s)" for e in entries if e["method_mismatches"] or e["draft_fallbacks"]]
    if notes:
        lines += ["", "**Not all steps were drafted (τ understated):** " + "; ".join(notes)]
    cost = ", ".join(f"T={t}: {c['source']}, {c['seconds']:.0f} s" for t, c in r["ceilings"].items())
    lines += ["", f"Ceilings: {cost}." + (f" Not run: {'; '.join(r['skipped'])}." if r["skipped"] else "")]
    lines += ["", "τ = tokens committed per verify step (accepted drafts + bonus), pooled over all steps and as the "
              "mean of per-request τ; ceiling τ = `splitspec ceiling` on these prompts and this width (greedy "
              "drafts: the target's argmax chain; sampled drafts: exact marginals with min(1, p/q)); draft "
              "forward ms/Propose = the draft service's own time per propose forward (its metrics, Open and wire "
              "excluded), median over requests; Propose / Verify ms/step = the gateway's round trips per step "
              "(the draft's Open counted in Propose), median over requests; tok/s = tokens ÷ wall time over all "
              "requests.", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    results, code = DraftBench(args, argv).run()
    write(Path(args.out), results, markdown(results))
    if code:
        log("LOSSLESS CHECK FAILED: drafts disagree at T=0 (see results.md)")
    return code


cli_main = cli(main)
