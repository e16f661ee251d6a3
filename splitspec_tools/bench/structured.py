"""`splitspec bench-structured`: structured outputs through the real services (issue 41): held-out
prompts, each followed by a line asking for one constrained shape (JSON schemas, a tool call,
regexes, a choice), through every speculative method in turn at T=0 and T=1. Reported per cell: τ,
tok/s against none, validity (valid ÷ completed answers), finish reasons and the share of tokens
the grammar forced; and the grammar's cost: constrained `none` requests against the same requests
unconstrained at the same lengths, and unconstrained requests before and after. See docs/benchmarks.md.

    splitspec bench-structured                                # defaults, ~8 min on 2 cores
    splitspec bench-structured --smoke                        # 2 prompts, 1 repeat, dflash only
    splitspec bench-structured --methods none,dflash --temperatures 0 --shapes flat,tool
"""
from __future__ import annotations

import ast
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from splitspec.v1 import common_pb2

from . import stack as stacks
from .client import Gateway, sampling
from .harness import (apply_sizes, columns, csv_items, entry, fmt, header, interleave, log, median, metadata, mix_cell,
                      paired, ratio, summary, table, tail, tau)
from .prompts import default_prompts, digest

SHAPES = ("flat", "nested", "strings", "tool", "identifier", "version", "choice")
METHODS = ("none", "ngram", "dflash", "auto")
DRAFTS = ("models/splitspec-code-draft-dflash", "models/splitspec-code-draft")
# (default, --smoke); explicit flags win.
SIZES = {"num_prompts": (21, 2), "repeats": (3, 1), "max_new_tokens": (128, 80),
         "methods": (",".join(METHODS), "dflash"), "shapes": (",".join(SHAPES), "flat,choice"),
         "drafts": (",".join(DRAFTS), DRAFTS[0]), "temperatures": ("0,1", "0,1")}
COST_LIMIT = 0.10          # issue 41: the grammar may cost at most this share of tok/s (target-only)
PROBE_TOKENS = 32          # new tokens of each unconstrained probe request (before and after the run)


def add_flags(a) -> None:
    a("--smoke", action="store_true", help="2 prompts (flat, choice), 1 repeat, dflash with the first draft only, "
      "80 new tokens: a quick end-to-end check; sizes given explicitly still win")
    a("--drafts", default=None, help=f"draft folders, comma-separated: a service and gateway each [{SIZES['drafts'][0]}]")
    a("--methods", default=None, help=f"from {', '.join(METHODS)}; none always runs [all]")
    a("--shapes", default=None, help=f"constraint shapes, from {', '.join(SHAPES)}; they take turns over the prompts")
    a("--temperatures", default=None, help="comma-separated [0,1]; top_p applies when > 0")
    a("--draft-sampling", default="greedy", choices=["greedy", "sample"], help="drafts at temperature > 0")
    a("--num-prompts", type=int, default=None, help="prompts, each with one shape [21; smoke 2]")
    a("--max-prompt-chars", type=int, default=1500, help="context kept before each default cut")
    a("--max-prompt-tokens", type=int, default=512, help="longer prompts keep their last tokens")
    a("--max-new-tokens", type=int, default=None, help="max_new_tokens of every request [128; smoke 80]")
    a("--repeats", type=int, default=None, help="times every prompt runs through every method [3; smoke 1]")
    a("--no-cost", action="store_true", help="skip the length-matched unconstrained requests")
    a("--gap-s", type=float, default=0.1, help="pause before every measured request, so that work still in flight "
      "from the previous one (a decode run past its eos) does not land on this one's TTFT")
    stacks.add_flags(a, request_timeout_s=600.0, out="bench-out/structured")


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
          "identifier": "\n\ndef ", "version": '\n\n__version__ = "',
          "choice": "\n\n# Category of the function above (" + ", ".join(CHOICES[:-1]) + f" or {CHOICES[-1]}): "}


