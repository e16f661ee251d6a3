"""`splitspec bench-structured`: structured outputs through the real services (issue 41, item 5):
held-out prompts, each paired with a constraint, run with every speculative method at T=0 and
T=1; per cell τ, tok/s, validity and finish reasons, and the grammar's cost at one stream.

The bench starts one target, one draft service per draft (by default both bundled drafts: DFlash
models/splitspec-code-draft-dflash, whose chains stay inside the grammar, and DFlash2
models/splitspec-code-draft) and a gateway in front of each draft, all on loopback (the services
`splitspec bench` starts, with the same flags). Every request is a gRPC Generate with
`sampling.constraint` set and eos honoured (a constrained answer ends with eos where its grammar
is complete; ignore_eos is refused with a constraint).

Workload: the bench's held-out prompts (splitspec_tools/bench/prompts.py: function cuts from installed
third-party packages; the default models are small code models), each followed by a line that
asks for what its constraint describes, the shapes taking turns over the prompts:

  flat        JSON schema: a record of the function, an enum, an integer in [0, 16], two booleans
  nested      JSON schema: the signature, an array (maxItems 3) of objects (string maxLength 12,
              enum, boolean), a return-type enum
  strings     JSON schema: four string fields with maxLength (one with minLength 1)
  tool        JSON schema of a tool call {"name": const <the function>, "arguments": {its
              parameters: boolean / integer / string by default value and annotation}}
  identifier  regex [a-z_][a-z0-9_]{0,23} after "def "
  version     regex [0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,3} after `__version__ = "` (bounded, so an
              answer always completes)
  choice      one of six categories

JSON schemas are sent with strict = true. The model is random-ish on JSON: the grammar does most
of the work there, which is the point of the workload (forced keys and punctuation).

Methods: none (target-only; always run: the baseline of the speedup, of the greedy check and of
the cost), ngram (the gateway's prompt lookup), dflash and auto (once per draft). At T > 0 drafts
are greedy unless --draft-sampling sample. Every prompt runs through every method in turn
(interleaved, a b c … a b c …); every repeat with new seeds at T > 0. A cell reports τ (committed
tokens ÷ verify steps, pooled over the repeats), tok/s (output tokens ÷ wall time over the cell's
requests, the median over the repeats), validity (outputs that parse and validate against their
schema / regex / choice ÷ completed answers; a `length` finish is an unfinished answer, counted
apart), finish reasons, and "forced": the share of committed tokens the grammar forced (jump-forward
nodes the target added and accepted). The gateway's Complete does not carry the target's
num_forced, but each SpeculativeStep's `accepted` counts the drafter's own nodes only
(num_accepted - num_forced) and the gateway streams one chunk per step, so a verify step's forced
tokens are its chunk's tokens - 1 (the bonus) - accepted. A step whose drafter accepted more than
its tree's depth is capped there, and an answer's last chunk stops at eos, so this is a lower bound.

Grammar cost (target-only, one stream): each constrained none request is followed by the same
request unconstrained (same prompt, seed and max_new_tokens, eos honoured: "free"), and by the
same request unconstrained with exactly the constrained answer's length (ignore_eos, max_new_tokens
= its token count: "matched", the same amount of decoding at the same positions). Compared:
decode ms per token ((t_last − t_first) ÷ (n − 1), summed over the requests), tok/s and TTFT.

    splitspec bench-structured                                # defaults, ~8 min on 2 cores
    splitspec bench-structured --smoke                        # 2 prompts, 1 repeat, dflash only
    splitspec bench-structured --methods none,dflash --temperatures 0 --shapes flat,tool
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import grpc

from splitspec.v1 import common_pb2

from . import stack as stacks
from .client import Gateway, Sample, sampling
from .harness import cli, csv_items, fmt, header, log, median, metadata, mix_cell, percentile, ratio, table, tau, write
from .prompts import default_prompts, digest

SHAPES = ("flat", "nested", "strings", "tool", "identifier", "version", "choice")
METHODS = ("none", "ngram", "dflash", "auto")
DRAFTS = ("models/splitspec-code-draft-dflash", "models/splitspec-code-draft")
# (default, --smoke); explicit flags win.
SIZES = {"num_prompts": (21, 2), "repeats": (3, 1), "max_new_tokens": (128, 80),
         "methods": (",".join(METHODS), "dflash"), "shapes": (",".join(SHAPES), "flat,choice"),
         "drafts": (",".join(DRAFTS), DRAFTS[0]), "temperatures": ("0,1", "0,1")}
MIN_ITL_TOKENS = 4         # per-request ITL ratios only from answers this long (fewer gaps are noise)
COST_LIMIT = 0.10          # issue 41: the grammar may cost at most this share of tok/s (target-only)
PROBE_TOKENS = 32          # new tokens of each unconstrained probe request (before and after the run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec bench-structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--smoke", action="store_true", help="2 prompts (flat JSON and choice), 1 repeat, dflash with the DFlash draft "
      "only, 80 new tokens (a flat record needs ~65): a quick end-to-end check; sizes given explicitly still win")
    a("--target-model-path", default=None, help="target model folder (default: models/splitspec-code-target)")
    a("--drafts", default=None, help="draft folders, comma-separated: one draft service and gateway each; dflash and "
      f"auto run once per draft [{SIZES['drafts'][0]}; smoke the first]")
    a("--methods", default=None, help=f"comma-separated, from {', '.join(METHODS)}; none is always run "
      f"[{SIZES['methods'][0]}; smoke dflash]")
    a("--shapes", default=None, help=f"constraint shapes, comma-separated, from {', '.join(SHAPES)}; they take "
      "turns over the prompts [all; smoke flat,choice]")
    a("--temperatures", default=None, help="comma-separated [0,1]; top_p applies when > 0")
    a("--top-p", type=float, default=0.95, help="nucleus sampling at temperature > 0")
    a("--draft-sampling", default="greedy", choices=["greedy", "sample"], help="drafts at temperature > 0")
    a("--num-prompts", type=int, default=None, help="prompts (each with one shape) [21; smoke 2]")
    a("--max-prompt-chars", type=int, default=1500, help="context kept before each default cut")
    a("--max-prompt-tokens", type=int, default=512, help="longer prompts keep their last tokens")
    a("--max-new-tokens", type=int, default=None, help="max_new_tokens of every request [128; smoke 80]")
    a("--repeats", type=int, default=None, help="times every prompt runs through every method [3; smoke 1]")
    a("--no-cost", action="store_true", help="skip the unconstrained requests of the grammar's cost")
    a("--gap-s", type=float, default=0.1,
      help="pause before every measured request, so that work still in flight when the previous one ended (a "
           "target decode run or a draft past its eos) does not land on this one's TTFT: back to back, a request "
           "after one that ended with eos had ~6 ms more TTFT than one after a length finish (0: back to back)")
    a("--num-draft-tokens", type=int, default=None, help="verify width (default: the first draft's block size)")
    a("--seed", type=int, default=0, help="request of prompt i in repeat r uses seed + 1000 r + i at T > 0")
    stacks.add_flags(a, request_timeout_s=600.0)
    a("--out", default="bench-out/structured", help="folder for results.json, results.md and the service logs")
    p.set_defaults(tree="1:2", gateway=None, target=None, draft=None)     # read by Bench's helpers
    return p


# ------------------------------------------------------------------------------ constraints


def _obj(props: dict, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **extra}


FLAT = _obj({"kind": {"enum": ["function", "method", "generator", "coroutine", "property"]},
             "num_args": {"type": "integer", "minimum": 0, "maximum": 16},
             "returns_value": {"type": "boolean"}, "has_docstring": {"type": "boolean"}})
NESTED = _obj({"name": {"type": "string", "maxLength": 24},
               "params": {"type": "array", "maxItems": 3,
                          "items": _obj({"name": {"type": "string", "maxLength": 12},
                                         "type": {"enum": ["int", "str", "bool", "float", "list", "dict", "Any"]},
                                         "optional": {"type": "boolean"}})},
               "returns": {"enum": ["None", "int", "str", "bool", "list", "dict", "Any"]}})
STRINGS = _obj({"module": {"type": "string", "minLength": 1, "maxLength": 24},
                "summary": {"type": "string", "maxLength": 48},
                "author": {"type": "string", "maxLength": 16}, "license": {"type": "string", "maxLength": 12}})
IDENTIFIER = "[a-z_][a-z0-9_]{0,23}"
VERSION = r"[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}"
CHOICES = ["pure", "io", "network", "parsing", "math", "other"]
SUFFIX = {"flat": "\n\n# A JSON record describing the function above:\n",
          "nested": "\n\n# The signature of the function above as JSON:\n",
          "strings": "\n\n# Metadata of the module above as JSON:\n",
          "tool": "\n\n# A JSON tool call of the function above:\n",
          "identifier": "\n\ndef ",
          "version": '\n\n__version__ = "',
          "choice": "\n\n# Category of the function above (" + ", ".join(CHOICES[:-1]) + f" or {CHOICES[-1]}): "}


def signature(text: str, name: str, limit: int = 4) -> list[tuple[str, str | None, str | None]]:
    """(parameter, annotation, default) of the last `def name(...)` in text, without self / cls
    and * / ** parameters, at most `limit`; [] when it cannot be found."""
    start = text.rfind(f"def {name}(")
    if start < 0:
        return []
    i = start + len(f"def {name}(")
    depth, parts, cur = 1, [], []
    while i < len(text) and depth:
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if depth == 1 and c == ",":
            parts.append("".join(cur))
            cur = []
        elif depth:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    out = []
    for part in parts:
        part = " ".join(part.split())
        m = re.match(r"([A-Za-z_]\w*)\s*(?::\s*([^=]+?))?\s*(?:=\s*(.+))?$", part)
        if not m or m.group(1) in ("self", "cls"):
            continue
        out.append((m.group(1), m.group(2), m.group(3)))
    return out[:limit]


def param_schema(annotation: str | None, default: str | None) -> dict:
    ann = (annotation or "").strip()
    if default in ("True", "False") or ann == "bool":
        return {"type": "boolean"}
    if (default is not None and re.fullmatch(r"\d+", default)) or ann == "int":
        return {"type": "integer", "minimum": 0, "maximum": 1000}
    return {"type": "string", "maxLength": 24}


def tool_schema(text: str, name: str) -> dict:
    args = {p: param_schema(ann, d) for p, ann, d in signature(text, name)}
    return _obj({"name": {"const": name}, "arguments": _obj(args)})


@dataclass
class Job:
    index: int
    prompt_id: str
    shape: str
    kind: str                 # json_schema | regex | choice
    spec: object              # the schema (dict), the regex (str) or the choices (list)
    ids: list[int] = field(default_factory=list)

    def constraint(self) -> common_pb2.Constraint:
        if self.kind == "json_schema":
            return common_pb2.Constraint(json_schema=json.dumps(self.spec), strict=True)
        if self.kind == "regex":
            return common_pb2.Constraint(regex=self.spec)
        return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=list(self.spec)))


def make_job(index: int, prompt_id: str, text: str, shape: str) -> tuple[Job, str]:
    """The job of a prompt and a shape, and the prompt text with the shape's request line."""
    fn = prompt_id.rsplit(":", 1)[-1]
    kind, spec = {"flat": ("json_schema", FLAT), "nested": ("json_schema", NESTED),
                  "strings": ("json_schema", STRINGS), "tool": ("json_schema", None),
                  "identifier": ("regex", IDENTIFIER), "version": ("regex", VERSION),
                  "choice": ("choice", CHOICES)}[shape]
    if shape == "tool":
        spec = tool_schema(text, fn)
    return Job(index, prompt_id, shape, kind, spec), text.rstrip("\n") + SUFFIX[shape]


