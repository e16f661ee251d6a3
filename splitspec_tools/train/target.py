"""Train the default target model: a small Qwen3-architecture decoder on the stdlib corpus.

    python -m splitspec_tools.train.target --out models/splitspec-code-target --run-dir runs/target

Resumable: the run folder keeps the tokenizer, the encoded corpus and `ckpt.pt` (model,
optimizer, step, RNG); re-running the same command continues from the last checkpoint. At the
end the run writes the Hugging Face folder (config.json, model.safetensors, tokenizer files,
generation_config.json) and evaluates it into README.md, so it completes unattended.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

from splitspec.models.config import ModelConfig
from splitspec.models.dense import CausalLM

from . import checkpoint, corpus, evaluate
from .optim import add_optimizer_flags, make_optimizer
from .tokenizer import EOS, save_tokenizer, special_id, train_tokenizer

DEFAULT_OUT = "models/splitspec-code-target"
DEFAULT_RUN_DIR = "runs/target"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitspec train-target", description=__doc__.splitlines()[0])
    a = p.add_argument
    checkpoint.add_run_flags(a, DEFAULT_OUT, DEFAULT_RUN_DIR, "Hugging Face model")
    a("--max-files", type=int, default=None, help="train on a small subset (tests, smoke runs)")
    a("--vocab-size", type=int, default=8192)
    a("--hidden-size", type=int, default=256)
    a("--layers", type=int, default=8)
    a("--heads", type=int, default=4)
    a("--kv-heads", type=int, default=2)
    a("--head-dim", type=int, default=64)
    a("--intermediate-size", type=int, default=768)
    a("--max-position-embeddings", type=int, default=2048)
    a("--seq-len", type=int, default=512)
    a("--batch-size", type=int, default=8)
    a("--steps", type=int, default=2000,
      help="total steps; with --minutes, an upper bound fixed when the decay phase starts")
    a("--minutes", type=float, default=None,
      help="training-time budget: the stable phase ends at (1 - decay) of it and the run's step "
           "count is fixed there (the card reports it; --steps N alone then reproduces the schedule)")
    a("--decay", type=float, default=0.2, help="fraction of the steps spent in the final LR decay")
    add_optimizer_flags(p, lr=2e-3, weight_decay=0.1)
    a("--bf16", action=argparse.BooleanOptionalAction, default=True,
      help="bfloat16 autocast for the matmuls (fp32 master weights); ~2x faster on AVX512-BF16 CPUs")
    a("--threads", type=int, default=None, help="torch threads (default: all cores)")
    a("--eval-every", type=int, default=250)
    a("--eval-windows", type=int, default=16, help="held-out windows for the periodic eval")
    a("--ckpt-every", type=int, default=50)
    a("--calibrate", type=int, default=0, metavar="N",
      help="time N training steps, print tokens/s and exit (no checkpoint, no output)")
    a("--eval-functions", type=int, default=64, help="held-out functions for the ast.parse measure")
    a("--eval-max-new", type=int, default=256, help="token cap per function completion")
    a("--samples", type=int, default=3, help="sample completions shown in the model card")
    a("--max-minutes", type=float, default=None,
      help="safety stop: end training early after this much training time (reported in the card)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- model

def hf_config(args, vocab_size: int, eos_id: int) -> dict:
    """config.json in the Hugging Face Qwen3 layout (transformers loads it unchanged)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.layers,
        "layer_types": ["full_attention"] * args.layers,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def init_weights(model: CausalLM, n_layers: int) -> None:
    # GPT-2 style: N(0, 0.02), with the projections that write into the residual stream
    # scaled down by sqrt(2 * layers) so the stream's variance does not grow with depth.
    resid_std = 0.02 / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, resid_std)
            elif p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:
                p.zero_()


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts tied ones once