def signature(text: str, name: str, limit: int = 4) -> list[tuple[str, str | None, str | None]]:
    """(parameter, annotation, default) of the last `def name(...)` in text, without self / cls
    and * / ** parameters, at most `limit`; [] when it cannot be found. The signature ends at the
    first colon up to which it parses."""
    start = text.rfind(f"def {name}(")
    for end in (i for i in range(start, len(text)) if text[i] == ":" and start >= 0):
        try:
            a = ast.parse(text[start:end + 1] + " ...").body[0].args
        except SyntaxError:
            continue
        plain = a.posonlyargs + a.args
        defaults = [None] * (len(plain) - len(a.defaults)) + a.defaults + a.kw_defaults
        return [(p.arg, p.annotation and ast.unparse(p.annotation), d and ast.unparse(d))
                for p, d in zip(plain + a.kwonlyargs, defaults) if p.arg not in ("self", "cls")][:limit]
    return []


def param_schema(annotation: str | None, default: str | None) -> dict:
    ann = (annotation or "").strip()
    if default in ("True", "False") or ann == "bool":
        return {"type": "boolean"}
    if (default is not None and re.fullmatch(r"\d+", default)) or ann == "int":
        return {"type": "integer", "minimum": 0, "maximum": 1000}
    return {"type": "string", "maxLength": 24}


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
                  "strings": ("json_schema", STRINGS), "identifier": ("regex", IDENTIFIER),
                  "version": ("regex", VERSION), "choice": ("choice", CHOICES),
                  "tool": ("json_schema", _obj({"name": {"const": fn}, "arguments": _obj(
                      {p: param_schema(ann, d) for p, ann, d in signature(text, fn)})}))}[shape]
    return Job(index, prompt_id, shape, kind, spec), text.rstrip("\n") + SUFFIX[shape]


def schema_errors(value, schema: dict) -> list[str]:
    """What is wrong with `value` against `schema`, by the `jsonschema` package (draft 2020-12)."""
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        raise SystemExit("bench-structured checks answers with jsonschema: pip install -e '.[bench]'") from None
    return ["$" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in e.absolute_path) + f": {e.message}"
            for e in sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))]


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if dup := sorted({k for k in keys if keys.count(k) > 1}):
        raise ValueError(f"duplicate key(s) {dup}")
    return dict(pairs)


def check_output(kind: str, spec, text: str) -> str | None:
    """None when `text` is valid against the constraint, else what is wrong."""
    if kind == "regex":
        return None if re.fullmatch(spec, text) else f"does not match /{spec}/"
    if kind == "choice":
        return None if text in spec else f"not one of {spec}"
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        # RFC 8259 forbids raw control characters in strings: said apart, since a lenient parser takes them.
        try:
            json.loads(text, strict=False, object_pairs_hook=_no_duplicates)
        except ValueError:
            return f"not JSON: {exc}"
        return f"not JSON (RFC 8259): a raw control character in a string: {exc}"
    errs = schema_errors(value, spec)
    return "; ".join(errs[:3]) if errs else None


@dataclass
class Run:
    name: str                 # "none", "ngram", "dflash (DFlash)", "auto (DFlash2)", "none matched"
    method: str
    draft: str | None
    variant: str              # constrained | matched
    gateway: Gateway


def send(run: Run, ids: list[int], max_new: int, params, constraint=None, ignore_eos: bool = False):
    """(sample, error): one request, a constraint (or none), eos honoured unless asked."""
    req = run.gateway.request(ids, max_new, params, ignore_eos=ignore_eos)
    if constraint is not None:
        req.sampling.constraint.CopyFrom(constraint)
    try:
        return run.gateway.send(req), None
    except grpc.RpcError as exc:
        return None, f"{exc.code().name}: {exc.details()}"


def forced_tokens(sample) -> int | None:
    """Tokens the grammar forced in one answer: per verify step, the chunk's tokens − 1 (the bonus) −
    the drafter's own accepted nodes (a lower bound: the last chunk stops at eos); None when the steps
    and the chunks do not pair up."""
    steps = sample.stats.steps
    if len(steps) != len(sample.step_sizes):
        return None
    return sum(max(0, n - 1 - s.accepted) for s, n in zip(steps, sample.step_sizes) if s.method != "none")


