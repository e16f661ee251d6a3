"""Train a DFlash block-diffusion draft online against a frozen target (TorchSpec-style).

    python -m splitspec.train.draft --target-model-path models/splitspec-code-target \\
        --out models/splitspec-code-draft --run-dir runs/draft

A *producer* (a separate process by default, or a thread) holds the frozen target. It regenerates
training data — the target's own continuations of training-corpus prompts, a mix of temperature 0
and temperature 1 rows, many rows per forward with a batched KV cache — and streams every sequence
with the hidden states of `target_layer_ids` through a bounded queue to the *trainer*, which
optimises the DFlash objective (`draft_objective.py`). The token ids are cached under
`<run-dir>/data/`; features are never written to disk. Once the requested number of sequences
exists, the producer replays the cached token ids in a seeded order, recomputing their features
with one target forward per batch. Producer and consumer rates are reported so that the
bottleneck is visible.

The run is resumable (`<run-dir>/ckpt.pt`; re-run the same command), evaluates the accept length τ
on held-out prompts with the real verification code during training, exports the draft in the
z-lab format (`save_draft`) every few minutes and at the end, and writes a model card.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue as queue_mod
import random
import shlex
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_service.dflash import DFlashDraft, default_target_layer_ids, new_draft, save_draft
from target_service.config import ModelConfig
from target_service.kv_cache import KVCache
from target_service.model import apply_rope, rope_cos_sin
from target_service.sample import SamplingParams, probs_from_logits

from .draft_objective import Anchors, Teacher, objective, sample_anchors

DEFAULT_TARGET = "models/splitspec-code-target"
DEFAULT_OUT = "models/splitspec-code-draft"
DEFAULT_RUN_DIR = "runs/draft"
MASK_TOKEN = "<|mask|>"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitspec train-draft", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--target-model-path", default=DEFAULT_TARGET, help="frozen target (HF folder the engine loads)")
    a("--out", default=DEFAULT_OUT, help="draft folder to write (z-lab DFlash format + README.md)")
    a("--run-dir", default=DEFAULT_RUN_DIR, help="checkpoint, cached token ids, logs, metrics")
    a("--fresh", action="store_true", help="ignore an existing checkpoint and cached data in --run-dir")
    # draft model
    a("--layers", type=int, default=2, help="draft decoder layers")
    a("--block-size", type=int, default=8, help="verify width B: last token + B-1 drafted tokens")
    a("--target-layer-ids", default=None,
      help="comma-separated target layers to tap (default: default_target_layer_ids(L, --num-taps))")
    a("--num-taps", type=int, default=None, help="number of target layers to tap (default: --layers)")
    a("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    a("--mask-token-id", type=int, default=None, help=f"default: the tokenizer's {MASK_TOKEN}")
    a("--init", choices=("random", "target", "target-last"), default="random",
      help="draft layers from N(0, 0.02); copied from the target's first layers (which, like the "
           "draft's, read token embeddings); or copied from its last layers, with fc and hidden_norm set "
           "so that the first draft layer's context K/V are exactly the target's there (needs the layer "
           "below them among the taps)")
    # data
    a("--prompt-len", type=int, default=128, help="tokens of training-corpus prompt per sequence")
    a("--seq-len", type=int, default=512, help="prompt + target continuation, tokens per sequence")
    a("--num-seqs", type=int, default=4096,
      help="sequences to regenerate; after that the cached token ids are replayed")
    a("--greedy-frac", type=float, default=0.5, help="share of rows regenerated at temperature 0")
    a("--regen-temperature", type=float, default=1.0, help="temperature of the sampled rows")
    a("--regen-top-p", type=float, default=1.0, help="top-p of the sampled rows")
    a("--raw-frac", type=float, default=0.0, help="share of rows that are raw corpus text (no regeneration)")
    a("--gen-batch", type=int, default=32, help="rows regenerated per batched forward (a data chunk)")
    a("--replay-batch", type=int, default=16, help="rows per feature forward when replaying")
    a("--max-files", type=int, default=None, help="use a small corpus subset (tests, smoke runs)")
    a("--queue-size", type=int, default=128, help="sequences the producer may run ahead")
    a("--max-reuse", type=int, default=3,
      help="when the producer is behind, the trainer reuses a recent sequence (new anchors) up to this "
           "many uses in all instead of waiting (1: always wait for fresh data)")
    a("--reuse-buffer", type=int, default=64, help="recent sequences kept for --max-reuse")
    a("--producer", choices=("process", "thread"), default="process")
    a("--producer-threads", type=int, default=1, help="torch threads of the producer")
    a("--producer-bf16", action=argparse.BooleanOptionalAction, default=True,
      help="the producer's copy of the target in bfloat16 (regeneration and features; ~1.3-2x faster on CPU)")
    # training
    a("--steps", type=int, default=3000)
    a("--batch-seqs", type=int, default=2, help="sequences per optimizer step")
    a("--anchors", type=int, default=64, help="anchored blocks per sequence (fixed; masked when unused)")
    a("--min-anchor", type=int, default=8, help="smallest anchor position (context length)")
    a("--gamma", type=float, default=None, help="loss decay exp(-(k-1)/gamma); default 4 for B<=8, else 7")
    a("--distill", type=float, default=0.0,
      help="weight of the soft label (the target's next-token distribution, from its last layer) against "
           "the data token (1: soft only, 0: data tokens only, as the plain DFlash objective)")
    a("--attention", choices=("factored", "dense"), default="factored")
    a("--lr", type=float, default=1e-3)
    a("--min-lr-ratio", type=float, default=0.05)
    a("--warmup", type=int, default=100)
    a("--weight-decay", type=float, default=0.01)
    a("--clip", type=float, default=1.0)
    a("--seed", type=int, default=0)
    a("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast in training")
    a("--threads", type=int, default=None, help="torch threads of the trainer (default: cores - producer)")
    a("--device", default="cpu",
      help="where the target, the producer and the draft run: cpu, cuda or cuda:N (on a GPU the producer "
           "shares the card with the trainer; --threads and --producer-threads then only size CPU work)")
    a("--max-minutes", type=float, default=None,
      help="training time budget: the LR schedule follows max(step/steps, time/budget) and stops at it")
    a("--ckpt-every", type=int, default=100)
    # evaluation and export
    a("--eval-every", type=int, default=500, help="steps between in-process tau evaluations (0: never)")
    a("--eval-prompts", type=int, default=6, help="held-out prompts in the periodic evaluation")
    a("--final-eval-prompts", type=int, default=24, help="held-out prompts in the final evaluation")
    a("--eval-prompt-len", type=int, default=128)
    a("--eval-new-tokens", type=int, default=128)
    a("--eval-top-p", type=float, default=0.95)
    a("--export-every-minutes", type=float, default=10.0, help="provisional export to --out (0: never)")
    a("--eval-only", action="store_true",
      help="evaluate the draft already in --out (e.g. a provisional export) and rewrite its card")
    a("--calibrate", type=int, default=0, metavar="N",
      help="time data regeneration, feature replay and N training steps, print rates, and exit")
    args = p.parse_args(argv)
    if args.gamma is None:
        args.gamma = 4.0 if args.block_size <= 8 else 7.0
    if not 0 < args.prompt_len < args.seq_len:
        p.error("--prompt-len must be positive and below --seq-len")
    return args


# ---------------------------------------------------------------- target, tokenizer, corpus

def load_target(path, threads: int | None = None, dtype: str = "float32", device: str = "cpu"):
    from target_service.loader import load_model
    if threads:
        torch.set_num_threads(threads)
    return load_model(path, dtype=dtype, device=device)


def target_tokenizer(path):
    from target_service.loader import load_tokenizer
    return load_tokenizer(path)


def eos_ids_of(target_cfg: ModelConfig, tok) -> tuple[int, ...]:
    if target_cfg.eos_token_ids:
        return tuple(target_cfg.eos_token_ids)
    idx = tok.token_to_id("<|endoftext|>") if tok is not None else None
    return (idx,) if idx is not None else ()


def corpus_streams(target_path, run_dir: Path, max_files: int | None) -> dict[str, torch.Tensor]:
    """The training corpus (splitspec.train.corpus: stdlib, held-out split by file) tokenized with
    the target's tokenizer and packed as `<eos> doc <eos> doc …`, cached in the run folder."""
    from target_service.loader import tokenizer_hash
    cache = run_dir / "corpus.pt"
    key = {"tokenizer": tokenizer_hash(target_path), "max_files": max_files}
    if cache.is_file():
        streams = torch.load(cache)
        if streams.get("key") == key:
            return streams
    from . import corpus
    tok = target_tokenizer(target_path)
    eos = tok.token_to_id("<|endoftext|>")
    train_docs, held_docs = corpus.load_corpus(max_files=max_files)

    def pack(docs) -> torch.Tensor:
        ids: list[int] = []
        for enc in tok.encode_batch([d.text for d in docs]):
            if eos is not None:
                ids.append(eos)
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.int32)

    streams = {"train": pack(train_docs), "heldout": pack(held_docs),
               "train_files": len(train_docs), "heldout_files": len(held_docs), "key": key}
    tmp = cache.with_suffix(".tmp")
    torch.save(streams, tmp)
    os.replace(tmp, cache)
    return streams


