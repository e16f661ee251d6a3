"""Turn benchmark samples into figures: one JSON object per configuration (and temperature),
a Markdown report and the run's metadata (command line, git revision, machine)."""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from .configs import CONFIGS, Sample

# Markdown formats of the JSON fields; the test suite checks the two agree through these.
FORMATS = {"tokens_per_s": "{:.1f}", "tokens_per_s_median": "{:.1f}", "speedup": "{:.2f}",
           "accept_length": "{:.2f}", "ttft_ms_p50": "{:.1f}", "itl_ms_p50": "{:.2f}",
           "ideal_speedup": "{:.2f}", "efficiency": "{:.2f}", "hidden_state_bytes_per_step": "{:.0f}",
           # concurrency sweep and mixed run
           "speedup_vs_1_stream": "{:.2f}", "latency_ms_p50": "{:.0f}", "latency_ms_p99": "{:.0f}",
           "ttft_ms_p99": "{:.1f}", "itl_ms_p99": "{:.2f}", "target_batch_mean": "{:.2f}",
           "draft_batch_mean": "{:.2f}", "speedup_vs_target": "{:.2f}", "long_ttft_ms": "{:.1f}", "itl_ms_p50_outside": "{:.2f}",
           "itl_ms_p99_outside": "{:.2f}", "itl_ms_p50_during": "{:.2f}", "itl_ms_p99_during": "{:.2f}",
           "itl_p99_during_over_p50_outside": "{:.2f}"}


def fmt(value, spec: str = "{:.2f}") -> str:
    return "–" if value is None else spec.format(value)


def percentile(values, q: float) -> float | None:
    """Linear-interpolation percentile (q in 0..100), like numpy's default."""
    v = sorted(values)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def interpolate(table: dict, x: float) -> float:
    """Piecewise-linear value of {width: ms} at x (clamped to the measured widths)."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    return table[xs[-1]]


def token_gaps(s: Sample) -> list[tuple[float, float, float]]:
    """(previous chunk's arrival, this chunk's arrival, gap per token) for every chunk after the
    first, times in seconds since the request was sent. A chunk of k tokens (a verify step's)
    gives one sample of gap / k, so speculation is not charged a k-token wait as one token's."""
    n = len(s.step_times) - 1
    if n < 1:
        return []
    # step_sizes holds the chunks after the first (hf-pld counts its first chunk too): the last n.
    sizes = s.step_sizes[len(s.step_sizes) - n:]
    t = s.step_times
    return [(t[i], t[i + 1], (t[i + 1] - t[i]) / max(1, k)) for i, k in enumerate(sizes)]


def split_gaps(samples: list[Sample], lo: float, hi: float) -> tuple[list[float], list[float]]:
    """Per-token gaps (ms) of the samples, split by whether the gap overlaps [lo, hi] (absolute
    perf_counter times): a token held back by a prefill in that window arrives after it ends,
    so its gap counts as during it."""
    during, outside = [], []
    for s in samples:
        for start, end, gap in token_gaps(s):
            overlaps = s.start_s + start < hi and s.start_s + end > lo
            (during if overlaps else outside).append(gap * 1e3)
    return during, outside


# ------------------------------------------------------------------------------ metadata

def git_revision(root: Path) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{rev}{' (modified)' if dirty else ''}" if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    import torch
    out = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
           "platform": platform.platform()}
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    try:
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return out


def metadata(argv: list[str]) -> dict:
    root = Path(__file__).resolve().parent.parent.parent
    return {"command": "splitspec bench " + " ".join(shlex.quote(a) for a in argv),
            "python_command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "git_revision": git_revision(root), "machine": machine()}


def machine_line(meta: dict) -> str:
    m = meta["machine"]
    line = f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)"
    if m.get("transformers"):
        line += f", transformers {m['transformers']}"
    return line + f", Python {m['python']}"


# ------------------------------------------------------------------------------ figures

