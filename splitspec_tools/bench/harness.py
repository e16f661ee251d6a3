"""What every bench shares besides the services and the client: one median, one percentile, one τ,
the run's metadata (command line, git revision, machine) and the report writers (a Markdown table,
results.json + results.md, printed). See docs/benchmarks.md."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .client import sampling

ROOT = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def csv_items(s: str) -> list[str]:
    """A comma-separated flag's items, blanks dropped."""
    return [x.strip() for x in (s or "").split(",") if x.strip()]


# The request flags of `splitspec bench` and bench-drafts: (default, help), parsed as the default's type.
REQUEST_FLAGS = {
    "--num-prompts": (50, "prompts to run"),
    "--max-prompt-chars": (1500, "context kept before each default cut"),
    "--max-prompt-tokens": (512, "longer prompts keep their last tokens"),
    "--max-new-tokens": (128, "tokens generated per request (eos ignored)"),
    "--repeats": (1, "times every prompt runs through every configuration"),
    "--warmup": (2, "untimed requests per configuration and setting"),
    "--temperatures": ("0,1.0", "comma-separated; top_p applies when > 0"),
    "--draft-sampling": ("greedy,sample", "draft modes at T > 0: greedy and/or sample"),
}


def request_flags(a) -> None:
    a("--prompts", default=None, help="a JSONL file, 'humaneval' or 'chat' (default: held-out function cuts)")
    for flag, (default, what) in REQUEST_FLAGS.items():
        a(flag, type=type(default), default=default, help=what)


def settings(args) -> tuple[list[float], list[str]]:
    """The temperatures and the draft modes at T > 0 of `request_flags`."""
    temps, modes = [float(t) for t in csv_items(args.temperatures)], csv_items(args.draft_sampling)
    if not temps or not modes or set(modes) - {"greedy", "sample"}:
        raise SystemExit("--temperatures: values >= 0; --draft-sampling: greedy and/or sample")
    return temps, modes


def apply_sizes(args, sizes: dict) -> None:
    """Every size flag left unset takes its value from `sizes` (name: (default, --smoke value, ...)),
    so that explicit flags win over --smoke."""
    for name, (default, smoke, *_) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else default)


# ------------------------------------------------------------------------------ statistics

def median(values) -> float | None:
    """The median of the values that are not None; None when there are none."""
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def percentile(values, q: float) -> float | None:
    """Linear-interpolation percentile (q in 0..100), like numpy's default."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def interleave(runs: list, prompts: list, repeats: int, send, t: float, top_p: float, seed: int,
               after=None, rotate: bool = False) -> list[list]:
    """Every prompt through every run in turn (a b c a b c …; rotate: a b c, b c a, c a b, …),
    `repeats` times, so that a slow minute of a shared machine falls on all runs alike:
    send(run, prompt, params), request i of repeat r sampled at T=t with seed + 1000 r + i;
    after(rep, i, out) once a prompt went through all runs. The results of each run, in prompt order.

    rotate: who goes first turns with the prompt. The first run of a prompt computes its prefill
    and the others find it in the target's prefix cache; with target-only always first it paid
    every prompt's prefill (TTFT 135 ms against 36 for the others on HumanEval, 1.7 s against
    0.06 on 2,000-token prompts), which inflated every speed-up over it."""
    out = [[] for _ in runs]
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            params = sampling(t, top_p, seed + 1000 * rep + i)
            first = (rep * len(prompts) + i) % len(runs) if rotate else 0
            for k in [*range(first, len(runs)), *range(first)]:
                out[k].append(send(runs[k], prompt, params))
            if after is not None:
                after(rep, i, out)
    return out


def alternate(configs, repeats: int, run) -> dict:
    """Every configuration once per repeat, back to back, the order reversed every other repeat
    (a b c, c b a, …) so that a machine's drift falls on all alike: {config: [run(config, rep), …]}."""
    out = {c: [] for c in configs}
    for rep in range(repeats):
        for c in list(configs)[::-1 if rep % 2 else 1]:
            out[c].append(run(c, rep))
    return out


def paired(a: dict, b: dict) -> float | None:
    """The median over the repeats of a's value ÷ b's ({repeat: value}, each repeat's pair run back to
    back), over the repeats where both are known."""
    return median([v / b[k] for k, v in a.items() if v is not None and b.get(k)])


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def tau(samples) -> float | None:
    """The accept length, one meaning everywhere (docs/speculation.md): tokens committed per verify
    step (accepted drafts + the bonus token; the prefill's first token not counted), pooled over
    the samples' steps. None where no step was verified (target-only, whose τ is 1 by definition)."""
    steps = sum(_get(s, "verify_steps") for s in samples)
    return sum(_get(s, "committed") for s in samples) / steps if steps else None


def _get(s, k):
    return s[k] if isinstance(s, dict) else getattr(s, k)      # a Sample, or its row in a report