class StructuredBench:
    def __init__(self, a, argv):
        from splitspec_tools.defaults import model_dir
        self.args, self.argv, self.skipped = a, argv, []
        apply_sizes(a, SIZES)
        if min(a.num_prompts, a.repeats, a.max_new_tokens) < 1:
            raise SystemExit("--num-prompts, --repeats and --max-new-tokens must be >= 1")
        self.target_path, _ = stacks.models(a.target_model_path, "none")
        self.methods = ["none", *[m for m in csv_items(a.methods) if m != "none"]]
        self.shapes, self.temperatures = csv_items(a.shapes), [float(t) for t in csv_items(a.temperatures)]
        if set(self.methods) - set(METHODS) or set(self.shapes) - set(SHAPES) or not self.shapes or not self.temperatures:
            raise SystemExit(f"--methods from {', '.join(METHODS)}; --shapes from {', '.join(SHAPES)}; --temperatures")
        paths = [Path(d) if Path(d).is_absolute() else (model_dir(None, d) or Path(d)) for d in csv_items(a.drafts)]
        labels = {"DFlashDraftModel": "DFlash", "DFlash2DraftModel": "DFlash2"}
        self.drafts = [(labels.get(stacks.architecture(p, "--drafts"), p.name), p) for p in paths]
        if len({label for label, _ in self.drafts}) != len(self.drafts):
            self.drafts = [(f"{label}:{p.name}", p) for label, p in self.drafts]
        if not self.drafts:
            self.skipped += [f"{m}: no draft (--drafts)" for m in self.methods if m in ("dflash", "auto")]
            self.methods = [m for m in self.methods if m not in ("dflash", "auto")]
        self.width = stacks.draft_width(self.drafts[0][1] if self.drafts else None, a.num_draft_tokens)
        self.stack = stacks.Stack(a, self.target_path, self.width, Path(a.out) / "logs")

    def start(self) -> None:
        stack, target = self.stack, self.stack.target()
        drafts = [(label, stack.draft(path, name=f"draft-{label}")) for label, path in self.drafts or [("ngram", None)]]
        stack.wait(target, *(p for _, p in drafts))
        self.gateways = {label: stack.gateway(target.address, p.address, name=f"gateway-{label}") for label, p in drafts}
        stack.wait(*self.gateways.values())
        self.services = f"target {target.address}; " + "; ".join(
            f"draft {label} {p.address} behind gateway {self.gateways[label].address}" for label, p in drafts)
        log(f"serving: {self.services}")

    def jobs_(self) -> list[Job]:
        a = self.args
        tok, jobs = stacks.tokenizer(self.target_path), []
        limit = max(1, min(a.max_prompt_tokens, stacks.max_context(self.target_path) - a.max_new_tokens - self.width - 2))
        for i, p in enumerate(default_prompts(a.num_prompts, max_chars=a.max_prompt_chars)):
            job, text = make_job(i, p.id, p.text, self.shapes[i % len(self.shapes)])
            job.ids = tok.encode(text).ids[-limit:]
            jobs.append(job)
        return jobs

    def runs(self) -> list[Run]:
        """Every run of a prompt in interleaving order: none (and its length-matched twin), ngram, then
        dflash and auto per draft."""
        a, first = self.args, next(iter(self.gateways.values())).address
        gw = lambda address, method: Gateway(address, method, self.width, a.draft_sampling, a.timeout_s)  # noqa: E731
        runs = [Run("none", "none", None, "constrained", gw(first, "none"))]
        if not a.no_cost:
            runs.append(Run("none matched", "none", None, "matched", gw(first, "none")))
        if "ngram" in self.methods:
            runs.append(Run("ngram", "ngram", None, "constrained", gw(first, "ngram")))
        for label in (self.gateways if self.drafts else []):
            runs += [Run(f"{m} ({label})", m, label, "constrained", gw(self.gateways[label].address, m))
                     for m in self.methods if m in ("dflash", "auto")]
        return runs

    def warm_up(self, runs: list[Run], jobs: list[Job]) -> None:
        """Every run once per temperature, then every job's grammar compiled on the target and the
        drafts (their caches then serve the measured requests: the cost measured is per request)."""
        for run in runs:
            for t in sorted({0.0, *self.temperatures}):
                _, err = send(run, jobs[0].ids, 8, sampling(t, self.args.top_p, 1),
                              jobs[0].constraint() if run.variant == "constrained" else None, run.variant == "matched")
                if err:
                    log(f"warm-up {run.name} T={t:g}: {err}")
        for job in jobs:
            for run in {r.draft: r for r in runs if r.variant == "constrained" and r.method != "ngram"}.values():
                send(run, job.ids, 2, sampling(0.0, 1.0, 0), job.constraint())

    def measure(self, runs: list[Run], jobs: list[Job]) -> list[dict]:
        """Every job through every run in turn (harness.interleave); the matched twin asks for as many
        tokens as none's answer to the same request, and is skipped where none's failed."""
        a, rows, ref = self.args, [], {}
        for t in self.temperatures:
            def one(run, job, params):
                matched = run.variant == "matched"
                if matched and ref["none"] is None:
                    return None
                time.sleep(a.gap_s)
                ref[run.name], err = send(run, job.ids, len(ref["none"].tokens) if matched else a.max_new_tokens, params,
                                          None if matched else job.constraint(), ignore_eos=matched)
                return run, ref[run.name], err

            def after(rep, i, out):
                rows.extend(row(t, rep, jobs[i], *o[-1]) for o in out if o[-1])
                log(f"T={t:g} rep {rep + 1}/{a.repeats} prompt {i + 1}/{len(jobs)} {jobs[i].shape}")
            interleave(runs, jobs, a.repeats, one, t, a.top_p, a.seed, after)
        return rows

    def probe(self, run: Run, jobs: list[Job], when: str) -> dict:
        """Unconstrained target-only requests (greedy, ignore_eos) on every prompt, before any
        constrained request reached the services and again after the run."""
        n, samples, errors = min(PROBE_TOKENS, self.args.max_new_tokens), [], []
        send(run, jobs[0].ids, 8, sampling(0.0, 1.0, 0), ignore_eos=True)                 # warm-up
        for job in jobs:
            time.sleep(self.args.gap_s)
            sample, err = send(run, job.ids, n, sampling(0.0, 1.0, 0), ignore_eos=True)
            errors.append(err) if err else samples.append(sample)
        s = summary(samples)
        out = {"when": when, "requests": len(samples), "errors": errors, "max_new_tokens": n,
               "decode_ms_per_token": decode_ms(samples), **{k: s[k] for k in ("tokens_per_s", "ttft_ms_p50")}}
        log(f"unconstrained probe {when}: decode {fmt(out['decode_ms_per_token'])} ms/token")
        return out

    def run(self) -> dict:
        a, t0, meta = self.args, time.perf_counter(), metadata("splitspec bench-structured", self.argv)
        try:
            self.start()
            jobs, runs = self.jobs_(), self.runs()
            before = self.probe(runs[0], jobs, "before")
            self.warm_up(runs, jobs)
            rows = self.measure(runs, jobs)
            after = self.probe(runs[0], jobs, "after")
        finally:
            self.stack.stop()
        names = [r.name for r in runs]
        results = {
            "meta": meta,
            "run": {"duration_s": time.perf_counter() - t0, "target_model": str(self.target_path),
                    "drafts": {label: str(p) for label, p in self.drafts}, "services": self.services, "smoke": a.smoke,
                    "methods": self.methods, "shapes": self.shapes, "temperatures": self.temperatures, "top_p": a.top_p,
                    "draft_sampling": a.draft_sampling, "num_prompts": len(jobs), "repeats": a.repeats,
                    "max_new_tokens": a.max_new_tokens, "num_draft_tokens": self.width,
                    "prompt_digest": digest([j.ids for j in jobs]),
                    "prompt_tokens_mean": sum(len(j.ids) for j in jobs) / len(jobs), "runs": names, "gap_s": a.gap_s},
            "jobs": [{"index": j.index, "prompt": j.prompt_id, "shape": j.shape, "kind": j.kind, "spec": j.spec,
                      "prompt_tokens": len(j.ids)} for j in jobs],
            "cells": summarize_cells(rows, names, self.temperatures),
            "shapes": summarize_shapes(rows, names, self.temperatures, self.shapes),
            "cost": summarize_cost(rows, self.temperatures),
            "unconstrained_probe": {"before": before, "after": after,
                                    "decode_ratio": ratio(after["decode_ms_per_token"], before["decode_ms_per_token"])},
            "requests": rows, "skipped": self.skipped}
        for r in rows:
            r.pop("_s", None)
        results["flags"] = flags(results)
        return results