def summarize(name: str, key: str, samples: list[Sample], *, prompt_ids: list[list[int]],
              prompt_index: list[int], temperature: float, top_p: float | None, draft_sampling: str | None,
              width: int | None, baseline: dict | None, baseline_tokens: list[list[int]] | None,
              step_times: dict | None, prompt_names: list[str]) -> dict:
    """One configuration at one temperature. `prompt_index[i]` is the prompt of samples[i];
    `baseline_tokens[i]` the baseline's output on the same prompt and seed."""
    info = CONFIGS[key]
    tokens = sum(len(s.tokens) for s in samples)
    wall = sum(s.wall_s for s in samples)
    steps = sum(s.verify_steps for s in samples)
    committed = sum(s.committed for s in samples)
    per_req_tps = [len(s.tokens) / s.wall_s for s in samples]
    entry = {
        "name": name, "config": key, "letter": info.letter, "description": info.description,
        "temperature": temperature, "top_p": top_p, "draft_sampling": draft_sampling,
        "num_draft_tokens": width if info.speculative else None,
        "requests": len(samples), "tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "tokens_per_s_median": percentile(per_req_tps, 50),
    }
    # Speedup: ratio of this run's measured rates to the baseline's (a) at the same temperature,
    # over the same prompts and seeds. Aggregate: total tokens / total time.
    if baseline is not None:
        entry["speedup"] = entry["tokens_per_s"] / baseline["tokens_per_s"]
        entry["speedup_median"] = entry["tokens_per_s_median"] / baseline["tokens_per_s_median"]
    else:
        entry["speedup"] = entry["speedup_median"] = 1.0
    taus = [s.committed / s.verify_steps for s in samples if s.verify_steps]
    hist: dict[int, int] = {}
    for s in samples:
        for k in s.step_sizes:
            hist[k] = hist.get(k, 0) + 1
    positions = [0] * max((len(s.accepted_per_position) for s in samples), default=0)
    for s in samples:
        for i, c in enumerate(s.accepted_per_position):
            positions[i] += c
    entry.update({
        "verify_steps": steps,
        "accept_length": committed / steps if steps else None,
        "accept_length_per_request": {"min": min(taus, default=None), "p10": percentile(taus, 10),
                                      "p50": percentile(taus, 50), "p90": percentile(taus, 90),
                                      "max": max(taus, default=None)},
        "accept_length_histogram": {str(k): hist[k] for k in sorted(hist)},
        # share of verify steps whose draft at depth k + 1 was accepted
        "per_position_acceptance": [c / steps for c in positions] if steps and info.speculative else [],
        "ttft_ms_p50": percentile([s.ttft_s * 1e3 for s in samples], 50),
        "ttft_ms_p90": percentile([s.ttft_s * 1e3 for s in samples], 90),
        "itl_ms_p50": percentile([s.itl_s * 1e3 for s in samples if s.itl_s is not None], 50),
        "itl_ms_p90": percentile([s.itl_s * 1e3 for s in samples if s.itl_s is not None], 90),
    })
    split = None
    if steps and all(s.draft_ms is not None for s in samples):
        draft_ms = sum(s.draft_ms for s in samples)
        verify_ms = sum(s.verify_ms for s in samples)
        wire_ms = sum(s.wire_ms for s in samples)
        queue_ms = sum(s.queue_ms or 0.0 for s in samples)
        split = {"total": wall * 1e3 / steps, "draft": draft_ms / steps, "verify": verify_ms / steps,
                 "wire": wire_ms / steps, "queue": queue_ms / steps,
                 "other": (wall * 1e3 - draft_ms - verify_ms) / steps}
    elif steps:
        split = {"total": wall * 1e3 / steps, "draft": None, "verify": None, "wire": None, "queue": None,
                 "other": None}
    entry["per_step_ms"] = split
    entry["steps_by_method"] = method_mix(samples)
    if info.kind == "grpc" and info.speculative and steps:
        # The prompt's features go to the draft once, at Open; each verify step then sends the
        # rows of the root and the accepted nodes, i.e. tau rows. Bytes per row = total / all rows.
        step_bytes = 0.0
        for s, p in zip(samples, prompt_index):
            rows = len(prompt_ids[p]) + s.committed
            if s.hidden_state_bytes and rows:
                step_bytes += s.hidden_state_bytes * s.committed / rows
        entry["hidden_state_bytes_per_step"] = step_bytes / steps
        entry["hidden_state_bytes_per_request"] = sum(s.hidden_state_bytes or 0 for s in samples) / len(samples)
    else:
        entry["hidden_state_bytes_per_step"] = entry["hidden_state_bytes_per_request"] = None
    # The physical limit: tau x t(target step) / t(verify step at this configuration's mean
    # verify width), from the measured step times.
    entry["ideal_speedup"] = entry["efficiency"] = None
    if info.speculative and step_times and steps and samples[0].draft_tokens is not None:
        drafted = sum(s.draft_tokens or 0 for s in samples)
        w_eff = 1 + drafted / steps
        entry["mean_verify_width"] = w_eff
        entry["ideal_speedup"] = entry["accept_length"] * step_times[1] / interpolate(step_times, w_eff)
        entry["efficiency"] = entry["speedup"] / entry["ideal_speedup"]
    # Lossless check at temperature 0: the output must equal the baseline's, token for token.
    if temperature == 0 and baseline_tokens is not None:
        bad = [prompt_names[p] for s, p, ref in zip(samples, prompt_index, baseline_tokens) if s.tokens != ref]
        entry["greedy_matches"] = len(samples) - len(bad)
        entry["greedy_mismatches"] = bad
    else:
        entry["greedy_matches"] = entry["greedy_mismatches"] = None
    expected = info.method
    entry["method_mismatches"] = sum(1 for s in samples if s.method_ran and s.method_ran != expected)
    entry["draft_fallbacks"] = sum(s.draft_fallbacks for s in samples)
    return entry