def windows(stream: torch.Tensor, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """n random windows [n, length] of a packed stream (repeats the stream if it is short)."""
    if len(stream) <= length:
        reps = length // max(len(stream), 1) + 2
        stream = stream.repeat(reps)
    starts = torch.randint(0, len(stream) - length, (n,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()]).long()


# ---------------------------------------------------------------- the producer

@dataclass
class ProducerSpec:
    target_path: str
    run_dir: str
    layer_ids: tuple[int, ...]
    prompt_len: int
    seq_len: int
    num_chunks: int                  # generation chunks of gen_batch rows
    gen_batch: int
    replay_batch: int
    greedy_frac: float
    raw_frac: float
    temperature: float
    top_p: float
    seed: int
    threads: int
    bf16: bool
    start_item: int = 0              # items already consumed (resume): skipped without compute
    max_files: int | None = None
    device: str = "cpu"


def chunk_path(run_dir, k: int) -> Path:
    return Path(run_dir) / "data" / f"chunk_{k:05d}.pt"


def row_kinds(spec: ProducerSpec, k: int) -> torch.Tensor:
    """Per-row temperature of chunk k: 0 (greedy), spec.temperature, or -1 (raw corpus text)."""
    g = torch.Generator().manual_seed(spec.seed * 7_919 + k)
    u = torch.rand(spec.gen_batch, generator=g)
    kinds = torch.full((spec.gen_batch,), spec.temperature)
    kinds[u < spec.greedy_frac + spec.raw_frac] = 0.0
    kinds[u < spec.raw_frac] = -1.0
    return kinds


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, top_p: float, generator) -> torch.Tensor:
    """One token per row: argmax where temps == 0, else a draw from top-p(softmax(logits / T))."""
    out = logits.argmax(-1)
    for t in temps[temps > 0].unique().tolist():
        rows = (temps == t).nonzero().flatten()
        probs = probs_from_logits(logits[rows].float(), SamplingParams(temperature=t, top_p=top_p))
        # drawn on the CPU with a CPU generator: the same seed gives the same data on any device
        out[rows] = torch.multinomial(probs.cpu(), 1, generator=generator).flatten().to(out.device)
    return out