def row(t: float, rep: int, job: Job, run: Run, s, error: str | None) -> dict:
    r = {"temperature": t, "repeat": rep, "job": job.index, "prompt": job.prompt_id, "shape": job.shape,
         "run": run.name, "method": run.method, "draft": run.draft, "variant": run.variant, "rpc_error": error}
    if s is None:
        return r
    invalid = check_output(job.kind, job.spec, s.text) if run.variant == "constrained" else None
    return {**r, "tokens": len(s.tokens), "wall_s": round(s.wall_s, 6), "ttft_ms": round(s.ttft_s * 1e3, 3),
            "decode_s": round(s.step_times[-1] - s.ttft_s, 6), "itl_ms": s.itl_s * 1e3 if s.itl_s is not None else None,
            "committed": s.committed,
            "verify_steps": s.verify_steps, "forced": forced_tokens(s), "steps_by_method": dict(s.steps_by_method),
            "method_ran": s.method_ran, "draft_fallbacks": s.draft_fallbacks, "finish_reason": s.finish_reason,
            "valid": invalid is None if run.variant == "constrained" else None, "invalid_reason": invalid,
            "text": s.text if run.variant == "constrained" else None, "_s": s}


def decode_ms(samples) -> float | None:
    """Σ (t_last − t_first) ÷ Σ (n − 1): decode time per token, TTFT left out."""
    gaps = sum(len(s.tokens) - 1 for s in samples)
    return 1e3 * sum(s.step_times[-1] - s.ttft_s for s in samples) / gaps if gaps else None