# ------------------------------------------------------------------------------ markdown

MAIN_COLUMNS = [
    ("configuration", lambda e: f"({e['letter']}) {e['name']}"),
    ("tok/s", lambda e: fmt(e["tokens_per_s"], FORMATS["tokens_per_s"])),
    ("tok/s median", lambda e: fmt(e["tokens_per_s_median"], FORMATS["tokens_per_s_median"])),
    ("speedup", lambda e: fmt(e["speedup"], FORMATS["speedup"])),
    ("τ mean", lambda e: fmt(e["accept_length"], FORMATS["accept_length"])),
    ("τ p10/p50/p90", lambda e: "/".join(fmt(e["accept_length_per_request"][q], "{:.1f}")
                                         for q in ("p10", "p50", "p90"))),
    ("TTFT p50 ms", lambda e: fmt(e["ttft_ms_p50"], FORMATS["ttft_ms_p50"])),
    ("ITL p50 ms", lambda e: fmt(e["itl_ms_p50"], FORMATS["itl_ms_p50"])),
    ("step ms", lambda e: fmt((e["per_step_ms"] or {}).get("total"), "{:.1f}")),
    ("draft", lambda e: fmt((e["per_step_ms"] or {}).get("draft"), "{:.1f}")),
    ("verify", lambda e: fmt((e["per_step_ms"] or {}).get("verify"), "{:.1f}")),
    ("wire", lambda e: fmt((e["per_step_ms"] or {}).get("wire"), "{:.1f}")),
    ("queue", lambda e: fmt((e["per_step_ms"] or {}).get("queue"), "{:.1f}")),
    ("gateway/other", lambda e: fmt((e["per_step_ms"] or {}).get("other"), "{:.1f}")),
    ("hidden B/step", lambda e: fmt(e["hidden_state_bytes_per_step"], FORMATS["hidden_state_bytes_per_step"])),
    ("ideal", lambda e: fmt(e["ideal_speedup"], FORMATS["ideal_speedup"])),
    ("efficiency", lambda e: fmt(e["efficiency"], FORMATS["efficiency"])),
    ("= baseline", lambda e: "–" if e["greedy_matches"] is None else f"{e['greedy_matches']}/{e['requests']}"),
    ("steps dflash/ngram/none", lambda e: mix_cell(e.get("steps_by_method"))),
]


def method_mix(samples) -> dict | None:
    """Steps per drafter over the samples (auto: what the policy chose), None when not reported."""
    out: dict[str, int] = {}
    for s in samples:
        for m, n in (getattr(s, "steps_by_method", None) or {}).items():
            out[m] = out.get(m, 0) + n
    return out or None


def mix_cell(mix: dict | None) -> str:
    if not mix:
        return "–"
    total = sum(mix.values())
    return "/".join(f"{100 * mix.get(m, 0) / total:.0f}" for m in ("dflash", "ngram", "none")) + " %"


def _cell(key: str):
    return lambda e: fmt(e.get(key), FORMATS[key])