# ------------------------------------------------------------------------------ validation

def schema_errors(value, schema: dict) -> list[str]:
    """What is wrong with `value` against `schema`, by the `jsonschema` package (draft 2020-12)."""
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        raise SystemExit("bench-structured checks answers with jsonschema: pip install -e '.[bench]'") from None
    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    return ["$" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in e.absolute_path) + f": {e.message}"
            for e in errors]


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicate key(s) {dup}")
    return dict(pairs)


def check_output(kind: str, spec, text: str) -> str | None:
    """None when `text` is valid against the constraint, else what is wrong."""
    if kind == "json_schema":
        try:
            value = json.loads(text, object_pairs_hook=_no_duplicates)
        except ValueError as exc:
            # RFC 8259 forbids raw control characters (U+0000-U+001F) in strings; say so apart,
            # since a lenient parser (json.loads(strict=False)) takes them.
            try:
                json.loads(text, strict=False, object_pairs_hook=_no_duplicates)
            except ValueError:
                return f"not JSON: {exc}"
            return f"not JSON (RFC 8259): a raw control character in a string: {exc}"
        errs = schema_errors(value, spec)
        return "; ".join(errs[:3]) if errs else None
    if kind == "regex":
        return None if re.fullmatch(spec, text) else f"does not match /{spec}/"
    if kind == "choice":
        return None if text in spec else f"not one of {spec}"
    raise ValueError(f"check_output: unknown kind {kind!r}")