def per_repeat(rows: list[dict]) -> dict[int, float]:
    """tok/s of each repeat's requests."""
    return {rep: summary([r["_s"] for r in rows if r["repeat"] == rep])["tokens_per_s"]
            for rep in sorted({r["repeat"] for r in rows})}


def validity(rows: list[dict]) -> dict:
    """Over the answered requests: completed (not cut by max_new_tokens), valid among them."""
    ok = [r for r in rows if "tokens" in r]
    done = [r for r in ok if r["finish_reason"] != "length"]
    valid = sum(1 for r in done if r["valid"])
    return {"requests": len(rows), "errors": len(rows) - len(ok), "completed": len(done),
            "truncated": len(ok) - len(done), "valid": valid, "validity": valid / len(done) if done else None}


def summarize_cells(rows: list[dict], runs: list[str], temps: list[float]) -> list[dict]:
    """One cell per (temperature, constrained run)."""
    cells = []
    for t in temps:
        base = [r for r in rows if r["temperature"] == t and r["run"] == "none" and "tokens" in r]
        base_ids, base_rate = {(r["repeat"], r["job"]): r["_s"].tokens for r in base}, per_repeat(base)
        for name in runs:
            mine = [r for r in rows if r["temperature"] == t and r["run"] == name and r["variant"] == "constrained"]
            if not mine:
                continue
            ok, method = [r for r in mine if "tokens" in r], mine[0]["method"]
            s, spec, rates = summary([r["_s"] for r in ok], method), method != "none", per_repeat(ok)
            known = [r for r in ok if r["forced"] is not None]      # forced_tokens paired the steps and the chunks
            forced = ratio(sum(r["forced"] for r in known), sum(r["committed"] for r in known)) if spec else None
            pairs = [(r["_s"].tokens, base_ids[(r["repeat"], r["job"])]) for r in ok if (r["repeat"], r["job"]) in base_ids]
            cells.append({
                "name": name, "method": method, "draft": mine[0]["draft"], "temperature": t, **validity(mine),
                "finish_reasons": dict(Counter(r["finish_reason"] for r in ok)),
                "tokens_mean": ratio(s["tokens"], len(ok)), "tau": s["tau"] if spec else None,
                "tokens_per_s": median(rates.values()), "speedup_vs_none": paired(rates, base_rate),
                "ttft_ms_p50": s["ttft_ms_p50"], "forced_share": forced, "forced_unknown": len(ok) - len(known),
                **{k: s[k] for k in ("steps_by_method", "method_mismatches", "draft_fallbacks")},
                "equal_to_none": [sum(x == y for x, y in pairs), len(pairs)] if t == 0 else None})
    return cells


def summarize_shapes(rows: list[dict], runs: list[str], temps: list[float], shapes: list[str]) -> list[dict]:
    by: dict = {}
    for r in rows:
        if r["variant"] == "constrained":
            by.setdefault((r["temperature"], r["run"], r["shape"]), []).append(r)
    return [{"temperature": t, "name": name, "shape": shape, **validity(mine),
             "tau": tau([r for r in mine if "tokens" in r]) if mine[0]["method"] != "none" else None}
            for t in temps for name in runs for shape in shapes if (mine := by.get((t, name, shape)))]