def decode_step(model, ids: torch.Tensor, cache: KVCache, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per row (ids [b]) at position cache.length through the target: the same
    modules and arithmetic as `CausalLM.forward`, but grouped-query attention straight on the cached
    K/V (no repeat_kv copy, no CPU flash kernel for a single query), ~2x faster per decode step on
    CPU. Returns logits [b, V] and the features [b, len(layer_ids) * H]."""
    b = ids.shape[0]
    x = model.model.embed_tokens(ids)[:, None]
    pos = torch.tensor([cache.length], device=ids.device)
    cos, sin = rope_cos_sin(model.inv_freq(x.device), pos, x.dtype)
    wanted = {}
    for i, layer in enumerate(model.model.layers):
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = at.q_proj(h).view(b, 1, at.n_heads, at.head_dim)
        k = at.k_proj(h).view(b, 1, at.n_kv, at.head_dim)
        v = at.v_proj(h).view(b, 1, at.n_kv, at.head_dim).transpose(1, 2)
        if at.q_norm is not None:
            q, k = at.q_norm(q), at.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        K, V = cache.update(at.layer_idx, k, v)                           # [b, kv, T, D]
        qg = q.reshape(b, at.n_kv, at.n_heads // at.n_kv, at.head_dim)   # heads grouped by KV head
        s = torch.matmul(qg, K.transpose(-1, -2)) * (1.0 / math.sqrt(at.head_dim))
        o = torch.matmul(torch.softmax(s.float(), -1).to(V.dtype), V)
        x = x + at.o_proj(o.reshape(b, 1, at.n_heads * at.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in layer_ids:
            wanted[i] = x
    cache.advance(1)
    logits = model.lm_head(model.model.norm(x))[:, 0]
    return logits, torch.cat([wanted[i] for i in layer_ids], -1)[:, 0]


@torch.inference_mode()
def regenerate(model, prompts: torch.Tensor, total_len: int, temps: torch.Tensor, top_p: float,
               generator: torch.Generator, layer_ids, bf16: bool = False):
    """The target's continuations of equal-length prompts [b, P] up to total_len tokens, all rows in
    one batched KV cache. Returns tokens [b, total_len] and the float32 features
    [b, total_len - 1, F] of every token the target ran (all but the last, not run yet).
    bf16: autocast (for a float32 model); a bfloat16 model runs in bfloat16 as it is."""
    b, P = prompts.shape
    layer_ids = tuple(layer_ids)
    cache = KVCache(model.cfg, total_len, batch=b, dtype=next(model.parameters()).dtype,
                    device=prompts.device)
    toks, feats = [prompts], []
    with torch.autocast(prompts.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(prompts, cache=cache, hidden_layers=layer_ids, logits_rows=slice(-1, None))
        feats.append(out.hidden.float())
        nxt = sample_rows(out.logits[:, -1].float(), temps, top_p, generator)
        for _ in range(total_len - P - 1):
            toks.append(nxt[:, None])
            logits, hidden = decode_step(model, nxt, cache, layer_ids)
            feats.append(hidden[:, None].float())
            nxt = sample_rows(logits.float(), temps, top_p, generator)
    toks.append(nxt[:, None])
    return torch.cat(toks, 1), torch.cat(feats, 1)


@torch.inference_mode()
def features_of(model, tokens: torch.Tensor, layer_ids, bf16: bool = False) -> torch.Tensor:
    """Features [b, S - 1, F] of tokens [b, S] by one causal forward (the last token is not needed)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(tokens[:, :-1], hidden_layers=layer_ids, logits_rows=slice(0, 0))
    return out.hidden.float()


class Producer:
    """Iterates the deterministic item schedule (generation chunks, then seeded replay epochs) and
    puts `(tokens [S], features [S-1, F], info)` items on a queue."""

    def __init__(self, spec: ProducerSpec, put, stopped):
        self.spec, self.put, self.stopped = spec, put, stopped
        self.busy = 0.0
        self.seqs = self.tokens = self.generated = 0
        self.item = 0

    def run(self) -> None:
        spec = self.spec
        torch.set_num_threads(spec.threads)
        # bf16: the weights themselves in bfloat16 (autocast would re-cast the frozen weights on
        # every call of every decode step)
        self.model = load_target(spec.target_path, dtype="bfloat16" if spec.bf16 else "float32",
                                 device=spec.device)
        streams = corpus_streams(spec.target_path, Path(spec.run_dir), spec.max_files)
        self.train_stream = streams["train"]
        (Path(spec.run_dir) / "data").mkdir(parents=True, exist_ok=True)
        for k in range(spec.num_chunks):
            if self.stopped():
                return
            self._chunk(k)
        epoch = 1
        while not self.stopped():
            g = torch.Generator().manual_seed(spec.seed * 104_729 + epoch)
            pairs = [(k, r) for k in range(spec.num_chunks) for r in range(spec.gen_batch)]
            order = torch.randperm(len(pairs), generator=g).tolist()
            for i in range(0, len(order), spec.replay_batch):
                if self.stopped():
                    return
                self._replay([pairs[j] for j in order[i:i + spec.replay_batch]], epoch)
            epoch += 1

    def _skip(self, n: int) -> bool:
        if self.item + n <= self.spec.start_item:
            self.item += n
            return True
        return False

    def _chunk(self, k: int) -> None:
        spec = self.spec
        path = chunk_path(spec.run_dir, k)
        if path.is_file():
            tokens = torch.load(path)["tokens"].long()
            if self._skip(len(tokens)):
                return
            t0 = time.perf_counter()
            feats = features_of(self.model, tokens.to(spec.device), spec.layer_ids).cpu()
            self.busy += time.perf_counter() - t0
            self._emit(tokens, feats, {"chunk": k, "kind": "cached"})
            return
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(spec.seed * 1_000_003 + k)
        kinds = row_kinds(spec, k)
        gen_rows = (kinds >= 0).nonzero().flatten()
        raw_rows = (kinds < 0).nonzero().flatten()
        F = len(spec.layer_ids) * self.model.cfg.hidden_size
        tokens = torch.zeros(spec.gen_batch, spec.seq_len, dtype=torch.long)
        feats = torch.zeros(spec.gen_batch, spec.seq_len - 1, F)
        if len(raw_rows):
            tokens[raw_rows] = windows(self.train_stream, len(raw_rows), spec.seq_len, g)
            feats[raw_rows] = features_of(self.model, tokens[raw_rows].to(spec.device), spec.layer_ids).cpu()
        if len(gen_rows):
            prompts = windows(self.train_stream, len(gen_rows), spec.prompt_len, g)
            t, f = regenerate(self.model, prompts.to(spec.device), spec.seq_len, kinds[gen_rows].to(spec.device),
                              spec.top_p, g, spec.layer_ids)
            # items cross the process boundary as CPU tensors (no CUDA IPC); the trainer moves them
            tokens[gen_rows], feats[gen_rows] = t.cpu(), f.cpu()
        tmp = path.with_suffix(".tmp")
        torch.save({"tokens": tokens.to(torch.int32), "temperature": kinds,
                    "prompt_len": spec.prompt_len, "top_p": spec.top_p}, tmp)
        os.replace(tmp, path)
        self.busy += time.perf_counter() - t0
        self.generated += len(tokens)
        if not self._skip(len(tokens)):
            self._emit(tokens, feats, {"chunk": k, "kind": "generated"})

    def _replay(self, pairs, epoch: int) -> None:
        if self._skip(len(pairs)):
            return
        t0 = time.perf_counter()
        by_chunk: dict[int, list[int]] = {}
        for k, r in pairs:
            by_chunk.setdefault(k, []).append(r)
        loaded = {k: torch.load(chunk_path(self.spec.run_dir, k))["tokens"] for k in by_chunk}
        tokens = torch.stack([loaded[k][r] for k, r in pairs]).long()
        feats = features_of(self.model, tokens.to(self.spec.device), self.spec.layer_ids).cpu()
        self.busy += time.perf_counter() - t0
        self._emit(tokens, feats, {"chunk": -1, "kind": f"replay{epoch}"})

    def _emit(self, tokens, feats, info) -> None:
        for i in range(len(tokens)):
            if self.item < self.spec.start_item:     # resumed in the middle of a chunk
                self.item += 1
                continue
            self.seqs += 1
            self.tokens += tokens.shape[1]
            meta = dict(info, item=self.item, producer_busy_s=self.busy, producer_seqs=self.seqs,
                        producer_tokens=self.tokens, generated=self.generated)
            self.item += 1
            while not self.put((tokens[i].clone(), feats[i].clone(), meta)):
                if self.stopped():
                    return


def _producer_entry(spec: ProducerSpec, q, stop) -> None:
    """Process / thread body: run the producer, report an exception as a final item."""
    def put(item) -> bool:
        try:
            q.put(item, timeout=1.0)
            return True
        except queue_mod.Full:
            return False
    try:
        Producer(spec, put, stop.is_set).run()
    except BaseException as e:  # noqa: BLE001 - forwarded to the trainer, which raises it
        import traceback
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))