# ------------------------------------------------------------------------------ requests


@dataclass
class Outcome:
    sample: Sample | None
    text: str = ""
    finish_reason: str = ""
    forced: int | None = None  # committed tokens the grammar forced (a lower bound; None: steps and chunks differ)
    error: str | None = None  # the RPC error, as the service said it


class StructuredRunner(Gateway):
    """Requests with eos honoured and a constraint (or none) each."""

    def send_one(self, ids: list[int], max_new: int, params, constraint, ignore_eos: bool = False) -> Outcome:
        req = self.request(ids, max_new, params, ignore_eos=ignore_eos)
        if constraint is not None:
            req.sampling.constraint.CopyFrom(constraint)
        try:
            sample = self.send(req)
        except grpc.RpcError as exc:
            return Outcome(None, error=f"{exc.code().name}: {exc.details()}")
        except RuntimeError as exc:
            return Outcome(None, error=str(exc))
        return Outcome(sample, sample.text, sample.finish_reason, forced_tokens(sample.stats.steps, sample))


# ------------------------------------------------------------------------------ the bench


@dataclass
class Run:
    name: str                 # "none", "ngram", "dflash (DFlash)", "auto (DFlash2)", "none free", "none matched"
    method: str
    draft: str | None         # the draft's label for dflash / auto
    variant: str              # constrained | free | matched
    runner: StructuredRunner


def draft_label(path: Path) -> str:
    try:
        arch = json.loads((path / "config.json").read_text()).get("architectures", [""])[0]
    except (OSError, ValueError, IndexError):
        arch = ""
    return {"DFlashDraftModel": "DFlash", "DFlash2DraftModel": "DFlash2"}.get(arch, path.name)


