"""Tensor parallelism on this machine: per-step time of a decode step and of a width-8 verify at
TP=1 and TP=N, the time in collectives per layer, and what sending each step to the workers costs.

The same model runs through the target's own runner (`TargetSequence` on a paged pool) in one
process (TP=1) and through rank 0's driver with N-1 spawned ranks (gloo on CPU, NCCL on CUDA).
Greedy tokens are compared between the two as a side check.

    python -m splitspec_tools.bench.tp [--model-path models/splitspec-code-target] [--tp 2] [--threads 1]
                                 [--steps 30] [--context 256] [--json out.json]

`--services`: the speculative loop through the real services instead (target at TP=1, then at
TP=N, the same DFlash draft and gateway each time, one request at a time): accept length τ and
tokens/s per configuration.

    python -m splitspec_tools.bench.tp --services [--draft-model-path models/splitspec-code-draft]
                                 [--prompts 8] [--max-new-tokens 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import grpc
import torch

from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence
from splitspec.models.loader import load_model, parse_dtype, resolve_device
from target_service.parallel import CommStats
from target_service.pools import make_pool

DEFAULT_MODEL = "models/splitspec-code-target"
WIDTH = 8


def _time_steps(seq: TargetSequence, steps: int, sync) -> tuple[list[float], list[float], list[int]]:
    """(decode ms, width-8 verify ms, greedy tokens) over `steps` of each, alternating."""
    dec, ver, toks = [], [], []
    vocab = seq.model.cfg.vocab_size
    for i in range(steps):
        sync()
        t = time.perf_counter()
        toks += seq.decode().committed
        sync()
        dec.append((time.perf_counter() - t) * 1e3)
        # A chain the target will mostly reject: the forward is what is measured, not acceptance.
        chain = [(toks[-1] * 31 + 7 * j + i) % vocab for j in range(WIDTH - 1)]
        tree = Tree(chain, list(range(-1, WIDTH - 2)))
        sync()
        t = time.perf_counter()
        toks += seq.verify(tree).committed
        sync()
        ver.append((time.perf_counter() - t) * 1e3)
    return dec, ver, toks


def run(model_path: str, tp: int, steps: int, context: int, device: str, dtype: str) -> dict:
    dev = resolve_device(device)
    dt = parse_dtype(dtype)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    prompt = [(i * 37 + 11) % 1000 + 3 for i in range(context)]
    max_len = context + 4 * steps * WIDTH + 8
    out = {"model": str(model_path), "context": context, "steps": steps, "device": str(dev), "dtype": dtype}

    ref = load_model(model_path, dtype=dt, device=dev)
    cfg = ref.cfg
    seq = TargetSequence(ref, prompt, max_len=max_len)
    seq.prefill()
    _time_steps(seq, 3, sync)                         # warm-up
    seq = TargetSequence(ref, prompt, max_len=max_len)
    seq.prefill()
    d1, v1, t1 = _time_steps(seq, steps, sync)
    del ref, seq

    from target_service import tp_worker
    drv = tp_worker.start(model_path, tp, dtype=dt, device=dev, timeout_s=120,
                          torch_threads=torch.get_num_threads())
    try:
        pool = make_pool(drv, num_blocks=-(-max_len // 16) * 2 + 2, block_size=16)
        seq = TargetSequence(drv, prompt, max_len=max_len, pool=pool)
        seq.prefill()
        _time_steps(seq, 3, sync)
        seq.seq.table.free()
        seq = TargetSequence(drv, prompt, max_len=max_len, pool=pool)
        seq.prefill()
        sends0, send_s0, bytes0 = drv.sends, drv.send_s, drv.send_bytes
        dn, vn, tn = _time_steps(seq, steps, sync)
        forwards = drv.sends - sends0
        send_ms = (drv.send_s - send_s0) * 1e3 / forwards
        send_bytes = (drv.send_bytes - bytes0) / forwards
        # Collectives timed apart (the timer syncs, so this pass is not the one measured above).
        seq.seq.table.free()
        seq = TargetSequence(drv, prompt, max_len=max_len, pool=pool)
        seq.prefill()
        drv.comm_stats(True)
        _time_steps(seq, steps, sync)
        calls, secs = CommStats.calls, CommStats.seconds
        drv.comm_stats(False)
    finally:
        drv.close()
    med = statistics.median
    per_forward = calls / (2 * steps)
    out.update({
        "tp": tp, "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        "decode_ms": {"tp1": med(d1), f"tp{tp}": med(dn)},
        "verify8_ms": {"tp1": med(v1), f"tp{tp}": med(vn)},
        "all_reduces_per_forward": per_forward,
        "all_reduce_ms": secs * 1e3 / calls,
        "collective_ms_per_layer": secs * 1e3 / calls * 2,       # o_proj + down_proj
        "collective_ms_per_forward": secs * 1e3 / (2 * steps),
        "step_send_ms": send_ms, "step_send_bytes": send_bytes,
        "greedy_equal": t1 == tn,
    })
    return out


def run_services(model_path: str, draft_path: str, tp: int, n_prompts: int, max_new: int, threads: int) -> dict:
    import tempfile

    from splitspec_tools.bench.prompts import default_prompts
    from splitspec_tools.client import build_request
    from splitspec_tools.ops.launch import start_service
    from splitspec.v1 import gateway_pb2_grpc
    prompts = [p.text for p in default_prompts(n_prompts)]
    log_dir = Path(tempfile.mkdtemp(prefix="splitspec-bench-tp-"))
    out = {"model": model_path, "draft": draft_path, "prompts": len(prompts), "max_new_tokens": max_new,
           "log_dir": str(log_dir)}
    for size in (1, tp):
        procs = []
        try:
            target = start_service("target", ["--model-path", model_path, "--tensor-parallel-size", str(size),
                                              "--torch-threads", str(threads)], log_dir=log_dir)
            procs.append(target)
            draft = start_service("draft", ["--method", "dflash", "--model-path", draft_path, "--target-model-path",
                                            model_path, "--torch-threads", str(threads)], log_dir=log_dir)
            procs.append(draft)
            target.wait_healthy(600)
            draft.wait_healthy(600)
            gw = start_service("gateway", ["--target", target.address, "--draft", draft.address,
                                           "--speculative-algorithm", "DFLASH", "--draft-timeout-ms", "60000"],
                               log_dir=log_dir)
            procs.append(gw)
            gw.wait_healthy(600)
            taus, tokens, wall = [], 0, 0.0
            with grpc.insecure_channel(gw.address) as ch:
                stub = gateway_pb2_grpc.GenerationStub(ch)
                for i, text in enumerate([prompts[0]] + prompts):      # the first is a warm-up
                    t = time.perf_counter()
                    n, tau = 0, None
                    for resp in stub.Generate(build_request(text, max_new_tokens=max_new, ignore_eos=True,
                                                            method="dflash"), timeout=600):
                        if resp.HasField("chunk"):
                            n += len(resp.chunk.token_ids)
                        else:
                            tau = resp.complete.stats.accept_length
                    if i:
                        taus.append(tau)
                        tokens += n
                        wall += time.perf_counter() - t
            out[f"tp{size}"] = {"tau": statistics.mean(taus), "tokens_per_s": tokens / wall, "tokens": tokens}
        finally:
            for p in reversed(procs):
                p.stop()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=DEFAULT_MODEL)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--services", action="store_true", help="the speculative loop through the services instead")
    ap.add_argument("--draft-model-path", default="models/splitspec-code-draft")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.services:
        res = run_services(args.model_path, args.draft_model_path, args.tp, args.prompts, args.max_new_tokens,
                           args.threads or 1)
        for key in ("tp1", f"tp{args.tp}"):
            r = res[key]
            print(f"{key}: tau {r['tau']:.2f}, {r['tokens_per_s']:.1f} tok/s over {r['tokens']} tokens")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (Path(args.model_path) / "config.json").is_file():
        raise SystemExit(f"--model-path {args.model_path}: no config.json there")
    res = run(args.model_path, args.tp, args.steps, args.context, args.device, args.dtype)
    tp = f"tp{args.tp}"
    print(f"{res['model']} ({res['layers']} layers, hidden {res['hidden_size']}), context {res['context']}, "
          f"{res['device']} {res['dtype']}, torch threads/rank {torch.get_num_threads()}")
    print(f"decode step      TP=1 {res['decode_ms']['tp1']:.2f} ms   TP={args.tp} {res['decode_ms'][tp]:.2f} ms")
    print(f"verify width 8   TP=1 {res['verify8_ms']['tp1']:.2f} ms   TP={args.tp} {res['verify8_ms'][tp]:.2f} ms")
    print(f"all-reduce       {res['all_reduce_ms'] * 1e3:.0f} us each, {res['all_reduces_per_forward']:.0f} per "
          f"forward, {res['collective_ms_per_layer'] * 1e3:.0f} us per layer, "
          f"{res['collective_ms_per_forward']:.2f} ms per forward")
    print(f"step to workers  {res['step_send_ms'] * 1e3:.0f} us, {res['step_send_bytes']:.0f} bytes per forward")
    print(f"greedy tokens equal: {res['greedy_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