class ProducerHandle:
    def __init__(self, spec: ProducerSpec, mode: str, queue_size: int):
        if mode == "process":
            import torch.multiprocessing as mp
            ctx = mp.get_context("spawn")
            self.q, self.stop = ctx.Queue(maxsize=queue_size), ctx.Event()
            from splitspec.train import draft as importable   # not __main__ under `python -m`
            self.worker = ctx.Process(target=importable._producer_entry, args=(spec, self.q, self.stop),
                                      daemon=True)
        else:
            self.q, self.stop = queue_mod.Queue(maxsize=queue_size), threading.Event()
            self.worker = threading.Thread(target=_producer_entry, args=(spec, self.q, self.stop), daemon=True)
        self.worker.start()
        self.wait_s = 0.0
        self.first_s: float | None = None

    def get(self, timeout: float = 1800.0):
        t0 = time.perf_counter()
        while True:
            try:
                item = self.q.get(timeout=5.0)
                break
            except queue_mod.Empty:
                alive = self.worker.is_alive()
                if not alive or time.perf_counter() - t0 > timeout:
                    raise RuntimeError("the producer stopped without sending data"
                                       if not alive else f"no data from the producer for {timeout:.0f}s")
        if self.first_s is None:
            self.first_s = time.perf_counter() - t0     # producer start-up, reported apart
        else:
            self.wait_s += time.perf_counter() - t0
        if item[0] == "error":
            raise RuntimeError(f"producer failed: {item[1]}")
        return item

    def poll(self):
        """An item if one is ready, else None (never waits)."""
        try:
            item = self.q.get_nowait()
        except queue_mod.Empty:
            return None
        if item[0] == "error":
            raise RuntimeError(f"producer failed: {item[1]}")
        return item

    def close(self) -> None:
        self.stop.set()
        deadline = time.time() + 30
        while self.worker.is_alive() and time.time() < deadline:
            try:
                self.q.get(timeout=0.2)          # unblock a put
            except Exception:                    # noqa: BLE001 - Empty, or a tensor of a dead producer
                pass
            self.worker.join(timeout=0.1)
        if self.worker.is_alive() and hasattr(self.worker, "terminate"):
            self.worker.terminate()
            self.worker.join(timeout=5)


# ---------------------------------------------------------------- the draft

def resolve_layer_ids(args, target_cfg: ModelConfig) -> tuple[int, ...]:
    if args.target_layer_ids:
        ids = tuple(int(x) for x in args.target_layer_ids.split(","))
    else:
        ids = tuple(default_target_layer_ids(target_cfg.num_hidden_layers, args.num_taps or args.layers))
    for i in ids:
        if not 0 <= i < target_cfg.num_hidden_layers:
            raise SystemExit(f"--target-layer-ids: {i} is outside 0..{target_cfg.num_hidden_layers - 1}")
    return ids


def produced_layers(layer_ids, num_layers: int, distill: float) -> tuple[int, ...]:
    """The layers the producer sends: the taps, plus the target's last layer when soft labels need
    it and it is not already tapped."""
    ids = tuple(layer_ids)
    return ids + (num_layers - 1,) if distill > 0 and num_layers - 1 not in ids else ids


def split_features(feats: torch.Tensor, layer_ids, produced, hidden: int, distill: float):
    """(draft features [.., len(layer_ids) * H], last-layer hidden [.., H] or None) of producer
    features laid out as `produced`."""
    ctx = feats[..., :len(layer_ids) * hidden]
    if distill <= 0:
        return ctx, None
    j = list(produced).index(max(produced))      # the last layer (produced_layers added it)
    return ctx, feats[..., j * hidden:(j + 1) * hidden]


def resolve_mask_id(args, target_path) -> int:
    if args.mask_token_id is not None:
        return args.mask_token_id
    tok_file = Path(target_path) / "tokenizer.json"
    if tok_file.is_file():
        idx = target_tokenizer(target_path).token_to_id(MASK_TOKEN)
        if idx is not None:
            return idx
    raise SystemExit(f"the target's tokenizer has no {MASK_TOKEN}; pass --mask-token-id")


def build_draft(args, target, layer_ids, mask_id) -> DFlashDraft:
    tcfg = target.cfg
    draft = new_draft(tcfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=mask_id,
                      target_layer_ids=layer_ids, intermediate_size=args.intermediate_size, seed=args.seed)
    if args.init in ("target", "target-last"):
        if draft.cfg.intermediate_size != tcfg.intermediate_size:
            raise SystemExit(f"--init {args.init} needs the target's intermediate size")
        L = tcfg.num_hidden_layers
        src = target.model.layers[:args.layers] if args.init == "target" else target.model.layers[L - args.layers:]
        with torch.no_grad():
            for dst, s in zip(draft.layers, src):
                dst.load_state_dict(s.state_dict(), strict=True)
            if args.init == "target-last":
                # The first copied layer reads the output of layer `below`; when that layer is tapped,
                # fc picks its slice and hidden_norm takes that layer's input norm, so
                # k_proj(hidden_norm(fc(features))) is the target's own context K there.
                below = L - args.layers - 1
                if below not in layer_ids:
                    raise SystemExit(f"--init target-last needs target layer {below} among --target-layer-ids")
                H, j = tcfg.hidden_size, list(layer_ids).index(below)
                draft.fc.weight.zero_()
                draft.fc.weight[:, j * H:(j + 1) * H] = torch.eye(H)
                draft.hidden_norm.weight.copy_(src[0].input_layernorm.weight)
                draft.norm.weight.copy_(target.model.norm.weight)
    draft = draft.to(target.lm_head.weight.device)
    draft.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return draft


def make_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def progress(step: int, train_s: float, args) -> float:
    frac = step / max(args.steps, 1)
    if args.max_minutes:
        frac = max(frac, train_s / (args.max_minutes * 60))
    return min(frac, 1.0)


def lr_at(step: int, train_s: float, args) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio x lr at the end of the run (steps or time)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = progress(step, train_s, args)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- evaluation

@dataclass
class EvalSet:
    prompts: list[list[int]]                 # held-out prompts (never trained on)
    tf_tokens: torch.Tensor                  # [n, P + new] target greedy continuations
    tf_prompt_len: int


def eval_set(target, streams, args, n: int, seed_offset: int = 0) -> EvalSet:
    g = torch.Generator().manual_seed(args.seed * 31 + 17 + seed_offset)
    prompts = windows(streams["heldout"], n, args.eval_prompt_len, g).to(target.lm_head.weight.device)
    g2 = torch.Generator().manual_seed(0)
    tf, _ = regenerate(target, prompts, args.eval_prompt_len + args.eval_new_tokens,
                       torch.zeros(n), 1.0, g2, (0,), bf16=False)
    return EvalSet([p.tolist() for p in prompts], tf, args.eval_prompt_len)


@torch.inference_mode()
def teacher_forced(draft, target, es: EvalSet, args) -> dict:
    """Per-slot accuracy and accept-length estimate on the target's greedy continuations of held-out
    prompts, with an anchor at every position of the continuation."""
    tokens = es.tf_tokens
    feats = features_of(target, tokens, draft.cfg.target_layer_ids)
    S = tokens.shape[1]
    pos = torch.arange(es.tf_prompt_len, S - 1)   # b0 … : the roots inference drafts from
    correct = count = 0
    accept, full = 0.0, 0
    for i in range(len(tokens)):
        an = Anchors(pos[None].to(tokens.device), torch.ones(1, len(pos), dtype=torch.bool, device=tokens.device))
        out = objective(draft, feats[i:i + 1], tokens[i:i + 1], an, gamma=args.gamma, attention=args.attention)
        correct = correct + out.correct
        count = count + out.count
        accept += out.accept_sum
        full += out.anchors
    acc = (correct / count.clamp(min=1)).tolist()
    return {"tf_acc": acc, "tf_tau": 1 + accept / max(full, 1)}