class StructuredBench:
    def __init__(self, args, argv):
        self.args, self.argv, self.skipped, self.runners = args, argv, [], []

    def resolve(self) -> None:
        from splitspec_tools.defaults import DEFAULT_TARGET, model_dir
        a = self.args
        for name, (default, smoke) in SIZES.items():
            if getattr(a, name) is None:
                setattr(a, name, smoke if a.smoke else default)
        if a.num_prompts < 1 or a.repeats < 1 or a.max_new_tokens < 1:
            raise SystemExit("--num-prompts, --repeats and --max-new-tokens must be >= 1")
        self.target_path = model_dir(a.target_model_path, DEFAULT_TARGET)
        if self.target_path is None or not (self.target_path / "config.json").is_file():
            raise SystemExit(f"no target model at {self.target_path or DEFAULT_TARGET} (--target-model-path)")
        self.methods = csv_items(a.methods)
        self.shapes = csv_items(a.shapes)
        self.temperatures = [float(t) for t in csv_items(a.temperatures)]
        if set(self.methods) - set(METHODS) or set(self.shapes) - set(SHAPES) or not self.shapes:
            raise SystemExit(f"--methods from {', '.join(METHODS)}; --shapes from {', '.join(SHAPES)}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise SystemExit("--temperatures: give one or more values >= 0")
        if "none" in self.methods:
            self.methods.remove("none")
        self.methods.insert(0, "none")
        self.drafts = []
        for d in csv_items(a.drafts):
            path = Path(d) if Path(d).is_absolute() else (model_dir(None, d) or Path(d))
            if not (path / "config.json").is_file():
                raise SystemExit(f"--drafts: no config.json in {path}")
            self.drafts.append((draft_label(path), path))
        if len({label for label, _ in self.drafts}) != len(self.drafts):
            self.drafts = [(f"{label}:{p.name}", p) for label, p in self.drafts]
        if not self.drafts:
            for m in [m for m in self.methods if m in ("dflash", "auto")]:
                self.methods.remove(m)
                self.skipped.append(f"{m}: no draft (--drafts)")
        self.draft_path = self.drafts[0][1] if self.drafts else None      # resolve_width reads it
        self.target_address = None

    def start_services(self) -> None:
        a = self.args
        logs = Path(a.out) / "logs"
        self.stack = stack = stacks.Stack(a, self.target_path, self.width, logs)
        target = stack.target()
        drafts = [(label, stack.draft(path, name=f"draft-{label}")) for label, path in self.drafts or [("ngram", None)]]
        log(f"starting target {target.address} and draft(s) {', '.join(f'{l} {p.address}' for l, p in drafts)} "
            f"(logs: {logs})")
        stack.wait(target, *(p for _, p in drafts))
        self.gateways = {label: stack.gateway(target.address, proc.address, name=f"gateway-{label}")
                         for label, proc in drafts}
        stack.wait(*self.gateways.values())
        self.target_address = target.address
        self.services = (f"target {target.address}; " + "; ".join(
            f"draft {label} {p.address} behind gateway {self.gateways[label].address}" for label, p in drafts))
        log(f"serving: {self.services}")

    def prepare_jobs(self) -> None:
        a = self.args
        prompts = default_prompts(a.num_prompts, max_chars=a.max_prompt_chars)
        if len(prompts) < a.num_prompts:
            log(f"only {len(prompts)} prompts available (asked for {a.num_prompts})")
        tok = stacks.tokenizer(self.target_path)
        limit = max(1, min(a.max_prompt_tokens, stacks.max_context(self.target_path) - a.max_new_tokens - self.width - 2))
        self.jobs = []
        for i, p in enumerate(prompts):
            job, text = make_job(i, p.id, p.text, self.shapes[i % len(self.shapes)])
            job.ids = tok.encode(text).ids[-limit:]
            self.jobs.append(job)
        self.prompt_source = "function cuts from installed third-party packages + one request line per shape"

    def make_runs(self) -> list[Run]:
        """Every run of a prompt in interleaving order: the target-only ones first (the cost's
        three back to back), then ngram, then dflash and auto per draft."""
        a = self.args
        first = next(iter(self.gateways.values())).address

        def runner(address, method):
            r = StructuredRunner(address, method, self.width, a.draft_sampling, a.timeout_s)
            self.runners.append(r)
            return r

        runs = [Run("none", "none", None, "constrained", runner(first, "none"))]
        if not a.no_cost:
            runs += [Run("none free", "none", None, "free", runner(first, "none")),
                     Run("none matched", "none", None, "matched", runner(first, "none"))]
        if "ngram" in self.methods:
            runs.append(Run("ngram", "ngram", None, "constrained", runner(first, "ngram")))
        for label in (self.gateways if self.drafts else []):
            for m in [m for m in self.methods if m in ("dflash", "auto")]:
                runs.append(Run(f"{m} ({label})", m, label, "constrained", runner(self.gateways[label].address, m)))
        return runs

    def warm_up(self, runs: list[Run]) -> None:
        """Every run once or twice, then every job's grammar compiled on the target and the drafts
        (their caches then serve the measured requests: the cost measured is the per-request one)."""
        job = self.jobs[0]
        for run in runs:
            constraint = job.constraint() if run.variant == "constrained" else None
            for t in sorted({0.0, *self.temperatures}):
                out = run.runner.send_one(job.ids, 8, sampling(t, self.args.top_p, 1), constraint, ignore_eos=run.variant == "matched")
                if out.error:
                    log(f"warm-up {run.name} T={t:g}: {out.error}")
        for job in self.jobs:
            for run in {r.draft: r for r in runs if r.variant == "constrained" and r.method != "ngram"}.values():
                run.runner.send_one(job.ids, 2, sampling(0.0, self.args.top_p, 0), job.constraint())

    def measure(self, runs: list[Run]) -> list[dict]:
        a = self.args
        rows = []
        for t in self.temperatures:
            for rep in range(a.repeats):
                for job in self.jobs:
                    params = sampling(t, self.args.top_p, a.seed + 1000 * rep + job.index)
                    got = {}
                    for run in runs:
                        max_new, constraint = a.max_new_tokens, job.constraint()
                        if run.variant != "constrained":
                            constraint = None
                        if run.variant == "matched":
                            ref = got.get("none")
                            if ref is None or ref.sample is None:
                                continue
                            max_new = len(ref.sample.tokens)
                        time.sleep(a.gap_s)
                        out = run.runner.send_one(job.ids, max_new, params, constraint, ignore_eos=run.variant == "matched")
                        got[run.name] = out
                        rows.append(self.row(t, rep, job, run, out))
                    log(f"T={t:g} rep {rep + 1}/{a.repeats} prompt {job.index + 1}/{len(self.jobs)} {job.shape}: "
                        + ", ".join(f"{n} {len(o.sample.tokens)} tok {o.finish_reason}" if o.sample else f"{n} ERROR"
                                    for n, o in got.items()))
        return rows

    def row(self, t: float, rep: int, job: Job, run: Run, out: Outcome) -> dict:
        r = {"temperature": t, "repeat": rep, "job": job.index, "prompt": job.prompt_id, "shape": job.shape,
             "kind": job.kind, "run": run.name, "method": run.method, "draft": run.draft, "variant": run.variant,
             "rpc_error": out.error}
        s = out.sample
        if s is None:
            return r
        valid = error = None
        if run.variant == "constrained":
            error = check_output(job.kind, job.spec, out.text)
            valid = error is None
        r.update({"tokens": len(s.tokens), "wall_s": round(s.wall_s, 6), "ttft_ms": round(s.ttft_s * 1e3, 3),
                  "decode_s": round(s.step_times[-1] - s.ttft_s, 6) if len(s.step_times) > 1 else 0.0,
                  "itl_ms": round(s.itl_s * 1e3, 3) if s.itl_s is not None else None,
                  "committed": s.committed, "verify_steps": s.verify_steps, "draft_tokens": s.draft_tokens,
                  "forced": out.forced, "steps_by_method": dict(s.steps_by_method),
                  "method_ran": s.method_ran, "draft_fallbacks": s.draft_fallbacks,
                  "finish_reason": out.finish_reason, "valid": valid, "invalid_reason": error,
                  "text": out.text if run.variant == "constrained" else None, "_ids": list(s.tokens)})
        return r

    def probe(self, runner: StructuredRunner, when: str) -> dict:
        """Unconstrained target-only requests (greedy, ignore_eos, PROBE_TOKENS new tokens) on every
        prompt: before any constrained request reached the services, and again after the run. The
        grammar must cost nothing on unconstrained requests, also after constrained ones ran."""
        a = self.args
        n = min(PROBE_TOKENS, a.max_new_tokens)
        if when == "before":
            runner.send_one(self.jobs[0].ids, 8, sampling(0.0, self.args.top_p, 0), None, ignore_eos=True)     # warm-up
        rows, errors = [], []
        for job in self.jobs:
            time.sleep(a.gap_s)
            out = runner.send_one(job.ids, n, sampling(0.0, self.args.top_p, 0), None, ignore_eos=True)
            if out.sample is None:
                errors.append(out.error)
                continue
            s = out.sample
            rows.append({"tokens": len(s.tokens), "wall_s": s.wall_s, "ttft_ms": s.ttft_s * 1e3,
                         "decode_s": (s.step_times[-1] - s.ttft_s) if len(s.step_times) > 1 else 0.0})
        out = {"when": when, "requests": len(rows), "errors": errors, "max_new_tokens": n,
               "decode_ms_per_token": _decode_ms_per_token(rows) if rows else None,
               "tokens_per_s": _rate(rows) if rows else None,
               "ttft_ms_p50": percentile([r["ttft_ms"] for r in rows], 50)}
        log(f"unconstrained probe {when}: decode {fmt(out['decode_ms_per_token'], '{:.2f}')} ms/token")
        return out

    def service_log_lines(self) -> list[str]:
        """Warning and error lines of the services' logs (the bench starts them at --log-level warning)."""
        out = []
        for p in self.stack.procs if self.stack else []:
            try:
                lines = p.log_path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            out += [f"{p.log_path.parent.name}: {line}" for line in lines
                    if re.search(r"warn|error|exception|traceback", line, re.IGNORECASE)]
        return out

    def run(self) -> dict:
        a = self.args
        started, t0 = datetime.now(timezone.utc), time.perf_counter()
        meta = metadata("splitspec bench-structured", self.argv)
        self.resolve()
        self.width = stacks.draft_width(self.draft_path, self.args.num_draft_tokens)
        self.stack = None
        try:
            self.start_services()
            self.prepare_jobs()
            runs = self.make_runs()
            log(f"{len(self.jobs)} prompts ({', '.join(self.shapes)}), runs {', '.join(r.name for r in runs)}, "
                f"T {', '.join(f'{t:g}' for t in self.temperatures)}, {a.repeats} repeat(s); warming up")
            probe_before = self.probe(runs[0].runner, "before")
            self.warm_up(runs)
            rows = self.measure(runs)
            probe_after = self.probe(runs[0].runner, "after")
        finally:
            for r in self.runners:
                r.close()
            log_lines = self.service_log_lines()
            if self.stack is not None:
                self.stack.stop()
        run_names = [r.name for r in runs]
        cells = summarize_cells(rows, run_names, self.temperatures, a.top_p)
        by_shape = summarize_shapes(rows, run_names, self.temperatures, self.shapes)
        cost = summarize_cost(rows, self.temperatures) if not a.no_cost else []
        for r in rows:
            r.pop("_ids", None)
        lengths = [len(j.ids) for j in self.jobs]
        results = {
            "meta": meta,
            "run": {"started": started.isoformat(timespec="seconds"), "duration_s": time.perf_counter() - t0,
                    "target_model": str(self.target_path),
                    "drafts": {label: str(p) for label, p in self.drafts}, "services": self.services,
                    "smoke": a.smoke, "methods": self.methods, "shapes": self.shapes, "temperatures": self.temperatures,
                    "top_p": a.top_p, "draft_sampling": a.draft_sampling, "num_prompts": len(self.jobs),
                    "repeats": a.repeats, "max_new_tokens": a.max_new_tokens, "num_draft_tokens": self.width,
                    "prompt_source": self.prompt_source, "prompt_digest": digest([j.ids for j in self.jobs]),
                    "prompt_tokens_mean": sum(lengths) / len(lengths), "seed": a.seed, "runs": run_names,
                    "gap_s": a.gap_s},
            "jobs": [{"index": j.index, "prompt": j.prompt_id, "shape": j.shape, "kind": j.kind, "spec": j.spec,
                      "prompt_tokens": len(j.ids)} for j in self.jobs],
            "cells": cells,
            "shapes": by_shape,
            "cost": cost,
            "unconstrained_probe": {"before": probe_before, "after": probe_after,
                                    "decode_ratio": ratio(probe_after["decode_ms_per_token"],
                                                           probe_before["decode_ms_per_token"])},
            "requests": rows,
            "service_log": log_lines[:200],
            "skipped": self.skipped,
        }
        results["flags"] = flags(results)
        return results


# ------------------------------------------------------------------------------ figures


def _rate(rows: list[dict]) -> float | None:
    wall = sum(r["wall_s"] for r in rows)
    return sum(r["tokens"] for r in rows) / wall if wall > 0 else None


def _per_repeat(rows: list[dict], fn) -> list:
    return [fn([r for r in rows if r["repeat"] == rep]) for rep in sorted({r["repeat"] for r in rows})]


def validity(rows: list[dict]) -> dict:
    """Over the answered requests: completed (not cut by max_new_tokens), valid among them."""
    ok = [r for r in rows if "tokens" in r]
    done = [r for r in ok if r["finish_reason"] != "length"]
    valid = [r for r in done if r["valid"]]
    return {"requests": len(rows), "errors": len(rows) - len(ok), "completed": len(done),
            "truncated": len(ok) - len(done), "valid": len(valid), "invalid": len(done) - len(valid),
            "validity": len(valid) / len(done) if done else None,
            "valid_share_of_all": len(valid) / len(rows) if rows else None}


def summarize_cells(rows: list[dict], runs: list[str], temps: list[float], top_p: float) -> list[dict]:
    """One cell per (temperature, constrained run)."""
    cells = []
    for t in temps:
        base = [r for r in rows if r["temperature"] == t and r["run"] == "none" and "tokens" in r]
        base_ids = {(r["repeat"], r["job"]): r["_ids"] for r in base}
        base_rate = dict(zip(sorted({r["repeat"] for r in base}), _per_repeat(base, _rate)))
        for name in runs:
            mine = [r for r in rows if r["temperature"] == t and r["run"] == name]
            if not mine or mine[0]["variant"] != "constrained":
                continue
            ok = [r for r in mine if "tokens" in r]
            rates = dict(zip(sorted({r["repeat"] for r in ok}), _per_repeat(ok, _rate)))
            cell = {"name": name, "method": mine[0]["method"], "draft": mine[0]["draft"], "temperature": t,
                    "top_p": top_p if t > 0 else None, **validity(mine),
                    "finish_reasons": dict(Counter(r["finish_reason"] for r in ok)),
                    "tokens_mean": sum(r["tokens"] for r in ok) / len(ok) if ok else None,
                    "tau": tau(ok) if mine[0]["method"] != "none" else None,
                    "tokens_per_s": median(rates.values()), "tokens_per_s_runs": list(rates.values()),
                    "speedup_vs_none": median([v / base_rate[k] for k, v in rates.items()
                                                if v and base_rate.get(k)]),
                    "ttft_ms_p50": percentile([r["ttft_ms"] for r in ok], 50),
                    "itl_ms_p50": percentile([r["itl_ms"] for r in ok if r["itl_ms"] is not None], 50),
                    "forced_share": _forced_share(ok) if mine[0]["method"] != "none" else None,
                    "forced_unknown": sum(1 for r in ok if r["forced"] is None),
                    "steps_by_method": dict(sum((Counter(r["steps_by_method"]) for r in ok), Counter())),
                    "method_mismatches": sum(1 for r in ok if r["method_ran"] and r["method_ran"] != r["method"]),
                    "draft_fallbacks": sum(r["draft_fallbacks"] for r in ok)}
            if t == 0:
                pairs = [(r["_ids"], base_ids.get((r["repeat"], r["job"]))) for r in ok]
                pairs = [(x, y) for x, y in pairs if y is not None]
                cell["equal_to_none"] = [sum(x == y for x, y in pairs), len(pairs)]
            else:
                cell["equal_to_none"] = None
            cells.append(cell)
    return cells


def summarize_shapes(rows: list[dict], runs: list[str], temps: list[float], shapes: list[str]) -> list[dict]:
    out = []
    for t in temps:
        for name in runs:
            for shape in shapes:
                mine = [r for r in rows if (r["temperature"], r["run"], r["shape"]) == (t, name, shape)
                        and r["variant"] == "constrained"]
                if not mine:
                    continue
                ok = [r for r in mine if "tokens" in r]
                out.append({"temperature": t, "name": name, "shape": shape, **validity(mine),
                            "tokens_mean": sum(r["tokens"] for r in ok) / len(ok) if ok else None,
                            "tau": tau(ok) if mine[0]["method"] != "none" else None,
                            "tokens_per_s": median(_per_repeat(ok, _rate)) if ok else None})
    return out


def forced_tokens(steps, sample: Sample) -> int | None:
    """Tokens the grammar forced in one answer: per verify step, its chunk's tokens - 1 (the bonus)
    - the drafter's own accepted nodes. None when the steps and the chunks after the first do
    not pair up one to one."""
    sizes = sample.step_sizes
    if len(steps) != len(sizes):
        return None
    return sum(max(0, n - 1 - s.accepted) for s, n in zip(steps, sizes) if s.method != "none")


def _forced_share(rows: list[dict]) -> float | None:
    rows = [r for r in rows if r["forced"] is not None]
    committed = sum(r["committed"] for r in rows)
    return sum(r["forced"] for r in rows) / committed if committed else None


def _decode_ms_per_token(rows: list[dict]) -> float | None:
    gaps = sum(r["tokens"] - 1 for r in rows if r["tokens"] > 1)
    return 1e3 * sum(r["decode_s"] for r in rows if r["tokens"] > 1) / gaps if gaps else None


def summarize_cost(rows: list[dict], temps: list[float]) -> list[dict]:
    """Per temperature: target-only, one stream, constrained vs the same request free and
    length-matched, over the (repeat, prompt) triples where all three answered."""
    out = []
    for t in temps:
        by = {}
        for r in rows:
            if r["temperature"] == t and r["method"] == "none" and "tokens" in r:
                by.setdefault((r["repeat"], r["job"]), {})[r["variant"]] = r
        trios = [v for v in by.values() if {"constrained", "free", "matched"} <= set(v)]
        if not trios:
            continue
        entry = {"temperature": t, "pairs": len(trios)}
        for variant in ("constrained", "free", "matched"):
            vs = [x[variant] for x in trios]
            entry[variant] = {"tokens_mean": sum(r["tokens"] for r in vs) / len(vs),
                              "decode_ms_per_token": _decode_ms_per_token(vs),
                              "tokens_per_s": median(_per_repeat(vs, _rate)),
                              "ttft_ms_p50": percentile([r["ttft_ms"] for r in vs], 50),
                              "finish_reasons": dict(Counter(r["finish_reason"] for r in vs))}
        c, f, m = (entry[v] for v in ("constrained", "free", "matched"))
        entry["lengths_equal"] = sum(x["constrained"]["tokens"] == x["matched"]["tokens"] for x in trios)
        for other, e in (("matched", m), ("free", f)):
            entry[f"decode_ms_ratio_vs_{other}"] = (c["decode_ms_per_token"] / e["decode_ms_per_token"]
                                                    if c["decode_ms_per_token"] and e["decode_ms_per_token"] else None)
            rate_pairs = [(_rate([x["constrained"] for x in trios if x["constrained"]["repeat"] == rep]),
                           _rate([x[other] for x in trios if x[other]["repeat"] == rep]))
                          for rep in sorted({x["constrained"]["repeat"] for x in trios})]
            entry[f"tokens_per_s_ratio_vs_{other}"] = median([a / b for a, b in rate_pairs if a and b])
        itl = [x["constrained"]["itl_ms"] / x["matched"]["itl_ms"] for x in trios
               if x["constrained"]["tokens"] >= MIN_ITL_TOKENS and x["matched"]["itl_ms"]]
        entry["itl_ratio_vs_matched_p50"] = median(itl)
        entry["itl_ratio_requests"] = len(itl)
        entry["grammar_cost_tokens_per_s"] = (1 - entry["tokens_per_s_ratio_vs_matched"]
                                              if entry["tokens_per_s_ratio_vs_matched"] else None)
        entry["grammar_cost_decode"] = (entry["decode_ms_ratio_vs_matched"] - 1
                                        if entry["decode_ms_ratio_vs_matched"] else None)
        out.append(entry)
    return out


def flags(r: dict) -> list[str]:
    """What looks wrong, in words (errors and invalid outputs quoted as they came)."""
    out = []
    for q in r["requests"]:
        where = f"T={q['temperature']:g} {q['run']} prompt {q['job']} ({q['shape']}, repeat {q['repeat'] + 1})"
        if q["rpc_error"]:
            out.append(f"{where}: error {q['rpc_error']!r}")
        elif q["valid"] is False and q["finish_reason"] != "length":
            out.append(f"{where}: invalid output ({q['invalid_reason']}), finish {q['finish_reason']}: {q['text']!r}")
    for c in r["cells"]:
        name = f"T={c['temperature']:g} {c['name']}"
        if c["truncated"]:
            out.append(f"{name}: {c['truncated']} of {c['requests']} answers cut at max_new_tokens (finish length)")
        odd = set(c["finish_reasons"]) - {"eos", "stop", "length"}
        if odd:
            out.append(f"{name}: finish reasons {sorted(odd)}")
        eq = c.get("equal_to_none")
        if eq and eq[0] < eq[1]:
            out.append(f"{name}: {eq[1] - eq[0]} of {eq[1]} greedy outputs differ from target-only (none) under "
                       "the same grammar")
        if c["method_mismatches"]:
            out.append(f"{name}: {c['method_mismatches']} request(s) ran another method than asked")
        if c["draft_fallbacks"]:
            out.append(f"{name}: {c['draft_fallbacks']} draft fallback(s)")
    probe = r["unconstrained_probe"]
    if probe["decode_ratio"] is not None and probe["decode_ratio"] > 1 + COST_LIMIT:
        out.append(f"unconstrained target-only requests decode {probe['decode_ratio']:.2f}x slower after the run's "
                   f"constrained requests than before them ({probe['before']['decode_ms_per_token']:.2f} -> "
                   f"{probe['after']['decode_ms_per_token']:.2f} ms/token): issue 41 wants the grammar to cost "
                   "nothing on unconstrained requests")
    for when in ("before", "after"):
        for err in probe[when]["errors"]:
            out.append(f"unconstrained probe {when}: error {err!r}")
    for e in r["cost"]:
        cost = e.get("grammar_cost_tokens_per_s")
        if cost is not None and cost > COST_LIMIT:
            out.append(f"T={e['temperature']:g}: the grammar costs {100 * cost:.1f} % tok/s against the same "
                       f"requests unconstrained at the same lengths (issue 41 allows {100 * COST_LIMIT:.0f} %)")
        decode = e.get("grammar_cost_decode")
        if decode is not None and decode > COST_LIMIT:
            out.append(f"T={e['temperature']:g}: decode ms/token is {100 * decode:.1f} % above the same requests "
                       "unconstrained at the same lengths")
        if e["lengths_equal"] < e["pairs"]:
            out.append(f"T={e['temperature']:g}: {e['pairs'] - e['lengths_equal']} length-matched request(s) did not "
                       "get the constrained answer's length")
    if r["service_log"]:
        out.append(f"{len(r['service_log'])} warning/error line(s) in the service logs (results.json service_log), "
                   f"first: {r['service_log'][0][:300]!r}")
    return out


# ------------------------------------------------------------------------------ markdown

CELL_COLUMNS = [
    ("method", lambda c: c["name"]),
    ("τ", lambda c: fmt(c["tau"])),
    ("tok/s", lambda c: fmt(c["tokens_per_s"], "{:.1f}")),
    ("× none", lambda c: fmt(c["speedup_vs_none"])),
    ("valid / completed", lambda c: f"{c['valid']}/{c['completed']}"),
    ("validity", lambda c: fmt(c["validity"], "{:.0%}")),
    ("cut (length)", lambda c: str(c["truncated"])),
    ("errors", lambda c: str(c["errors"])),
    ("finish reasons", lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c["finish_reasons"].items()))),
    ("tokens mean", lambda c: fmt(c["tokens_mean"], "{:.1f}")),
    ("TTFT p50 ms", lambda c: fmt(c["ttft_ms_p50"], "{:.0f}")),
    ("ITL p50 ms", lambda c: fmt(c["itl_ms_p50"])),
    ("forced", lambda c: fmt(c["forced_share"], "{:.1%}")),
    ("steps dflash/ngram/none", lambda c: mix_cell(c["steps_by_method"]) if c["method"] == "auto" else "–"),
    ("= none", lambda c: "–" if c["equal_to_none"] is None else "/".join(map(str, c["equal_to_none"]))),
]