def summary(samples, method: str | None = None, wall: float | None = None) -> dict:
    """What every bench reports of a set of requests: tok/s (tokens ÷ their summed wall time, or ÷
    `wall`, the run's, where they were in flight together), τ,
    P(slot k accepted) (the share of verify steps whose draft at depth k was accepted), TTFT and ITL
    medians (ms), the drafters' shares of the steps, and the requests that ran another method than
    asked or fell back to the target alone."""
    tokens, steps = sum(len(s.tokens) for s in samples), sum(s.verify_steps for s in samples)
    wall = sum(s.wall_s for s in samples) if wall is None else wall
    depth = max((len(s.accepted_per_position) for s in samples), default=0) if method not in (None, "none") else 0
    return {"requests": len(samples), "tokens": tokens, "wall_s": wall, "tokens_per_s": ratio(tokens, wall),
            "verify_steps": steps, "tau": tau(samples),
            "per_position_acceptance": [sum(s.accepted_per_position[k] for s in samples
                                            if k < len(s.accepted_per_position)) / steps for k in range(depth)]
            if steps else [],
            "ttft_ms_p50": percentile([s.ttft_s * 1e3 for s in samples], 50),
            "itl_ms_p50": percentile([s.itl_s * 1e3 for s in samples if s.itl_s is not None], 50),
            "steps_by_method": step_mix(samples) or None,
            "method_mismatches": sum(bool(s.method_ran) and s.method_ran != method for s in samples) if method else 0,
            "draft_fallbacks": sum(s.draft_fallbacks for s in samples)}


def step_mix(samples) -> dict[str, float]:
    """Share of steps per drafter that ran (auto's choice), from the gateway's stats."""
    counts: dict[str, int] = {}
    for s in samples:
        for m, n in (_get(s, "steps_by_method") or {}).items():
            counts[m] = counts.get(m, 0) + n
    total = sum(counts.values()) or 1
    return {m: n / total for m, n in sorted(counts.items())}


def mix_cell(mix: dict | None) -> str:
    return " / ".join(f"{m} {v:.0%}" for m, v in mix.items()) if mix else "–"


# ------------------------------------------------------------------------------ metadata

def git_revision() -> str:
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        rev, dirty = run("rev-parse", "--short=12", "HEAD"), run("status", "--porcelain", "--untracked-files=no")
        return f"{rev}{' (modified)' if dirty else ''}" if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "platform": platform.platform()}
    try:
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return out


def metadata(prog: str, argv: list[str]) -> dict:
    """What every results.json records: the command as typed, the git revision, the machine and when."""
    return {"command": f"{prog} {shlex.join(argv)}".rstrip(),
            "python_command": shlex.join([sys.executable, *sys.argv]), "git_revision": git_revision(),
            "machine": machine(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def machine_line(meta: dict) -> str:
    m = meta["machine"]
    return (f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
            f"Python {m['python']}")


def header(title: str, meta: dict, *lines: str) -> list[str]:
    """The head of every results.md: the command, the revision, the machine, then the bench's own lines."""
    return [f"# {title}", "", f"- command: `{meta['command']}`", f"- git revision: {meta['git_revision']}",
            f"- machine: {machine_line(meta)}; load average at start {meta['machine'].get('load_average')}",
            f"- started {meta['started']}", *[f"- {x}" for x in lines], ""]


# ------------------------------------------------------------------------------ reports

def fmt(value, spec: str = "{:.2f}") -> str:
    return "–" if value is None else spec.format(value)


def table(header_: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header_) + " |", "|" + "|".join("---" for _ in header_) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def columns(spec: list[tuple], rows: list[dict]) -> list[str]:
    """A Markdown table of `rows` from column specs: (title, key[, format]) shows fmt(row.get(key), format),
    "{:.2f}" unless given; (title, function) the function of the row."""
    return table([c[0] for c in spec], [[c[1](r) if callable(c[1]) else fmt(r.get(c[1]), *c[2:]) for c in spec]
                                        for r in rows])


def tail(flags: list[str], skipped: list[str], note: str) -> list[str]:
    """The end of a results.md: what looks wrong, what did not run, how to read the tables."""
    return (["## Flags", "", *([f"- {f}" for f in flags] or ["- none"])]
            + (["", "Not run: " + "; ".join(skipped)] if skipped else []) + ["", note, ""])


def write(out: Path, results: dict, markdown: str) -> None:
    """results.json and results.md into `out`, and the Markdown on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "results.md").write_text(markdown)
    print(markdown)
    log(f"wrote {out / 'results.json'}, {out / 'results.md'}")


def entry(prog: str, doc: str, add_flags, bench, markdown, then=None):
    """A bench's main(argv) and its command-line entry: the flags `add_flags(add_argument)` gives a
    parser of `prog` (`doc` its help), parsed; `bench(args, argv)` run for its results, results.json
    and results.md written to --out; the exit code `then(args, results)`, else 0. The entry logs the
    library's warnings to stderr as JSON lines, so stdout carries only the report, and SIGTERM
    unwinds like Ctrl-C, through the `finally` that stops the services."""
    def main(argv: list[str]) -> int:
        p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_flags(p.add_argument)
        args = p.parse_args(argv)
        results = bench(args, argv)
        write(Path(args.out), results, markdown(results))
        return then(args, results) if then else 0

    def cli_main(argv: list[str] | None = None) -> int:
        import signal

        from splitspec import logs
        logs.configure("bench", "warning")

        def stop(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, stop)
        try:
            return main(sys.argv[1:] if argv is None else list(argv))
        except KeyboardInterrupt:
            return 130
    return main, cli_main