@torch.inference_mode()
def tau_eval(draft, target, prompts: list[list[int]], args, *, temperature: float, top_p: float = 1.0,
             sampled_draft: bool = False, eos_ids=()) -> dict:
    """Accept length with the real loop: TargetSequence + DFlashProposer + speculative_generate."""
    from draft_service.proposer import DFlashProposer
    from splitspec.speculate import speculative_generate
    from target_service.engine import TargetSequence
    taus, steps, committed, new_tokens = [], 0, 0, 0
    per_pos = [0] * (draft.cfg.block_size - 1)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=args.seed + 1000 + i)
        max_len = len(prompt) + args.eval_new_tokens + draft.cfg.block_size + 2
        seq = TargetSequence(target, list(prompt), params, max_len=max_len,
                             hidden_layers=tuple(draft.cfg.target_layer_ids))
        draft_params = (SamplingParams(temperature=temperature, top_p=top_p, seed=args.seed + 5000 + i)
                        if sampled_draft and temperature > 0 else None)
        prop = DFlashProposer(draft, max_len=max_len, sampling=draft_params)
        out, stats = speculative_generate(seq, prop, args.eval_new_tokens, eos_ids)
        if stats.verify_steps:
            taus.append(stats.accept_length)
        steps += stats.verify_steps
        committed += stats.committed
        new_tokens += len(out)
        for k, c in enumerate(stats.accepted_per_position[:len(per_pos)]):
            per_pos[k] += c
    return {"tau": sum(taus) / max(len(taus), 1), "tau_pooled": committed / max(steps, 1),
            "verify_steps": steps, "new_tokens": new_tokens, "prompts": len(prompts),
            "accept_rate_per_position": [c / max(steps, 1) for c in per_pos],
            "seconds": time.perf_counter() - t0}


def full_eval(draft, target, es: EvalSet, args, eos_ids) -> dict:
    res = {"T0": tau_eval(draft, target, es.prompts, args, temperature=0.0, eos_ids=eos_ids),
           "T1_greedy_draft": tau_eval(draft, target, es.prompts, args, temperature=1.0,
                                       top_p=args.eval_top_p, eos_ids=eos_ids),
           "T1_sampled_draft": tau_eval(draft, target, es.prompts, args, temperature=1.0,
                                        top_p=args.eval_top_p, sampled_draft=True, eos_ids=eos_ids)}
    res.update(teacher_forced(draft, target, es, args))
    return res


# ---------------------------------------------------------------- checkpoints, export, card

RESUME_KEYS = ("layers", "block_size", "target_layer_ids", "num_taps", "intermediate_size", "init",
               "prompt_len", "seq_len", "num_seqs", "greedy_frac", "regen_temperature", "regen_top_p",
               "raw_frac", "gen_batch", "replay_batch", "max_files", "batch_seqs", "seed", "distill")


def save_ckpt(path: Path, draft, opt, state: dict, args) -> None:
    blob = {"model": draft.state_dict(), "optimizer": opt.state_dict(), "state": state,
            "args": vars(args), "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_ckpt(path: Path, draft, opt, args) -> dict:
    blob = torch.load(path, weights_only=False, map_location="cpu")
    diff = [k for k in RESUME_KEYS if blob["args"].get(k) != getattr(args, k)]
    if diff:
        raise SystemExit(f"{path}: checkpoint was made with different {', '.join(diff)}; "
                         f"use the same settings or --fresh")
    draft.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"]["torch"])
    random.setstate(blob["rng"]["python"])
    return blob["state"]


def export(draft, out: Path, card: str | None, metrics: dict | None = None) -> None:
    """save_draft into a sibling temp folder, then move the files in (a kill never leaves a
    half-written model.safetensors in --out)."""
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp)
    if card is not None:
        (tmp / "README.md").write_text(card)
    if metrics is not None:
        (tmp / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)          # safetensors writes 0600
        os.replace(f, out / f.name)
    tmp.rmdir()


def machine() -> str:
    from .evaluate import machine as m
    return m()


def _fmt_acc(acc) -> str:
    return " | ".join(f"{a:.3f}" for a in acc)


def write_card(m: dict, args, final: bool) -> str:
    cfg = m["draft_config"]
    B = cfg["block_size"]
    ev = m.get("eval") or {}
    status = ("" if final else
              f"\n> **Provisional export** at step {m['step']:,} ({m['train_seconds'] / 60:.1f} min of "
              f"training); the run was still going when this was written. The final card replaces this.\n")
    if m.get("note"):
        status += f"\n> {m['note']}\n"
    rows = []
    names = {"T0": "temperature 0 (greedy verification)",
             "T1_greedy_draft": f"T=1.0, top_p={args.eval_top_p}: greedy draft + target-only verification",
             "T1_sampled_draft": f"T=1.0, top_p={args.eval_top_p}: sampled drafts + min(1, p/q)"}
    for key, label in names.items():
        r = ev.get(key)
        if r:
            rates = " / ".join(f"{x:.2f}" for x in r["accept_rate_per_position"])
            rows.append(f"| {label} | **{r['tau']:.2f}** | {r['tau_pooled']:.2f} | {r['verify_steps']} | {rates} |")
    tau_table = ("| setting | τ (mean per request) | τ (pooled) | verify steps | P(slot k accepted), k = 1..%d |\n"
                 "|---|---|---|---|---|\n" % (B - 1) + "\n".join(rows)) if rows else "(no evaluation yet)"
    head = " | ".join(f"k={k}" for k in range(1, B))
    acc_rows = []
    if m.get("train_acc"):
        acc_rows.append(f"| training (last {m['acc_window']} steps) | {_fmt_acc(m['train_acc'])} |")
    if ev.get("tf_acc"):
        acc_rows.append(f"| held-out, target greedy continuations | {_fmt_acc(ev['tf_acc'])} |")
    acc_table = f"| data | {head} |\n|---|{'---|' * (B - 1)}\n" + "\n".join(acc_rows)
    ids = cfg["dflash_config"]["target_layer_ids"]
    data = m["data"]
    rates = m.get("rates", {})
    return f"""# splitspec-code-draft

The default **DFlash block-diffusion draft** of splitspec for
[`splitspec-code-target`](../splitspec-code-target/): one forward drafts a block of {B - 1} tokens
(verify width / block size {B}), conditioned on the target's hidden states of layers {ids}
(KV injection). Trained online against the frozen target with `splitspec/train/draft.py`.
{status}
## Model

| | |
|---|---|
| parameters | {m['params']:,} (draft layers + `fc` + norms; embedding and lm_head are the target's, frozen) |
| draft layers / hidden / intermediate | {cfg['num_hidden_layers']} / {cfg['hidden_size']} / {cfg['intermediate_size']} |
| heads / KV heads / head dim | {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {cfg['head_dim']} |
| block size | {B} (`block_size` stored as the verify width: the last committed token + {B - 1} masks) |
| mask token id | {cfg['dflash_config']['mask_token_id']} (`<\\|mask\\|>`) |
| target layers tapped | {ids} of {cfg['num_target_layers']} (`fc`: {len(ids)} x {cfg['hidden_size']} -> {cfg['hidden_size']}) |
| initialisation | {args.init} |

Target layer taps: {m['taps_reason']}

## Data

The target's own continuations of training-corpus prompts (Python standard library, train split of
`splitspec.train.corpus`; the held-out files are never used): {args.prompt_len}-token prompt windows
continued by the target to {args.seq_len} tokens, {args.gen_batch} rows per batched forward,
{args.greedy_frac:.0%} of the rows at temperature 0 and {1 - args.greedy_frac - args.raw_frac:.0%} at
temperature {args.regen_temperature} (top_p {args.regen_top_p}){f', {args.raw_frac:.0%} raw corpus windows' if args.raw_frac else ''}.
Regenerated by this run: {data['generated_seqs']:,} sequences ({data['generated_seqs'] * args.seq_len:,} tokens, cached as token ids){_cached_note(data, args)};
sequences consumed by training: {data['consumed_seqs']:,} fresh ({data['consumed_seqs'] / max(data['generated_seqs'], args.num_seqs, 1):.2f} passes over {max(data['generated_seqs'], args.num_seqs):,})
plus {data.get('reused_seqs', 0):,} reuses of a recent sequence with new anchors while the producer was behind
(at most {args.max_reuse} uses per sequence).
Features are computed online by the producer (target forward), never stored.

## Training

{m['step']:,} steps of {args.batch_seqs} sequences x {args.anchors} random anchors x {B} block tokens
(weighted cross-entropy through the target's lm_head against {_labels(args)}, weight exp(-(k-1)/{args.gamma:g}) for slot k),
AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak LR {args.lr}, {args.warmup} warm-up steps,
cosine decay to {args.min_lr_ratio} x peak{f' over a {args.max_minutes:g}-minute budget' if args.max_minutes else ''},
gradient clipping {args.clip}, bfloat16 autocast {'on' if args.bf16 else 'off'}, seed {args.seed}.
Wall time: {m['train_seconds'] / 60:.1f} min training, {m['total_seconds'] / 60:.1f} min end to end, on a {m['machine']}.
Producer: {rates.get('producer_seq_s', 0):.2f} seq/s ({rates.get('producer_tok_s', 0):.0f} tokens/s) while busy;
trainer: {rates.get('consumer_seq_s', 0):.2f} seq/s ({rates.get('consumer_blocktok_s', 0):.0f} block tokens/s) while busy,
waiting on the producer {rates.get('consumer_wait_frac', 0):.0%} of the time.

## Per-position accuracy (draft argmax = label at slot k)

{acc_table}

Teacher-forced accept length estimate on the held-out continuations: {ev.get('tf_tau', float('nan')):.2f}.

## Accept length τ on held-out prompts

{ev.get('T0', {}).get('prompts', 0)} held-out prompts ({args.eval_prompt_len}-token windows of the held-out stdlib files),
{args.eval_new_tokens} new tokens each, measured with the real verification code
(`splitspec.speculate.speculative_generate`, `TargetSequence`, `DFlashProposer`), float32, {B - 1} drafted tokens
per step (τ ceiling {B}). τ = committed tokens / verify steps, averaged per request.

{tau_table}

## Reproduce

```
{m['command']}
```

Resumable: re-running the command continues from `{args.run_dir}/ckpt.pt` and the cached token ids
under `{args.run_dir}/data/`. Same interpreter (the corpus is its standard library) and seed;
the producer runs asynchronously, so results match up to floating-point differences.
"""