def summarize_cost(rows: list[dict], temps: list[float]) -> list[dict]:
    """Per temperature: target-only, one stream, each constrained answer against the same request
    unconstrained at the same length; over the (repeat, prompt) pairs where both answered."""
    out = []
    for t in temps:
        by: dict = {}
        for r in rows:
            if r["temperature"] == t and r["method"] == "none" and "tokens" in r:
                by.setdefault((r["repeat"], r["job"]), {})[r["variant"]] = r
        pairs = [v for v in by.values() if {"constrained", "matched"} <= set(v)]
        if not pairs:
            continue
        e = {"temperature": t, "pairs": len(pairs),
             "lengths_equal": sum(x["constrained"]["tokens"] == x["matched"]["tokens"] for x in pairs)}
        rates = {v: per_repeat([x[v] for x in pairs]) for v in ("constrained", "matched")}
        for v, samples in ((v, [x[v]["_s"] for x in pairs]) for v in rates):
            s = summary(samples)
            e[v] = {"tokens_mean": s["tokens"] / len(samples), "decode_ms_per_token": decode_ms(samples),
                    "tokens_per_s": median(rates[v].values()), "ttft_ms_p50": s["ttft_ms_p50"]}
        rate = e["tokens_per_s_ratio_vs_matched"] = paired(rates["constrained"], rates["matched"])
        decode = ratio(e["constrained"]["decode_ms_per_token"], e["matched"]["decode_ms_per_token"])
        e.update(decode_ms_ratio_vs_matched=decode, grammar_cost_tokens_per_s=1 - rate if rate else None,
                 grammar_cost_decode=decode - 1 if decode else None)
        out.append(e)
    return out


def flags(r: dict) -> list[str]:
    """What looks wrong, in words (errors and invalid outputs quoted as they came)."""
    out = []
    for q in r["requests"]:
        where = f"T={q['temperature']:g} {q['run']} prompt {q['job']} ({q['shape']}, repeat {q['repeat'] + 1})"
        if q["rpc_error"]:
            out.append(f"{where}: error {q['rpc_error']!r}")
        elif q["valid"] is False and q["finish_reason"] != "length":
            out.append(f"{where}: invalid ({q['invalid_reason']}), finish {q['finish_reason']}: {q['text']!r}")
    for c in r["cells"]:
        name, eq = f"T={c['temperature']:g} {c['name']}", c["equal_to_none"]
        if c["truncated"]:
            out.append(f"{name}: {c['truncated']} of {c['requests']} answers cut at max_new_tokens")
        if eq and eq[0] < eq[1]:
            out.append(f"{name}: {eq[1] - eq[0]} of {eq[1]} greedy outputs differ from none's under the same grammar")
        if c["method_mismatches"] or c["draft_fallbacks"]:
            out.append(f"{name}: {c['method_mismatches']} request(s) ran another method, {c['draft_fallbacks']} "
                       "draft fallback(s)")
    probe = r["unconstrained_probe"]
    if (probe["decode_ratio"] or 0) > 1 + COST_LIMIT:
        out.append(f"unconstrained requests decode {probe['decode_ratio']:.2f}x slower after the constrained ones "
                   "than before: the grammar must cost nothing on unconstrained requests")
    out += [f"unconstrained probe {w}: error {e!r}" for w in ("before", "after") for e in probe[w]["errors"]]
    for e in r["cost"]:
        if (e["grammar_cost_tokens_per_s"] or 0) > COST_LIMIT:
            out.append(f"T={e['temperature']:g}: the grammar costs {e['grammar_cost_tokens_per_s']:.1%} tok/s "
                       f"(issue 41 allows {COST_LIMIT:.0%})")
        if e["lengths_equal"] < e["pairs"]:
            out.append(f"T={e['temperature']:g}: {e['pairs'] - e['lengths_equal']} matched request(s) got another length")
    return out