CONCURRENCY_COLUMNS = [
    ("streams", lambda c: str(c["streams"])),
    ("configuration", lambda c: c["name"]),
    ("requests", lambda c: str(c["requests"])),
    ("T", lambda c: f"{c['temperature']:g}"),
    ("tok/s (aggregate)", _cell("tokens_per_s")),
    ("× target", _cell("speedup_vs_target")),
    ("× 1 stream", _cell("speedup_vs_1_stream")),
    ("latency p50 ms", _cell("latency_ms_p50")),
    ("latency p99 ms", _cell("latency_ms_p99")),
    ("TTFT p50 ms", _cell("ttft_ms_p50")),
    ("TTFT p99 ms", _cell("ttft_ms_p99")),
    ("ITL p50 ms", _cell("itl_ms_p50")),
    ("ITL p99 ms", _cell("itl_ms_p99")),
    ("target batch", _cell("target_batch_mean")),
    ("draft batch", _cell("draft_batch_mean")),
    ("busy target/draft/both", lambda c: "/".join(fmt(c.get(k), "{:.0%}") for k in ("target_busy", "draft_busy", "overlap"))),
    ("step ms draft/verify/wire/queue", lambda c: "/".join(fmt((c.get("per_step_ms") or {}).get(k), "{:.1f}")
                                                          for k in ("draft", "verify", "wire", "queue"))),
    ("steps dflash/ngram/none", lambda c: mix_cell(c.get("steps_by_method"))),
    ("CPU ms/token target/draft/gateway", lambda c: "/".join(fmt((c.get("cpu_ms_per_token") or {}).get(k), "{:.2f}")
                                                            for k in ("target", "draft", "gateway"))),
    ("= baseline", lambda c: "–" if c["greedy_matches"] is None else f"{c['greedy_matches']}/{c['requests']}"),
]

MIXED_COLUMNS = [
    ("configuration", lambda m: m["name"]),
    ("streams", lambda m: str(m["streams"])),
    ("long prompt tokens", lambda m: str(m["long_prompt_tokens"])),
    ("long TTFT ms", _cell("long_ttft_ms")),
    ("ITL p50 ms outside", _cell("itl_ms_p50_outside")),
    ("ITL p99 ms outside", _cell("itl_ms_p99_outside")),
    ("ITL p50 ms during", _cell("itl_ms_p50_during")),
    ("ITL p99 ms during", _cell("itl_ms_p99_during")),
    ("p99 during ÷ p50 outside", _cell("itl_p99_during_over_p50_outside")),
    ("gaps during/outside", lambda m: f"{m['itl_samples_during']}/{m['itl_samples_outside']}"),
    ("target batch", _cell("target_batch_mean")),
    ("draft batch", _cell("draft_batch_mean")),
]


def mixed_section(m: dict, command: str) -> list[str]:
    lines = ["", f"## Mixed load: one {m['long_prompt_tokens']}-token prefill among {m['streams']} "
                 f"decoding streams ({temperature_title(m['temperature'], m.get('top_p'))})", "",
             f"`{command}`", ""]
    lines += table([c for c, _ in MIXED_COLUMNS], [[f(m) for _, f in MIXED_COLUMNS]])
    note = (f"{m['streams']} streams loop requests of {m['max_new_tokens']} new tokens; after they all "
            f"decode, one request with a {m['long_prompt_tokens']}-token prompt")
    if m["long_prompt_tokens"] != m["long_prompt_tokens_asked"]:
        note += f" (asked {m['long_prompt_tokens_asked']}, clamped to the target's context)"
    note += (f" and {m['long_max_new_tokens']} new tokens is sent. ITL = gap between a decoding stream's "
             f"chunks ÷ the chunk's tokens, pooled over the streams; during = gaps overlapping the time "
             f"from sending the long request to its first token, outside = the rest of the run "
             f"({m['decoder_requests']} decoding requests, {m['duration_s']:.1f} s).")
    return lines + ["", note]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def temperature_title(t: float, top_p: float | None) -> str:
    return "temperature 0 (greedy)" if t == 0 else f"temperature {t:g}, top_p {top_p:g}"