def _cached_note(data, args) -> str:
    cached = args.num_seqs - data["generated_seqs"]
    if cached <= 0:
        return ""
    return (f"; the other {cached:,} of the {args.num_seqs:,} were already cached in `{args.run_dir}/data/` "
            f"(regenerated earlier with the settings above) and only replayed")


def _labels(args) -> str:
    d = getattr(args, "distill", 0.0) or 0.0
    if d <= 0:
        return "the data tokens"
    if d >= 1:
        return "the target's next-token distribution (soft labels)"
    return f"{d:g} x the target's next-token distribution + {1 - d:g} x the data tokens"


def taps_reason(ids, args, target_cfg) -> str:
    L, n = target_cfg.num_hidden_layers, len(ids)
    default = default_target_layer_ids(L, n)
    if list(ids) == list(default):
        return f"default_target_layer_ids({L}, {n}) (z-lab's even spread round(1 + i(L-4)/(n-1)))."
    return (f"{list(ids)}, chosen for a {L}-layer target instead of the default spread {default} "
            f"(round(1 + i(L-4)/(n-1)), built for deep targets, which for L = {L} "
            f"{'repeats layers and ' if len(set(default)) < n else ''}stops at layer {max(default)}): evenly spaced "
            f"from an early layer (token identity and local syntax, which the draft cannot otherwise see for "
            f"context tokens) to the last layer (the target's own next-token plan, EAGLE's single feature).")


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    command = "python -m splitspec.train.draft " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    run_dir, out = Path(args.run_dir), Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "ckpt.pt"
    if args.fresh:
        ckpt_path.unlink(missing_ok=True)
        shutil.rmtree(run_dir / "data", ignore_errors=True)
        (run_dir / "corpus.pt").unlink(missing_ok=True)
    cores = os.cpu_count() or 1
    # One OpenMP thread per process on a small shared machine: with more threads than free cores,
    # spinning barriers make each matmul 10-40x slower.
    threads = args.threads or (1 if cores <= 2 else cores - args.producer_threads)
    torch.set_num_threads(threads)

    target = load_target(args.target_model_path, device=args.device)
    tcfg = target.cfg
    tok = target_tokenizer(args.target_model_path) if (Path(args.target_model_path) / "tokenizer.json").is_file() else None
    eos_ids = eos_ids_of(tcfg, tok)
    layer_ids = resolve_layer_ids(args, tcfg)
    mask_id = resolve_mask_id(args, args.target_model_path)
    draft = build_draft(args, target, layer_ids, mask_id)
    opt = make_optimizer(draft, args)
    streams = corpus_streams(args.target_model_path, run_dir, args.max_files)
    print(f"target: {args.target_model_path} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, "
          f"vocab {tcfg.vocab_size}); draft: {param_count(draft):,} params, {args.layers} layers, block "
          f"{args.block_size}, taps {list(layer_ids)}, mask id {mask_id}; corpus {len(streams['train']):,} train "
          f"/ {len(streams['heldout']):,} held-out tokens; trainer threads {threads}", flush=True)

    if args.calibrate:
        return calibrate(args, target, draft, opt, streams, layer_ids)
    if args.eval_only:
        return eval_only(args, target, streams, eos_ids)

    state = {"step": 0, "train_seconds": 0.0, "consumed": 0, "history": [], "last_eval": None}
    if ckpt_path.is_file():
        state = load_ckpt(ckpt_path, draft, opt, args)
        print(f"resumed from {ckpt_path} at step {state['step']}", flush=True)

    num_chunks = max(1, math.ceil(args.num_seqs / args.gen_batch))
    produced = produced_layers(layer_ids, tcfg.num_hidden_layers, args.distill)
    spec = ProducerSpec(target_path=str(args.target_model_path), run_dir=str(run_dir), layer_ids=produced,
                        prompt_len=args.prompt_len, seq_len=args.seq_len, num_chunks=num_chunks,
                        gen_batch=args.gen_batch, replay_batch=args.replay_batch, greedy_frac=args.greedy_frac,
                        raw_frac=args.raw_frac, temperature=args.regen_temperature, top_p=args.regen_top_p,
                        seed=args.seed, threads=args.producer_threads, bf16=args.producer_bf16,
                        start_item=state["consumed"], max_files=args.max_files, device=args.device)
    producer = ProducerHandle(spec, args.producer, args.queue_size)
    periodic = eval_set(target, streams, args, args.eval_prompts) if args.eval_every else None
    try:
        info = train_loop(args, draft, opt, producer, state, ckpt_path, target, periodic, eos_ids,
                          started, command, layer_ids, out, produced)
    finally:
        producer.close()
    save_ckpt(ckpt_path, draft, opt, state, args)

    # final evaluation: the producer is gone
    torch.set_num_threads(args.threads or (1 if cores <= 2 else cores))
    print("training done; final evaluation", flush=True)
    draft.eval()
    es = eval_set(target, streams, args, args.final_eval_prompts, seed_offset=1)
    ev = full_eval(draft, target, es, args, eos_ids)
    m = metrics(args, draft, state, info, ev, started, command, layer_ids, tcfg)
    export(draft, out, write_card(m, args, final=True), m)
    (run_dir / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
    print(json.dumps({k: ev[k] for k in ev}, indent=2), flush=True)
    print(f"wrote {out} in {(time.time() - started) / 60:.1f} min", flush=True)
    return 0


def metrics(args, draft, state, info, ev, started, command, layer_ids, tcfg) -> dict:
    return {"command": command, "params": param_count(draft), "draft_config": draft.cfg.to_dict(),
            "step": state["step"], "train_seconds": state["train_seconds"],
            "total_seconds": time.time() - started, "machine": machine(),
            "data": {"generated_seqs": info.get("generated", 0), "consumed_seqs": state["consumed"],
                     "reused_seqs": state.get("reused", 0)},
            "rates": info.get("rates", {}), "train_acc": info.get("train_acc"),
            "acc_window": info.get("acc_window", 0), "eval": ev,
            "taps_reason": taps_reason(layer_ids, args, tcfg), "history": state["history"],
            "args": vars(args)}


def eval_only(args, target, streams, eos_ids) -> int:
    """Final evaluation of the draft in --out, e.g. when a run was stopped before its own."""
    from draft_service.dflash import load_draft
    out = Path(args.out)
    m = json.loads((out / "training_metrics.json").read_text())
    draft = load_draft(out, args.target_model_path)
    train_args = argparse.Namespace(**{**vars(args), **m.get("args", {}),
                                       "final_eval_prompts": args.final_eval_prompts,
                                       "eval_new_tokens": args.eval_new_tokens, "eval_top_p": args.eval_top_p,
                                       "eval_prompt_len": args.eval_prompt_len, "attention": args.attention})
    torch.set_num_threads(args.threads or 1)
    es = eval_set(target, streams, train_args, train_args.final_eval_prompts, seed_offset=1)
    m["eval"] = full_eval(draft, target, es, train_args, eos_ids)
    m["note"] = (f"Evaluated by `--eval-only` on the export of step {m['step']:,}; training ran "
                 f"{m['train_seconds'] / 60:.1f} min.")
    export(draft, out, write_card(m, train_args, final=True), m)
    print(json.dumps(m["eval"], indent=2), flush=True)
    return 0


def train_loop(args, draft, opt, producer, state, ckpt_path, target, periodic, eos_ids, started, command,
               layer_ids, out, produced) -> dict:
    from tqdm import tqdm
    B = args.block_size
    H = target.cfg.hidden_size
    teacher = Teacher.of(target) if args.distill > 0 else None
    draft.train()
    bar = tqdm(total=args.steps, initial=state["step"], unit="step", mininterval=10, ncols=150,
               file=sys.stderr, dynamic_ncols=False)
    seg_start = time.time()
    base_train_s = state["train_seconds"]
    busy = 0.0
    consumed_seg = blocktok_seg = 0
    window = 50
    hist_correct, hist_count, hist_loss, hist_tau = [], [], [], []
    last_export = time.time()
    last_meta: dict = {}
    info: dict = {}
    reuse: list = []          # recent fresh items [item, uses], for --max-reuse

    def rates() -> dict:
        el = time.time() - seg_start
        pb = last_meta.get("producer_busy_s", 0.0) or 1e-9
        return {"producer_seq_s": last_meta.get("producer_seqs", 0) / pb,
                "producer_tok_s": last_meta.get("producer_tokens", 0) / pb,
                "consumer_seq_s": consumed_seg / max(busy, 1e-9),
                "consumer_blocktok_s": blocktok_seg / max(busy, 1e-9),
                "consumer_wait_frac": producer.wait_s / max(el - (producer.first_s or 0.0), 1e-9),
                "producer_startup_s": producer.first_s or 0.0}

    def snapshot(final=False) -> dict:
        k = min(window, len(hist_count))
        acc = None
        if k:
            c = torch.stack(hist_correct[-k:]).sum(0)
            n = torch.stack(hist_count[-k:]).sum(0).clamp(min=1)
            acc = (c / n).tolist()
        info.update({"rates": rates(), "train_acc": acc, "acc_window": k,
                     "generated": last_meta.get("generated", 0)})
        return info

    while True:
        train_s = base_train_s + time.time() - seg_start
        if state["step"] >= args.steps or (args.max_minutes and train_s >= args.max_minutes * 60):
            break
        step = state["step"]
        items, fresh = [], []
        for _ in range(args.batch_seqs):
            it = producer.poll() if reuse else None
            if it is None and reuse:
                # Starved: rather than idle, reuse a recent sequence with new random anchors.
                usable = [e for e in reuse if e[1] < args.max_reuse]
                if usable:
                    e = usable[int(torch.randint(len(usable), (1,)))]
                    e[1] += 1
                    items.append(e[0])
                    continue
            if it is None:
                it = producer.get()
            fresh.append(it)
            items.append(it)
            if args.max_reuse > 1:
                reuse.append([it, 1])
                del reuse[:-args.reuse_buffer]
        t0 = time.perf_counter()
        if fresh:
            last_meta = fresh[-1][2]
        dev = target.lm_head.weight.device
        tokens = torch.stack([it[0] for it in items]).to(dev)
        feats, final = split_features(torch.stack([it[1] for it in items]).to(dev), layer_ids, produced, H,
                                      args.distill)
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        an = sample_anchors(len(items), tokens.shape[1], args.anchors, g, min_anchor=args.min_anchor)
        anchors = Anchors(an.pos.to(dev), an.valid.to(dev))
        lr = lr_at(step, train_s, args)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
            res = objective(draft, feats, tokens, anchors, gamma=args.gamma, attention=args.attention,
                            teacher=teacher, final_hidden=final, distill=args.distill)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(draft.parameters(), args.clip))
        opt.step()
        busy += time.perf_counter() - t0
        consumed_seg += len(items)
        blocktok_seg += len(items) * args.anchors * B
        state["step"] = step + 1
        state["consumed"] += len(fresh)
        state["reused"] = state.get("reused", 0) + len(items) - len(fresh)
        state["train_seconds"] = base_train_s + time.time() - seg_start
        hist_correct.append(res.correct)
        hist_count.append(res.count)
        hist_loss.append(res.loss.item())
        hist_tau.append(1 + res.accept_sum / max(res.anchors, 1))
        del hist_correct[:-window], hist_count[:-window], hist_loss[:-window], hist_tau[:-window]
        k = len(hist_count)
        acc = (torch.stack(hist_correct).sum(0) / torch.stack(hist_count).sum(0).clamp(min=1)).tolist()
        r = rates()
        bar.set_postfix_str(
            f"loss {sum(hist_loss) / k:.3f} acc {'/'.join(f'{a * 100:.0f}' for a in acc)} "
            f"tauTF {sum(hist_tau) / k:.2f} lr {lr:.1e} blk_tok/s {r['consumer_blocktok_s']:.0f} "
            f"prod {r['producer_seq_s']:.2f}seq/s cons {r['consumer_seq_s']:.2f}seq/s "
            f"wait {r['consumer_wait_frac']:.0%} reused {state.get('reused', 0)}"
            + (f" budget left {(args.max_minutes * 60 - state['train_seconds']) / 60:.0f}m" if args.max_minutes else ""),
            refresh=False)
        bar.update(1)
        if state["step"] % 200 == 0:
            state["history"].append({"step": state["step"], "train_s": round(state["train_seconds"], 1),
                                     "loss": sum(hist_loss) / k, "acc": acc, "tau_tf": sum(hist_tau) / k,
                                     "gnorm": gnorm, **{kk: round(v, 3) for kk, v in r.items()}})
            bar.write(f"step {state['step']}: loss {sum(hist_loss) / k:.3f} acc "
                      f"{' '.join(f'{a:.2f}' for a in acc)} tau_tf {sum(hist_tau) / k:.2f} | producer "
                      f"{r['producer_seq_s']:.2f} seq/s {r['producer_tok_s']:.0f} tok/s (busy), generated "
                      f"{last_meta.get('generated', 0)} | trainer {r['consumer_seq_s']:.2f} seq/s "
                      f"{r['consumer_blocktok_s']:.0f} block tok/s (busy), waits {r['consumer_wait_frac']:.0%}, "
                      f"fresh {state['consumed']} reused {state.get('reused', 0)}")
        if periodic is not None and args.eval_every and state["step"] % args.eval_every == 0:
            draft.eval()
            ev = tau_eval(draft, target, periodic.prompts, args, temperature=0.0, eos_ids=eos_ids)
            draft.train()
            state["last_eval"] = {"step": state["step"], "T0": ev}
            state["history"].append({"step": state["step"], "eval_tau_T0": ev["tau"]})
            bar.write(f"step {state['step']}: held-out tau at T=0 {ev['tau']:.2f} over {ev['prompts']} "
                      f"prompts ({ev['seconds']:.0f}s); per-position accept "
                      f"{' '.join(f'{a:.2f}' for a in ev['accept_rate_per_position'])}")
        if state["step"] % args.ckpt_every == 0:
            save_ckpt(ckpt_path, draft, opt, state, args)
        if args.export_every_minutes and time.time() - last_export >= args.export_every_minutes * 60:
            last_export = time.time()
            ev = {"T0": state["last_eval"]["T0"]} if state.get("last_eval") else {}
            m = metrics(args, draft, state, snapshot(), ev, started, command, layer_ids, target.cfg)
            export(draft, out, write_card(m, args, final=False), m)
            save_ckpt(ckpt_path, draft, opt, state, args)
            bar.write(f"step {state['step']}: provisional export to {out}")
    bar.close()
    return snapshot(final=True)