def markdown(r: dict) -> str:
    run = r["run"]
    drafts = ", ".join(f"{k} `{v}`" for k, v in run["drafts"].items()) or "none"
    lines = header("splitspec bench-structured", r["meta"],
                   f"target: `{run['target_model']}`; drafts: {drafts}; verify width {run['num_draft_tokens']}",
                   f"services: {run['services']}",
                   f"prompts: {run['num_prompts']} (function cuts + one request line per shape, digest "
                   f"{run['prompt_digest']}, {run['prompt_tokens_mean']:.0f} tokens on average); shapes "
                   f"{', '.join(run['shapes'])} in turn; max_new_tokens {run['max_new_tokens']}, eos honoured; repeats "
                   f"{run['repeats']}; drafts at T > 0: {run['draft_sampling']}; took {run['duration_s']:.0f} s")
    cell = lambda s: "–" if s is None else f"{fmt(s['tau'])} ({s['valid']}/{s['completed']})"  # noqa: E731
    for t in run["temperatures"]:
        lines += [f"## temperature {t:g}" + (f", top_p {run['top_p']:g}" if t else " (greedy)"), "", *columns([
            ("method", "name", "{}"), ("τ", "tau"), ("tok/s", "tokens_per_s", "{:.1f}"), ("× none", "speedup_vs_none"),
            ("valid / completed", lambda c: f"{c['valid']}/{c['completed']}"), ("cut (length)", "truncated", "{}"),
            ("errors", "errors", "{}"),
            ("finish", lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c["finish_reasons"].items()))),
            ("tokens mean", "tokens_mean", "{:.1f}"), ("TTFT p50 ms", "ttft_ms_p50", "{:.0f}"),
            ("forced", "forced_share", "{:.1%}"),
            ("steps", lambda c: mix_cell(c["steps_by_method"]) if c["method"] == "auto" else "–"),
            ("= none", lambda c: "–" if c["equal_to_none"] is None else "/".join(map(str, c["equal_to_none"])))],
            [c for c in r["cells"] if c["temperature"] == t])]
        shapes = {(s["name"], s["shape"]): s for s in r["shapes"] if s["temperature"] == t}
        names = list(dict.fromkeys(name for name, _ in shapes))
        lines += ["", "τ (validity) by shape:", "", *table(["shape", *names], [
            [shape, *(cell(shapes.get((n, shape))) for n in names)] for shape in run["shapes"]]), ""]
    if r["cost"]:
        both = lambda k, f: lambda e: " / ".join(fmt(e[v][k], f) for v in ("constrained", "matched"))  # noqa: E731
        lines += ["## The grammar's cost (target-only, one stream)", "", *columns([
            ("T", "temperature", "{:g}"), ("pairs", "pairs", "{}"),
            ("decode ms/token constrained / matched", both("decode_ms_per_token", "{:.3f}")),
            ("tok/s constrained / matched", both("tokens_per_s", "{:.1f}")),
            ("cost: tok/s", "grammar_cost_tokens_per_s", "{:.1%}"),
            ("cost: decode ms/token", "grammar_cost_decode", "{:.1%}")], r["cost"])]
        lines += ["", "matched = the same request without the constraint, ignore_eos, as many tokens as the "
                  "constrained answer; cost: tok/s = 1 − tok/s ÷ matched's (median of the repeats' ratios), decode = "
                  "decode ms/token ÷ matched's − 1.", ""]
    probe = r["unconstrained_probe"]
    lines += ["## Unconstrained requests before and after the constrained ones", "", *columns([
        ("when", "when", "{}"), ("requests", "requests", "{}"), ("decode ms/token", "decode_ms_per_token", "{:.3f}"),
        ("tok/s", "tokens_per_s", "{:.1f}"), ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}")],
        [probe["before"], probe["after"]])]
    lines += ["", f"after ÷ before (decode ms/token): {fmt(probe['decode_ratio'], '{:.3f}')}.", ""]
    lines += tail(r["flags"][:60], r["skipped"], (
        "τ = committed tokens per verify step, pooled over the repeats; tok/s = output tokens ÷ wall time over a "
        "repeat's requests, median over the repeats; × none = median of the repeats' paired ratios; forced = "
        "tokens the grammar forced ÷ committed; = none: greedy outputs equal to none's under the same grammar."))
    return "\n".join(lines)


main, cli_main = entry("splitspec bench-structured", __doc__, add_flags, lambda *a: StructuredBench(*a).run(), markdown)