def markdown(r: dict) -> str:
    meta, run = r["meta"], r["run"]
    lines = header("splitspec bench-structured", meta)[:-1] + [
             f"- target: `{run['target_model']}`; drafts: " + (", ".join(f"{k} `{v}`" for k, v in run["drafts"].items())
                                                             or "none") + f"; verify width {run['num_draft_tokens']}",
             f"- services: {run['services']}",
             f"- prompts: {run['num_prompts']} ({run['prompt_source']}, digest {run['prompt_digest']}, "
             f"{run['prompt_tokens_mean']:.0f} tokens on average); shapes {', '.join(run['shapes'])} in turn; "
             f"max_new_tokens {run['max_new_tokens']}, eos honoured; repeats {run['repeats']}; drafts at T > 0: "
             f"{run['draft_sampling']}; runs interleaved per prompt, {run['gap_s']:g} s pause before each request",
             f"- started {run['started']}, took {run['duration_s']:.0f} s"]
    for t in run["temperatures"]:
        cells = [c for c in r["cells"] if c["temperature"] == t]
        title = "temperature 0 (greedy)" if t == 0 else f"temperature {t:g}, top_p {run['top_p']:g}"
        lines += ["", f"## {title}", ""]
        lines += table([h for h, _ in CELL_COLUMNS], [[f(c) for _, f in CELL_COLUMNS] for c in cells])
        shapes = [s for s in r["shapes"] if s["temperature"] == t]
        names = list(dict.fromkeys(s["name"] for s in shapes))
        lines += ["", "τ (validity) by shape:", ""]
        rows = []
        for shape in run["shapes"]:
            row = [shape]
            for n in names:
                s = next((x for x in shapes if (x["name"], x["shape"]) == (n, shape)), None)
                row.append("–" if s is None else f"{fmt(s['tau'])} ({s['valid']}/{s['completed']}"
                           + (f", {s['truncated']} cut" if s["truncated"] else "") + ")")
            rows.append(row)
        lines += table(["shape", *names], rows)
    if r["cost"]:
        lines += ["", "## The grammar's cost (target-only, one stream)", ""]
        rows = []
        for e in r["cost"]:
            for v in ("constrained", "free", "matched"):
                x = e[v]
                rows.append([f"{e['temperature']:g}", v, fmt(x["tokens_mean"], "{:.1f}"),
                             fmt(x["decode_ms_per_token"], "{:.3f}"), fmt(x["tokens_per_s"], "{:.1f}"),
                             fmt(x["ttft_ms_p50"], "{:.1f}"),
                             ", ".join(f"{k} {n}" for k, n in sorted(x["finish_reasons"].items()))])
        lines += table(["T", "requests", "tokens mean", "decode ms/token", "tok/s", "TTFT p50 ms", "finish"], rows)
        lines += [""]
        lines += table(["T", "pairs", "decode ms/token ÷ matched", "tok/s ÷ matched", "ITL ÷ matched p50 (n)",
                        "decode ms/token ÷ free", "tok/s ÷ free", "cost: tok/s vs matched", "cost: decode ms/token"],
                       [[f"{e['temperature']:g}", str(e["pairs"]), fmt(e["decode_ms_ratio_vs_matched"], "{:.3f}"),
                         fmt(e["tokens_per_s_ratio_vs_matched"], "{:.3f}"),
                         f"{fmt(e['itl_ratio_vs_matched_p50'], '{:.3f}')} ({e['itl_ratio_requests']})",
                         fmt(e["decode_ms_ratio_vs_free"], "{:.3f}"), fmt(e["tokens_per_s_ratio_vs_free"], "{:.3f}"),
                         fmt(e["grammar_cost_tokens_per_s"], "{:.1%}"), fmt(e["grammar_cost_decode"], "{:.1%}")]
                        for e in r["cost"]])
        lines += ["", "constrained = the none cell's requests; free = the same requests without the constraint "
                  "(same prompt, seed and max_new_tokens, eos honoured: free text, most run to max_new_tokens); "
                  "matched = without the constraint, ignore_eos, max_new_tokens = the constrained answer's token "
                  "count (the same decoding work at the same positions). decode ms/token = Σ (t_last − t_first) ÷ "
                  "Σ (n − 1); tok/s = output tokens ÷ wall time, median over repeats; ratios of tok/s are medians "
                  f"of the repeats' paired ratios; ITL ratio over answers of ≥ {MIN_ITL_TOKENS} tokens; cost: "
                  "tok/s = 1 − tok/s ÷ matched's (TTFT included), decode = decode ms/token ÷ matched's − 1."]
    probe = r["unconstrained_probe"]
    lines += ["", "## Unconstrained requests before and after the constrained ones", ""]
    lines += table(["when", "requests", "decode ms/token", "tok/s", "TTFT p50 ms"],
                   [[p["when"], str(p["requests"]), fmt(p["decode_ms_per_token"], "{:.3f}"),
                     fmt(p["tokens_per_s"], "{:.1f}"), fmt(p["ttft_ms_p50"], "{:.1f}")]
                    for p in (probe["before"], probe["after"])])
    lines += ["", f"after ÷ before (decode ms/token): {fmt(probe['decode_ratio'], '{:.3f}')}. Each prompt once, "
              f"target-only, greedy, ignore_eos, {probe['before']['max_new_tokens']} new tokens, no constraint: "
              "before = right after the services started (before any constrained request), after = once the "
              "run is over, on the same services."]
    lines += ["", "## Sample outputs (first repeat, T = first temperature, none)", ""]
    t0 = run["temperatures"][0]
    seen = set()
    rows = []
    for q in r["requests"]:
        if q["temperature"] == t0 and q["run"] == "none" and q["repeat"] == 0 and q["shape"] not in seen \
                and q.get("text") is not None:
            seen.add(q["shape"])
            text = q["text"] if len(q["text"]) <= 160 else q["text"][:157] + "…"
            text = text.replace("|", "\\|").replace("`", "'").replace("\n", "⏎")
            rows.append([q["shape"], q["prompt"], f"`{text}`",
                         q["finish_reason"], "yes" if q["valid"] else "no"])
    lines += table(["shape", "prompt", "output", "finish", "valid"], rows)
    lines += ["", "## Flags", ""]
    lines += [f"- {f}" for f in r["flags"][:60]] or ["- none"]
    if len(r["flags"]) > 60:
        lines.append(f"- … {len(r['flags']) - 60} more in results.json")
    if r["skipped"]:
        lines += ["", "Not run: " + "; ".join(r["skipped"])]
    lines += ["", "Columns: τ = committed tokens ÷ verify steps (accepted drafts + bonus, forced tokens included; "
              "the prefill's token not counted), pooled over the repeats; tok/s = output tokens ÷ wall time over "
              "the cell's requests (eos honoured, so answers differ in length between methods at T > 0), median "
              "over the repeats; × none = the median of the repeats' paired tok/s ratios to none; validity = "
              "outputs that parse and validate (JSON Schema subset: type, properties, required, "
              "additionalProperties, enum, const, minimum/maximum, min/maxLength, maxItems, items; regex full "
              "match; choice equality) ÷ completed answers; cut = answers that reached max_new_tokens (finish "
              "length: unfinished, not counted in validity); steps dflash/ngram/none = auto's choices, share of "
              "its steps; forced = tokens the grammar forced (jump-forward) ÷ committed tokens: per verify step, its "
              "chunk's tokens − 1 − the drafter's own accepted nodes (SpeculativeStep.accepted); a lower bound "
              "(the last chunk stops at eos); = none: "
              "greedy outputs equal to none's, token for token, under the same grammar.", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    results = StructuredBench(args, argv).run()
    write(Path(args.out), results, markdown(results))
    return 0


cli_main = cli(main)