def calibrate(args, target, draft, opt, streams, layer_ids) -> int:
    """Rates of the three stages, each on this process's threads. Reports wall time and process CPU
    time (with one thread the CPU time is the rate an uncontended core would give)."""
    g = torch.Generator().manual_seed(0)
    b = args.gen_batch
    saved = torch.get_num_threads()
    torch.set_num_threads(args.producer_threads)

    dev = target.lm_head.weight.device

    def timed(fn):
        w, c = time.perf_counter(), time.process_time()
        r = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return r, time.perf_counter() - w, time.process_time() - c

    prompts = windows(streams["train"], b, args.prompt_len, g).to(dev)
    temps = torch.tensor([0.0 if i % 2 == 0 else args.regen_temperature for i in range(b)], device=dev)
    ptarget = load_target(args.target_model_path, dtype="bfloat16" if args.producer_bf16 else "float32",
                          device=args.device)
    produced = produced_layers(layer_ids, target.cfg.num_hidden_layers, args.distill)
    (toks, feats), w, c = timed(lambda: regenerate(ptarget, prompts, args.seq_len, temps, args.regen_top_p, g,
                                                   produced))
    gen_tok = b * (args.seq_len - args.prompt_len)
    print(f"regeneration ({args.producer_threads} threads, bf16={args.producer_bf16}): {b} rows x "
          f"{args.seq_len} tokens: wall {w:.1f}s ({b / w:.2f} seq/s, {gen_tok / w:.0f} generated tok/s); "
          f"cpu {c:.1f}s ({b / c:.2f} seq/s, {gen_tok / c:.0f} tok/s)", flush=True)
    rb = toks[:args.replay_batch]
    _, w, c = timed(lambda: features_of(ptarget, rb, produced))
    print(f"feature replay: {len(rb)} rows: wall {w:.2f}s ({len(rb) / w:.2f} seq/s); cpu {c:.2f}s "
          f"({len(rb) / c:.2f} seq/s, {rb.numel() / c:.0f} tok/s)", flush=True)
    torch.set_num_threads(saved)
    feats, final = split_features(feats, layer_ids, produced, target.cfg.hidden_size, args.distill)
    teacher = Teacher.of(target) if args.distill > 0 else None
    draft.train()
    walls, cpus = [], []
    for step in range(args.calibrate + 1):
        idx = torch.randint(0, b, (args.batch_seqs,), generator=g)
        an = sample_anchors(args.batch_seqs, args.seq_len, args.anchors, g, min_anchor=args.min_anchor)
        anchors = Anchors(an.pos.to(dev), an.valid.to(dev))
        idx = idx.to(dev)

        def one():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
                res = objective(draft, feats[idx], toks[idx], anchors, gamma=args.gamma, attention=args.attention,
                                teacher=teacher, final_hidden=None if final is None else final[idx],
                                distill=args.distill)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            opt.step()
            return res
        res, w, c = timed(one)
        if step:
            walls.append(w)
            cpus.append(c)
    w, c = sum(walls) / max(len(walls), 1), sum(cpus) / max(len(cpus), 1)
    blk = args.batch_seqs * args.anchors * args.block_size
    print(f"training ({saved} threads, {args.attention}, bf16={args.bf16}, {args.batch_seqs} seqs x "
          f"{args.anchors} anchors): wall {w:.3f} s/step ({args.batch_seqs / w:.2f} seq/s, {blk / w:.0f} block "
          f"tok/s); cpu {c:.3f} s/step ({args.batch_seqs / c:.2f} seq/s, {blk / c:.0f} block tok/s); "
          f"loss {res.loss.item():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