def markdown(results: dict) -> str:
    meta, run = results["meta"], results["run"]
    lines = ["# splitspec benchmark", "",
             f"- command: `{meta['command']}`",
             f"- git revision: {meta['git_revision']}",
             f"- machine: {machine_line(meta)}; load average at start {meta['machine'].get('load_average')}",
             f"- target: `{run['target_model']}`; draft: `{run['draft_model'] or 'none'}`; services: {run['services']}",
             f"- prompts: {run['num_prompts']} ({run['prompt_source']}, digest {run['prompt_digest']}, "
             f"{run['prompt_tokens_mean']:.0f} tokens on average); {run['max_new_tokens']} new tokens each "
             f"(eos ignored); repeats {run['repeats']}; verify width {run['num_draft_tokens']}; "
             f"configurations interleaved per prompt",
             f"- started {run['started']}, took {run['duration_s']:.0f} s"]
    st = results.get("step_times")
    if st:
        parts = ", ".join(f"w={w}: {ms:.2f}" for w, ms in sorted(((int(w), v) for w, v in st["ms"].items())))
        lines.append(f"- step times ({st['source']}, median ms by verify width w; w=1 is a target-only "
                     f"decode step): {parts}")
    for block in results["temperatures"]:
        entries = [e for e in results["configs"] if e["temperature"] == block["temperature"]]
        if not entries:
            continue
        lines += ["", f"## {temperature_title(block['temperature'], block['top_p'])}", ""]
        lines += table([c for c, _ in MAIN_COLUMNS], [[f(e) for _, f in MAIN_COLUMNS] for e in entries])
        spec = [e for e in entries if e["per_position_acceptance"]]
        if spec:
            depth = max(len(e["per_position_acceptance"]) for e in spec)
            lines += ["", "Per-position acceptance (share of verify steps whose draft at depth k was accepted):", ""]
            lines += table(["configuration", *[str(k + 1) for k in range(depth)]],
                           [[e["name"], *[fmt(e["per_position_acceptance"][k], "{:.3f}")
                                          if k < len(e["per_position_acceptance"]) else "–" for k in range(depth)]]
                            for e in spec])
        notes = [f"{e['name']}: {len(e['greedy_mismatches'])} output(s) differ from the baseline "
                 f"({', '.join(e['greedy_mismatches'][:5])})" for e in entries if e.get("greedy_mismatches")]
        notes += [f"{e['name']}: {e['method_mismatches']} request(s) ran another method than asked"
                  for e in entries if e["method_mismatches"]]
        notes += [f"{e['name']}: {e['draft_fallbacks']} draft fallback(s)" for e in entries if e["draft_fallbacks"]]
        if notes:
            lines += ["", "**Mismatches:**", ""] + [f"- {n}" for n in notes]
    if results.get("concurrency"):
        c0 = results["concurrency"][0]
        temps = sorted({c["temperature"] for c in results["concurrency"]})
        title = " and ".join(temperature_title(t, next(c.get("top_p") for c in results["concurrency"]
                                                       if c["temperature"] == t)) for t in temps)
        lines += ["", f"## Concurrency ({title}, {c0['max_new_tokens']} new tokens per request)", ""]
        lines += table([c for c, _ in CONCURRENCY_COLUMNS],
                       [[f(c) for _, f in CONCURRENCY_COLUMNS] for c in results["concurrency"]])
        lines += ["", "× target = tok/s ÷ target-only's at the same streams and temperature; "
                  "× 1 stream = tok/s ÷ the same configuration's at 1 stream; step ms = per step, the "
                  "Propose and Verify round trips, their part outside both models, and their waits in "
                  "the services' batch queues; busy = share of the point's wall time each service spent "
                  "in forwards (Δ busy_ms from GetInfo), both = at least this share had both running at "
                  "once (target + draft − 1); ITL = gap between a "
                  "request's consecutive chunks ÷ the later chunk's tokens, pooled over the point's "
                  "requests; target / draft batch = steps per batched forward the service ran during "
                  "the point (Δ batched_steps ÷ Δ forward_passes from its GetInfo; – when the bench "
                  "has no address for it or it ran no forward); CPU ms/token = CPU time (all threads, "
                  "/proc) each service the bench started used during the point ÷ the tokens generated, "
                  "forwards or not: on a shared host, where the cores went."]
    if results.get("mixed"):
        lines += mixed_section(results["mixed"], meta["command"])
    if results.get("skipped"):
        lines += ["", "Not run: " + "; ".join(results["skipped"])]
    lines += ["", "Columns: tok/s = generated tokens / wall time over all requests (aggregate) and the "
              "median of per-request rates; speedup = aggregate tok/s ÷ that of (a) in this run; τ = "
              "tokens committed per verify step (accepted drafts + bonus; the prefill's first token not "
              "counted), mean over all steps and per-request percentiles; TTFT and ITL (inter-token "
              "latency, (t_last − t_first)/(n − 1)) measured by the client; per-step ms: wall time per "
              "step, split into draft (Propose round trips, incl. the draft model), verify (Verify "
              "round trips, incl. the target model), wire (the part of those round trips spent outside "
              "both models: network and serialisation) and gateway/other (the rest: client ↔ gateway "
              "gRPC, tokenizer, detokenizer, the gateway's loop; for the in-process loop, Python "
              "around the models); hidden B/step = target hidden-state bytes sent to the draft per "
              "verify step (the prompt's features at Open excluded); ideal = τ × t(target step) / "
              "t(verify step at the mean verify width); efficiency = speedup ÷ ideal; = baseline: "
              "greedy outputs equal to (a)'s, token for token.", ""]
    return "\n".join(lines)


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