def lr_at(step: int, args, total: int | None) -> float:
    """Warm-up, stable, decay (WSD): linear warm-up, constant peak, then a linear decay to
    min_lr_ratio * lr over the last `decay` fraction of `total` steps. WSD rather than cosine
    because the end need not be known in advance: on a shared machine whose speed varies, a
    time budget decides the step count when the decay starts (total=None until then)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if total is None:
        return args.lr
    decay_start = total - round(args.decay * total)
    if step < decay_start:
        return args.lr
    frac = (step - decay_start) / max(1, total - decay_start)
    return args.lr * (1 - (1 - args.min_lr_ratio) * min(frac, 1.0))


def fix_total(step: int, train_seconds: float, args) -> int | None:
    """The run's step count: --steps, or under --minutes the step at which (1 - decay) of the
    budget is spent, scaled so that the decay phase is the last `decay` fraction."""
    if args.minutes is None:
        return args.steps
    if train_seconds < (1 - args.decay) * args.minutes * 60:
        return None
    total = max(step + 1, math.ceil(step / (1 - args.decay)))
    # Nudge it so that lr_at's decay start is exactly this step, so `--steps total` alone
    # reproduces the schedule step for step (rounding could otherwise shift it by one).
    while total > step + 1 and total - round(args.decay * total) > step:
        total -= 1
    while total - round(args.decay * total) < step:
        total += 1
    return min(args.steps, total)


# ---------------------------------------------------------------- data

@dataclass
class Data:
    tok: Tokenizer
    eos_id: int
    train: torch.Tensor          # packed stream: <eos> doc <eos> doc ...
    heldout: torch.Tensor
    train_docs: list
    heldout_docs: list


def pack(tok: Tokenizer, docs, eos_id: int) -> torch.Tensor:
    # Each document is preceded by <|endoftext|>, so the model learns "start of file" from it
    # and a prompt may be given with a leading <|endoftext|> exactly as in training.
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids.append(eos_id)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def prepare_data(args, run_dir: Path) -> Data:
    train_docs, heldout_docs = corpus.load_corpus(max_files=args.max_files)
    tok_dir = run_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    else:
        tok = train_tokenizer((d.text for d in train_docs), args.vocab_size)
        save_tokenizer(tok, tok_dir, model_max_length=args.max_position_embeddings)
    eos_id = special_id(tok, EOS)
    cache = run_dir / "data.pt"
    if cache.is_file():
        streams = torch.load(cache)
    else:
        streams = {"train": pack(tok, train_docs, eos_id), "heldout": pack(tok, heldout_docs, eos_id)}
        torch.save(streams, cache)
    return Data(tok, eos_id, streams["train"], streams["heldout"], train_docs, heldout_docs)


def batch_at(stream: torch.Tensor, step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows, drawn from a generator seeded by (seed, step): the batch sequence is a
    pure function of the step, so a resumed run sees exactly the batches a straight run would."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=g)
    rows = torch.stack([stream[s:s + args.seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------- checkpoints

def save_ckpt(path: Path, model, opt, step: int, train_seconds: float, args, total) -> None:
    checkpoint.save(path, model, opt, args, step=step, total=total, train_seconds=train_seconds)


# Settings that must match for a checkpoint to be resumed (the rest may change, e.g. eval).
RESUME_KEYS = ("vocab_size", "hidden_size", "layers", "heads", "kv_heads", "head_dim",
               "intermediate_size", "seq_len", "batch_size", "steps", "decay", "lr", "seed", "max_files")
# --minutes may change on resume (e.g. to extend a run on a busy machine): until the decay
# starts the schedule does not depend on it, and afterwards the fixed total is in the checkpoint.


def load_ckpt(path: Path, model, opt, args) -> tuple[int, float, int | None]:
    state = checkpoint.load(path, model, opt, args, RESUME_KEYS)
    return state["step"], state["train_seconds"], state["total"]


def export_hf(model: CausalLM, data: Data, args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(args, data.tok.get_vocab_size(), data.eos_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": data.eos_id, "eos_token_id": data.eos_id, "pad_token_id": data.eos_id,
         "do_sample": False}, indent=2) + "\n")
    # Tied: lm_head.weight is the embedding, stored once, as transformers does.
    tensors = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it owner-only
    save_tokenizer(data.tok, out, model_max_length=args.max_position_embeddings)


# ---------------------------------------------------------------- training

def train_step(model, opt, x, y, lr: float, args) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    return loss.item()


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    command = "python -m splitspec_tools.train.target " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "ckpt.pt"
    if args.fresh:
        for f in ("ckpt.pt", "data.pt", "tokenizer/tokenizer.json"):
            (run_dir / f).unlink(missing_ok=True)

    data = prepare_data(args, run_dir)
    cfg = ModelConfig.from_dict(hf_config(args, data.tok.get_vocab_size(), data.eos_id))
    model = CausalLM(cfg)
    init_weights(model, args.layers)
    opt = make_optimizer(model, args)
    n_params = param_count(model)
    print(f"corpus: {len(data.train_docs)} train files, {len(data.train):,} tokens; "
          f"{len(data.heldout_docs)} held-out files, {len(data.heldout):,} tokens", flush=True)
    print(f"model: {n_params:,} parameters, {args.batch_size}x{args.seq_len} tokens/step, "
          f"{torch.get_num_threads()} threads, bf16 autocast={args.bf16}", flush=True)

    if args.calibrate:
        return calibrate(model, opt, data, args)

    step, train_seconds, total = 0, 0.0, fix_total(0, 0.0, args)
    if ckpt_path.is_file():
        step, train_seconds, total = load_ckpt(ckpt_path, model, opt, args)
        print(f"resumed from {ckpt_path} at step {step}", flush=True)
    step, train_seconds, last_loss = train_loop(model, opt, data, args, step, train_seconds, total, ckpt_path)

    out = Path(args.out)
    export_hf(model, data, args, out)
    print(f"wrote {out}; evaluating", flush=True)
    run = {"command": command, "params": n_params, "steps": step, "planned_steps": args.steps,
           "minutes": args.minutes,
           "tokens_seen": step * args.batch_size * args.seq_len, "train_seconds": train_seconds,
           "total_seconds": time.time() - started, "last_batch_loss": last_loss}
    metrics = evaluate.evaluate_folder(out, data, args, run)
    print(json.dumps({k: v for k, v in metrics.items() if k != "samples"}, indent=2), flush=True)
    return 0


class ThreadTuner:
    """Picks the torch thread count that is fastest right now.

    The machine is shared: when another process keeps a core busy, two OpenMP threads that
    wait on each other run several times slower than one. So keep a running step time per
    setting, re-measure the other setting for two steps every `every` steps, use the faster.
    """

    def __init__(self, max_threads: int, every: int = 25):
        self.options = sorted({1, max_threads})
        self.every = every
        self.seconds = {n: None for n in self.options}
        self.current = max_threads

    def threads_for(self, step: int) -> int:
        other = [n for n in self.options if n != self.current]
        if other and step % self.every in (0, 1):
            return other[0]   # probe; the first probe step pays the switch, the second is timed
        return self.current

    def record(self, step: int, threads: int, seconds: float) -> None:
        if threads != self.current and step % self.every == 0:
            return
        old = self.seconds[threads]
        # A probe replaces the stale estimate outright; the current setting is smoothed.
        fresh = old is None or threads != self.current
        self.seconds[threads] = seconds if fresh else 0.7 * old + 0.3 * seconds
        if threads != self.current or self.seconds[self.current] is None:
            known = {n: t for n, t in self.seconds.items() if t is not None}
            self.current = min(known, key=known.get)


def train_loop(model, opt, data, args, step, train_seconds, total, ckpt_path):
    from tqdm import tqdm
    model.train()
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(total=total or args.steps, initial=step, unit="step", mininterval=5, dynamic_ncols=False,
               ncols=130, file=sys.stderr)
    tuner = ThreadTuner(args.threads or torch.get_num_threads())
    loss, smooth = float("nan"), None
    seg_start, seg_steps = time.time(), 0
    spent = lambda: train_seconds + time.time() - seg_start  # noqa: E731
    while total is None or step < total:
        if args.max_minutes and spent() > args.max_minutes * 60:
            bar.write(f"--max-minutes reached at step {step}; stopping early")
            break
        if total is None:
            total = fix_total(step, spent(), args)
            if total is not None:
                bar.total = total
                bar.write(f"step {step}: time budget {1 - args.decay:.0%} spent; LR decay starts, "
                          f"the run ends at step {total}")
        lr = lr_at(step, args, total)
        x, y = batch_at(data.train, step, args)
        threads = tuner.threads_for(step)
        torch.set_num_threads(threads)
        t0 = time.time()
        loss = train_step(model, opt, x, y, lr, args)
        tuner.record(step, threads, time.time() - t0)
        step += 1
        seg_steps += 1
        smooth = loss if smooth is None else 0.95 * smooth + 0.05 * loss
        elapsed = time.time() - seg_start
        bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{lr:.1e}", thr=threads,
                        tok_s=f"{seg_steps * tokens_per_step / elapsed:.0f}", refresh=False)
        bar.update(1)
        if step % args.eval_every == 0 or step == total:
            held = evaluate.stream_loss(model, data.heldout, args.seq_len, args.batch_size,
                                        max_windows=args.eval_windows, bf16=args.bf16)
            bar.write(f"step {step}: train loss (ema) {smooth:.3f}, held-out loss {held:.3f} "
                      f"(ppl {math.exp(held):.1f}), {spent() / 60:.1f} min")
            model.train()
        if step % args.ckpt_every == 0:
            save_ckpt(ckpt_path, model, opt, step, spent(), args, total)
    bar.close()
    torch.set_num_threads(args.threads or os.cpu_count())
    train_seconds = spent()
    save_ckpt(ckpt_path, model, opt, step, train_seconds, args, total)
    model.eval()
    return step, train_seconds, loss


def calibrate(model, opt, data, args) -> int:
    model.train()
    train_step(model, opt, *batch_at(data.train, 0, args), args.lr, args)  # warm-up: allocator, kernels
    t = time.time()
    for step in range(1, args.calibrate + 1):
        loss = train_step(model, opt, *batch_at(data.train, step, args), args.lr, args)
    dt = time.time() - t
    tps = args.calibrate * args.batch_size * args.seq_len / dt
    print(f"calibration: {args.calibrate} steps in {dt:.1f}s, {dt / args.calibrate:.2f} s/step, "
          f"{tps:.0f} tokens/s, last loss {loss:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
